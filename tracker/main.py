"""`meshnet tracker`: run the Tracker on NATS until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from bus import subjects
from bus.client import Bus, connect_as, until_stopped
from bus.config import ENV_URL, ENV_USER, BusSettings, add_bus_arguments
from bus.errors import BusConnectError, BusError
from bus.runinfo import RunInfo, read_run_file, run_file_path
from schemas.validation import QuarantineNotice, UnquarantineRequest
from tracker.quarantine_service import LIFT_SEQ_WAIT_S
from tracker.service import Tracker, TrackerConfig

log = logging.getLogger("meshnet.tracker")


def build_parser() -> argparse.ArgumentParser:
    """Flags of `meshnet tracker`."""
    p = argparse.ArgumentParser(prog="meshnet tracker", description="Run the Meshnet tracker.")
    add_bus_arguments(p)
    d = TrackerConfig()
    p.add_argument("--tracker-id", default=d.tracker_id, help="name on the bus (directives' issued_by)")
    p.add_argument("--heartbeat-interval", type=float, default=d.heartbeat_interval,
                   help="seconds between node heartbeats (informational)")  # fmt: skip
    p.add_argument("--expire-after", type=float, default=d.expire_after,
                   help="seconds without a heartbeat before a node expires")  # fmt: skip
    p.add_argument("--target-replicas", type=int, default=d.target_replicas,
                   help="healthy replicas per layer below which a range is under-provisioned")  # fmt: skip
    p.add_argument("--rebalance-interval", type=float, default=d.rebalance_interval)
    p.add_argument("--status-interval", type=float, default=d.status_interval)
    p.add_argument("--warmup", type=float, default=2.0,
                   help="seconds between asking nodes to announce and answering route requests (a tracker "
                        "joining a running group must know the nodes first; the others answer meanwhile)")
    p.add_argument("--no-ledger", action="store_true",
                   help="do not run the Work Ledger (the audit stream's durable consumer; `meshnet ledger` reads it)")
    p.add_argument("--spread", choices=("on", "off"), default="on",
                   help="move running sessions between a layer range's replicas when one holds 2 or more "
                        "than another, e.g. after a lost node is back (default on; docs/control-plane.md)")
    p.add_argument("--seconds", type=float, default=None, help="stop after N seconds (scripts)")
    p.add_argument("--log-level", default="info")
    return p


async def run(args: argparse.Namespace) -> int:
    """Connect, run the tracker, stop on a signal (or after --seconds)."""
    settings = BusSettings.from_args("tracker", args)
    config = TrackerConfig(
        tracker_id=args.tracker_id,
        heartbeat_interval=args.heartbeat_interval,
        expire_after=args.expire_after,
        target_replicas=args.target_replicas,
        rebalance_interval=args.rebalance_interval,
        status_interval=args.status_interval,
        ledger=not args.no_ledger,
        warmup_s=max(0.0, args.warmup),
        spread=args.spread == "on",
    )
    try:
        bus = await connect_as(
            settings.url, "tracker", user=settings.user, password=settings.password, name=args.tracker_id
        )
    except BusConnectError as exc:
        log.error("%s", exc)
        return 1
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        async with Tracker(bus, config) as tracker:
            log.info(
                "tracker %s on %s: heartbeat %.1fs, expire after %.1fs, target %d replica(s)",
                config.tracker_id, settings.url, config.heartbeat_interval, config.expire_after,
                config.target_replicas,
            )  # fmt: skip
            lost = False
            try:
                async with asyncio.timeout(args.seconds):
                    lost = await until_stopped(stop, bus)
            except TimeoutError:
                pass
            log.info("tracker stopping: %d node(s), %d active session(s)", len(tracker.registry), len(tracker.sessions))
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        await bus.close()
    return 1 if lost else 0


# every tracker answers a lift, each after its own look at the audit stream (at most
# LIFT_SEQ_WAIT_S): the command gathers the replies that come this long after the first one
LIFT_WINDOW_S = LIFT_SEQ_WAIT_S + 0.5
LIFT_FIRST_REPLY_S = 5.0  # how long it waits for the first tracker
MAX_LIFT_REPLIES = 64


def build_unquarantine_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="meshnet tracker unquarantine",
        description="Put a quarantined node back into new routes, and drop the evidence against it, on every "
                    "tracker that answers (one line each). Uses the operator login (it may do only this): the "
                    "flags, the environment, else a running `meshnet up`'s run file, else the dev one of "
                    "nats.conf. Exits 1 when no tracker answered, or when none had the node in quarantine "
                    "(a mistyped node id, say).")
    p.add_argument("node_id", help="the node to lift")
    p.add_argument("--timeout", type=float, default=LIFT_FIRST_REPLY_S,
                   help="seconds to wait for the first tracker's answer")
    add_bus_arguments(p)
    return p


def lift_lines(lifts: list[QuarantineNotice]) -> list[str]:
    """One line per tracker that answered a lift, by tracker id (pure)."""
    lines = []
    for n in sorted(lifts, key=lambda n: n.issued_by):
        if n.was_quarantined is None:  # a tracker that does not say
            lines.append(f"tracker {n.issued_by}: {n.node_id}: {n.reason}")
        elif n.was_quarantined:
            lines.append(f"tracker {n.issued_by}: {n.node_id} was in quarantine: {n.reason}")
        else:
            lines.append(f"tracker {n.issued_by}: {n.node_id} was not in quarantine (its evidence is dropped)")
    return lines


def nothing_lifted(node_id: str, lifts: list[QuarantineNotice]) -> str | None:
    """The error when no tracker that answered had `node_id` in quarantine (pure): a mistyped
    node id exited 0 before. A tracker that does not say (was_quarantined None) counts as a lift."""
    if not lifts or any(n.was_quarantined is not False for n in lifts):
        return None
    return (f"{node_id!r} is not in quarantine at any tracker ({len(lifts)} answered): nothing to lift "
            "(any evidence against it is dropped)")


def operator_settings(args: argparse.Namespace, up: RunInfo | None) -> BusSettings:
    """The operator login a command uses (pure but for the environment): given credentials
    win; without any, a running `meshnet up`'s operator login when its bus is the one meant
    (no --nats or MESHNET_NATS_URL, or that one), else the dev one."""
    settings = BusSettings.from_args("operator", args)
    login_given = bool(args.nats_user or os.environ.get(ENV_USER))
    url = args.nats or os.environ.get(ENV_URL)  # the flag, else the environment: another bus than up's
    if up is not None and up.operator_user and not login_given and url in (None, up.url):
        return BusSettings(url=up.url, role="operator", user=up.operator_user, password=up.operator_password)
    return settings


async def unquarantine(args: argparse.Namespace) -> int:
    settings = operator_settings(args, read_run_file(run_file_path()))
    try:
        bus = await Bus.connect(settings.url, role="operator", user=settings.user, password=settings.password,
                                name="meshnet-operator")
    except BusConnectError as exc:
        print(f"meshnet tracker unquarantine: {exc}", file=sys.stderr)
        return 1
    try:
        lifts = await bus.request_many(subjects.UNQUARANTINE, UnquarantineRequest(node_id=args.node_id),
                                       QuarantineNotice, timeout=args.timeout, window=LIFT_WINDOW_S,
                                       max_replies=MAX_LIFT_REPLIES)
    except BusError as exc:
        print(f"meshnet tracker unquarantine: no tracker answered ({exc})", file=sys.stderr)
        return 1
    finally:
        await bus.close()
    if (error := nothing_lifted(args.node_id, lifts)) is not None:
        print(f"meshnet tracker unquarantine: {error}", file=sys.stderr)
        return 1
    for line in lift_lines(lifts):
        print(line)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of `meshnet tracker` (and `meshnet tracker unquarantine NODE`)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["unquarantine"]:
        return asyncio.run(unquarantine(build_unquarantine_parser().parse_args(argv[1:])))
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )  # fmt: skip
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
