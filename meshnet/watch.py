"""`meshnet watch`: a live, readable feed of mesh.> plus periodic tables of nodes, coverage, sessions."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TextIO

from bus import subjects
from bus.client import Bus
from bus.config import ENV_URL, ENV_USER, BusSettings, add_bus_arguments
from bus.errors import BusConnectError
from bus.runinfo import RunInfo, read_run_file, run_file_path
from schemas.audit import NodeWork, RouteParticipation, ValidationEvent, ValidationVerdict
from schemas.base import BusMessage
from schemas.node import NodeAnnouncement, NodeHeartbeat
from schemas.rebalance import RebalanceDirective
from schemas.registry import UnknownMessage
from schemas.route import DriverAlive, RouteDirective, RouteReply, RouteRequest, RouteWithdrawal
from schemas.telemetry import GenerationTelemetry, HopTelemetry
from schemas.tracker import NodeSummary, TrackerHello, TrackerStatus
from schemas.validation import QuarantineNotice
from tracker.coverage import coverage_maps
from tracker.registry import Registry, RegistryConfig
from tracker.views import node_view

STALE_AFTER_S = 5.0


def _hops(directive: RouteDirective) -> str:
    return " -> ".join(f"{h.node_id}[{h.layer_start},{h.layer_end})" for h in directive.session.hops)


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f}MB"


SUMMARIES: dict[type, Callable[[BusMessage], str]] = {
    NodeAnnouncement: lambda m: (
        f"{m.node_id} {m.capability.model_name} {m.capability.layers} {m.capability.cache_abi} "
        f"kv {m.capability.kv_profile} at {m.activation_url}{' (spare)' if m.spare else ''}"
        f"{' LEAVING' if m.leaving else ''}"
    ),
    NodeHeartbeat: lambda m: (
        f"{m.node_id} load {m.load:.2f} q {m.queue_depth} decode {m.decode_tokens_per_second:.0f} tok/s "
        f"sessions {m.sessions} cache {_mb(m.cache_bytes)} free {m.free_session_slots}"
    ),
    RouteDirective: lambda m: (
        f"{m.action.upper()} session {m.session.session_id} route {m.session.route_id} by {m.issued_by}: "
        f"{_hops(m)}{f' reason: {m.reason}' if m.reason else ''}"
    ),
    RebalanceDirective: lambda m: f"{m.node_id} load {m.model} [{m.layer_start},{m.layer_end}): {m.reason}",
    GenerationTelemetry: lambda m: (
        f"{m.session_id} {m.phase} prefill {m.prefill_tokens_done}/{m.prefill_tokens_total} "
        f"gen {m.generated_tokens} {m.rolling_tokens_per_second:.1f} tok/s"
        f"{f' failed: {m.failure_reason}' if m.failure_reason else ''}"
        f"{f' finish: {m.finish_reason}' if m.finish_reason else ''}"
    ),
    HopTelemetry: lambda m: (
        f"{m.session_id} hop {m.hop_index} {m.node_id} [{m.layer_start},{m.layer_end}) {m.phase} "
        f"pos {m.position} prefill {m.prefill_tokens} decode {m.decode_tokens} "
        f"compute {m.compute_ms:.0f}ms cache {_mb(m.cache_bytes)}{f' reason: {m.reason}' if m.reason else ''}"
    ),
    TrackerHello: lambda m: f"{m.tracker_id} asks {', '.join(m.node_ids) or 'every node'} to announce",
    TrackerStatus: lambda m: f"{m.tracker_id}: {m.n_nodes} node(s), {m.n_sessions} session(s)",
    RouteRequest: lambda m: f"route for {m.model} ({m.policy.kind}) session {m.session_id or '-'}",
    RouteWithdrawal: lambda m: f"route request {m.request_id} withdrawn (session {m.session_id or '-'}): {m.reason}",
    RouteReply: lambda m: (
        f"route {m.session.route_id} ({len(m.session.hops)} hops)" if m.session
        else f"refused {m.error.code if m.error else '?'}: {m.error.message if m.error else ''}"
    ),
    RouteParticipation: lambda m: (
        f"{m.session_id} hop {m.hop_index + 1}/{m.n_hops} {m.node_id} [{m.layer_start},{m.layer_end})"
    ),
    NodeWork: lambda m: (
        f"{m.node_id} {m.session_id} prefill {m.prefill_tokens} decode {m.decode_tokens} "
        f"x {m.n_layers} layers = {m.work_units} units"
    ),
    ValidationEvent: lambda m: (
        f"{m.session_id} {len(m.hops)} hops seed {m.sampling.seed} {m.output_tokens} output tokens"
        f"{' (sampled for replay)' if m.sampled else ''}"
    ),
    ValidationVerdict: lambda m: (
        f"{m.session_id} replay {m.outcome} on {m.replay_backend}: {m.compared_tokens}/{m.output_tokens} tokens"
        f"{f', first difference at {m.first_diff}' if m.first_diff is not None else ''}"
        f"{'; implicates ' + ', '.join(m.implicated) if m.implicated else ''}"
    ),
    QuarantineNotice: lambda m: f"{m.node_id} {'QUARANTINED' if m.action == 'quarantine' else 'back in routes'}: {m.reason}",
    DriverAlive: lambda m: f"gateway {m.driver_id} alive",
}

# beats that come every second or two whatever happens: printed only with --heartbeats
PERIODIC = (NodeHeartbeat, TrackerStatus, DriverAlive)


def shown(msg: BusMessage, heartbeats: bool) -> bool:
    """Whether the feed prints `msg` (pure): everything but the periodic beats, those too with `heartbeats`."""
    return heartbeats or not isinstance(msg, PERIODIC)


def summarize(msg: BusMessage) -> str:
    """A one-line, human summary of any bus message."""
    fn = SUMMARIES.get(type(msg))
    if fn is not None:
        return fn(msg)
    if isinstance(msg, UnknownMessage):
        return f"({msg.type_name}) {msg.model_dump_json(exclude={'v', 'ts'})[:160]}"
    return msg.model_dump_json()[:160]


@dataclass
class WatchState:
    """What the watcher has seen so far."""

    registry: Registry = field(default_factory=lambda: Registry(RegistryConfig(expire_after=STALE_AFTER_S)))
    orphan_heartbeats: dict[str, NodeHeartbeat] = field(default_factory=dict)
    orphan_seen: dict[str, float] = field(default_factory=dict)  # when each orphan last beat (monotonic)
    sessions: dict[str, RouteDirective] = field(default_factory=dict)  # open, by route_id
    status: TrackerStatus | None = None
    events: int = 0

    def apply(self, msg: BusMessage, now: float) -> None:
        """Fold one message into the state."""
        self.events += 1
        if isinstance(msg, NodeAnnouncement) and msg.leaving:
            self.registry.leave(msg.node_id, msg.started_at)
            self._forget_orphan(msg.node_id, msg.started_at)
        elif isinstance(msg, NodeAnnouncement):
            self.registry.announce(msg, now)
            self._forget_orphan(msg.node_id, None)
        elif isinstance(msg, NodeHeartbeat):
            if not self.registry.heartbeat(msg, now):
                self.orphan_heartbeats[msg.node_id] = msg
                self.orphan_seen[msg.node_id] = now
        elif isinstance(msg, RouteDirective):
            if msg.action == "open":
                self.sessions[msg.session.route_id] = msg
            else:
                self.sessions.pop(msg.session.route_id, None)
        elif isinstance(msg, TrackerStatus):
            self.status = msg

    def _forget_orphan(self, node_id: str, started_at: float | None) -> None:
        """Drop a node heard only by heartbeat: it announced (now a registry row), or its
        process said it is leaving (`started_at` given: only that process's beats go)."""
        hb = self.orphan_heartbeats.get(node_id)
        if hb is not None and (started_at is None or hb.started_at in (0.0, started_at)):
            del self.orphan_heartbeats[node_id]
            self.orphan_seen.pop(node_id, None)


def _heartbeat_row(node_id: str, hb: NodeHeartbeat, summary: NodeSummary | None, age: float) -> str:
    """A node row for a node heard only by its heartbeats (pure): a watcher started after the
    node announced never sees its announcement, so its model and layers come from the tracker's
    status table; "?" only when the tracker has not listed it (yet)."""
    model = summary.model if summary is not None else "?"
    layers = f"[{summary.layer_start},{summary.layer_end})/{summary.n_layer}" if summary is not None else "?"
    return (
        f"{node_id:<18} {model[:14]:<14} {layers:<12} {hb.decode_tokens_per_second:>7.1f} {hb.sessions:>5} "
        f"{_mb(hb.cache_bytes):>9} {age:>5.1f}s{' STALE' if age > STALE_AFTER_S else ''}"
    )


def render(state: WatchState, now: float) -> str:
    """Tables: nodes, coverage per model revision, active sessions."""
    lines = [f"--- nodes ({len(state.registry) + len(state.orphan_heartbeats)}) ---"]
    lines.append(f"{'node':<18} {'model':<14} {'layers':<12} {'tok/s':>7} {'sess':>5} {'cache':>9} {'age':>6}")
    for s in sorted(state.registry, key=lambda s: s.node_id):
        cap, hb = s.capability, s.heartbeat
        tps = hb.decode_tokens_per_second if hb else cap.decode_tokens_per_second
        age = s.age(now)
        lines.append(
            f"{s.node_id:<18} {cap.model_name[:14]:<14} {f'[{cap.layers.start},{cap.layers.end})/{cap.layers.n_layer}':<12} "
            f"{tps:>7.1f} {hb.sessions if hb else 0:>5} {_mb(hb.cache_bytes if hb else 0):>9} "
            f"{age:>5.1f}s{' STALE' if age > STALE_AFTER_S else ''}"
        )
    known = {n.node_id: n for n in state.status.nodes} if state.status is not None else {}
    for node_id, hb in sorted(state.orphan_heartbeats.items()):
        lines.append(_heartbeat_row(node_id, hb, known.get(node_id), now - state.orphan_seen.get(node_id, now)))
    lines.append("--- coverage ---")
    if state.status is not None and state.status.coverage:
        for c in state.status.coverage:
            lines.append(
                f"{c.model} rev {c.model_revision[:12]} {c.cache_abi}: {c.status}"
                f" (min {c.min_replicas}/{c.target_replicas} replicas, {'routable' if c.routable else 'NOT routable'})"
                + (f" gaps {c.gaps}" if c.gaps else "")
                + (f" thin {c.under_provisioned}" if c.under_provisioned else "")
            )
    else:
        views = [node_view(s) for s in state.registry]
        for m in coverage_maps(views):
            lines.append(
                f"{m.model} rev {m.model_revision[:12]} {m.cache_abi}: {m.status} "
                f"({'routable' if m.routable else 'NOT routable'})" + (f" gaps {list(m.gaps)}" if m.gaps else "")
            )
    if state.status is not None and state.status.quarantined:
        lines.append(f"--- quarantined (no new routes): {', '.join(state.status.quarantined)} ---")
    if state.status is not None:
        lines.append(f"--- sessions ({state.status.n_sessions}, from tracker {state.status.tracker_id}) ---")
        lines += [f"{s.session_id} {s.route_id} {s.model} {' -> '.join(s.nodes)} {s.age_s:.0f}s" for s in state.status.sessions]
    else:
        lines.append(f"--- sessions ({len(state.sessions)}, seen opening) ---")
        lines += [f"{d.session.session_id} {d.session.route_id} {d.session.model} {_hops(d)}" for d in state.sessions.values()]
    return "\n".join(lines)


async def watch(
    bus: Bus,
    out: TextIO,
    *,
    seconds: float | None = None,
    table_every: float = 5.0,
    heartbeats: bool = False,
    subject: str = subjects.ALL,
) -> WatchState:
    """Print the feed (and a table every `table_every` s) until `seconds` pass or cancelled."""
    state = WatchState()

    async def feed() -> None:
        async for subj, msg in sub.with_subjects():
            state.apply(msg, time.monotonic())
            if shown(msg, heartbeats):
                stamp = time.strftime("%H:%M:%S", time.localtime(msg.ts)) + f".{int(msg.ts * 1000) % 1000:03d}"
                print(f"{stamp} {subj:<40} {summarize(msg)}", file=out, flush=True)

    async def tables() -> None:
        while True:
            await asyncio.sleep(table_every)
            print(render(state, time.monotonic()), file=out, flush=True)

    async with bus.subscribe_any(subject) as sub:
        tasks = [asyncio.create_task(feed(), name="watch:feed"), asyncio.create_task(tables(), name="watch:tables")]
        try:
            if seconds is None:
                await asyncio.gather(*tasks)
            else:
                await asyncio.sleep(seconds)
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
    print(render(state, time.monotonic()), file=out, flush=True)
    return state


def build_parser() -> argparse.ArgumentParser:
    """Flags of `meshnet watch`."""
    p = argparse.ArgumentParser(prog="meshnet watch", description="Live feed of everything on mesh.>")
    add_bus_arguments(p)
    p.add_argument("--seconds", type=float, help="stop after N seconds and print a final table")
    p.add_argument("--once", action="store_true", help="collect for --table-every seconds, print one table, exit")
    p.add_argument("--table-every", type=float, default=5.0, help="seconds between tables")
    p.add_argument("--heartbeats", action="store_true", help="also print the periodic beats: node heartbeats, gateways' driver-alive, tracker status")
    p.add_argument("--subject", default=subjects.ALL, help="subject to watch (default mesh.>)")
    return p


def monitor_settings(args: argparse.Namespace, env: Mapping[str, str], up: RunInfo | None) -> BusSettings:
    """Who to watch as (pure): given credentials (flags, environment) win; without any, the
    monitor login of a running `meshnet up` (its run file) when it is that bus or no URL is
    given; else the dev monitor user of the repo's nats.conf."""
    url = getattr(args, "nats", None) or env.get(ENV_URL)
    login_given = bool(getattr(args, "nats_user", None) or env.get(ENV_USER))
    if up is not None and not login_given and url in (None, up.url):
        return BusSettings(url=up.url, role="monitor", user=up.monitor_user, password=up.monitor_password)
    return BusSettings.resolve("monitor", url=args.nats, user=args.nats_user, password=args.nats_password,
                               env=env)  # fmt: skip


async def run(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    """Connect as the monitor user and watch."""
    path = run_file_path()
    up = read_run_file(path)
    settings = monitor_settings(args, os.environ, up)
    if up is not None and settings.password == up.monitor_password:
        print(f"meshnet watch: {settings.url} as {settings.user} (from {path})", file=sys.stderr)
    try:
        bus = await Bus.connect(settings.url, role="monitor", user=settings.user, password=settings.password,
                                name="meshnet-watch")  # fmt: skip
    except BusConnectError as exc:
        print(f"meshnet watch: {exc}", file=sys.stderr)
        return 1
    seconds = args.table_every if args.once else args.seconds
    try:
        await watch(bus, out, seconds=seconds, table_every=args.table_every, heartbeats=args.heartbeats,
                    subject=args.subject)  # fmt: skip
    finally:
        await bus.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of `meshnet watch`."""
    args = build_parser().parse_args(argv)
    try:
        return asyncio.run(run(args))
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
