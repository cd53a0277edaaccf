"""NATS restart while serving, against a real mesh: nats-server, tracker, gateway and two node
processes on the bundled model.

Activations never touch NATS (they go over HTTP between hops), so a stream that is decoding
when nats-server stops goes on while it is down. The server comes back on the same port with
the same JetStream store; every client reconnects on its own. The outage here lasts longer
than the tracker's heartbeat expiry, so the tracker must not judge nodes by heartbeats its own
lost connection could not deliver. Afterwards heartbeats, announcements and the gateway's
telemetry resume, a new request routes, and every audit event published meanwhile (two
sessions end while the server is down) is in the MESH_AUDIT stream exactly once.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from bus.client import Subscription
from schemas.base import BusMessage
from schemas.node import NodeAnnouncement
from schemas.telemetry import GenerationTelemetry
from tests.test_concurrent_serving import PROMPTS, node_sessions, stream_chat
from tests.test_gateway_e2e import Mesh, Reference, load_reference, running_mesh, wait_routable
from tests.test_restart import STORY

pytestmark = pytest.mark.asyncio(loop_scope="module")

NODES = {"nr-head": "0:15", "nr-tail": "15:30"}
LONG_TOKENS = 1900  # decoding for well over the 4.5 s outage even at 170 tok/s, which a fast hour gives (STORY runs this long without EOG)
SHORT_TOKENS = 48  # these end while the server is down
SHORT = PROMPTS[:2]
AFTER = PROMPTS[2]
AFTER_TOKENS = 24
WAIT_S = 120.0  # bound of every wait below (shared 2-core machine)

AuditKey = tuple[str, str, str, str | None]  # kind, source, session_id, node_id


@pytest.fixture(scope="module")
def reference(model_path: Path) -> Reference:
    ref = load_reference(model_path)
    ref.greedy(STORY, LONG_TOKENS)
    for p in SHORT:
        ref.greedy(p, SHORT_TOKENS)
    ref.greedy(AFTER, AFTER_TOKENS)
    return ref


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def mesh(model_path: Path, tmp_path_factory: pytest.TempPathFactory,
               reference: Reference) -> AsyncIterator[Mesh]:
    async with running_mesh(model_path, tmp_path_factory.mktemp("nats-restart-mesh"), dict(NODES),
                            node_timeout=3.0, keepalive=1.0, session_wait=600.0) as m:
        yield m


async def record(feed: Subscription[BusMessage], seen: list[tuple[float, str, BusMessage]]) -> None:
    """Every message the monitor reads: (arrival, subject, message)."""
    async for subject, msg in feed.with_subjects():
        seen.append((time.monotonic(), subject, msg))


async def until(what: str, check: Any, timeout: float = WAIT_S) -> float:
    """Poll `check()` until true; seconds it took. Fails naming `what` after `timeout`."""
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < timeout, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)
    return time.monotonic() - started


def expected_audit(sid: str, route: list[str]) -> set[AuditKey]:
    """The audit events one ended session leaves: the tracker's and each hop's participation,
    each hop's work, and the gateway's validation record."""
    keys: set[AuditKey] = {("validation", "gateway", sid, None)}
    for node in route:
        keys |= {("route_participation", "tracker", sid, node), ("route_participation", node, sid, node),
                 ("node_work", node, sid, node)}
    return keys


async def stored_audit(mesh: Mesh) -> Counter[AuditKey]:
    """How often each (kind, source, session, node) is in MESH_AUDIT (read as the tracker)."""
    stored = await mesh.tracker.bus.audit_messages()
    return Counter((m["kind"], m["source"], m["session_id"], m.get("node_id")) for m in stored)


async def session_state(http: aiohttp.ClientSession, url: str, sid: str) -> dict[str, Any]:
    async with http.get(f"{url}/v1/sessions/{sid}") as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def test_streams_go_on_through_a_nats_restart_and_no_audit_event_is_lost(
        mesh: Mesh, reference: Reference, caplog: pytest.LogCaptureFixture) -> None:
    _, long_ids, long_text = reference.greedy(STORY, LONG_TOKENS)
    assert len(long_ids) == LONG_TOKENS  # no EOG: the stream outlasts the outage
    short_text = [reference.greedy(p, SHORT_TOKENS)[2] for p in SHORT]
    short_sids = [f"nr-short-{k}" for k in range(len(SHORT))]
    seen: list[tuple[float, str, BusMessage]] = []
    long_arrivals: list[float] = []
    short_arrivals: list[list[float]] = [[] for _ in SHORT]
    async with mesh.monitor.subscribe_any("mesh.>") as feed, aiohttp.ClientSession() as http:
        follower = asyncio.create_task(record(feed, seen))
        try:
            long = asyncio.ensure_future(stream_chat(http, mesh.url, STORY, LONG_TOKENS, long_arrivals, sid="nr-long"))
            shorts = [asyncio.ensure_future(stream_chat(http, mesh.url, p, SHORT_TOKENS, short_arrivals[k], sid=sid))
                      for k, (p, sid) in enumerate(zip(SHORT, short_sids, strict=True))]
            await until("every stream decoding", lambda: min(map(len, [long_arrivals, *short_arrivals])) >= 4)
            assert not any(s.done() for s in [long, *shorts])

            # -- the outage: longer than the tracker's expiry, and until the short sessions ended
            stopped_at = time.monotonic()
            await mesh.nats.stop()
            down_for = mesh.tracker.config.expire_after + 1.5
            await until("the short streams to end while nats-server is down",
                        lambda: all(s.done() for s in shorts) and time.monotonic() - stopped_at >= down_for)
            assert not long.done(), long.result()
            tokens_while_down = sum(t > stopped_at for t in long_arrivals)
            assert tokens_while_down > 0  # activations do not need NATS
            resumed_at, resumed_wall = time.monotonic(), time.time()
            await mesh.nats.resume()
            outage_s = resumed_at - stopped_at

            # -- the control plane comes back
            def fresh_heartbeats() -> bool:
                states = {s.node_id: s for s in mesh.tracker.registry}
                return set(states) == set(NODES) and all(
                    s.heartbeat is not None and s.heartbeat.ts > resumed_wall for s in states.values())

            heartbeat_s = await until("the tracker to hear every node's heartbeat again", fresh_heartbeats)

            def telemetry_after() -> list[float]:
                return [at - resumed_at for at, _, m in seen
                        if isinstance(m, GenerationTelemetry) and m.session_id == "nr-long" and m.ts > resumed_wall]

            await until("the gateway's telemetry of nr-long on the bus again", lambda: bool(telemetry_after()))
            telemetry_s = telemetry_after()[0]
            assert not long.done()  # the stream was still decoding when the control plane was back
            # the tracker forgot no node: each is still the one announced before the outage
            assert all(s.announced_at < stopped_at for s in mesh.tracker.registry), list(mesh.tracker.registry)

            async with asyncio.timeout(600):
                long_out = await long
            short_out = [s.result() for s in shorts]
            for out, want in zip(short_out, short_text, strict=True):
                assert out["error"] is None and out["text"] == want, out
            assert long_out["error"] is None, long_out
            assert long_out["text"] == long_text  # the uninterrupted greedy answer
            long_state = await session_state(http, mesh.url, "nr-long")
            assert (long_state["phase"], long_state["restarts"]) == ("completed", 0), long_state  # same route throughout

            def announced_again() -> dict[str, float]:
                first: dict[str, float] = {}
                for at, _, m in seen:
                    if isinstance(m, NodeAnnouncement) and at > resumed_at:
                        first.setdefault(m.node_id, at - resumed_at)
                return first

            await until("every node to announce again", lambda: set(announced_again()) == set(NODES))
            announce_s = max(announced_again().values())
            async with asyncio.timeout(WAIT_S):
                await wait_routable(mesh, set(NODES), http)
            after = await stream_chat(http, mesh.url, AFTER, AFTER_TOKENS, sid="nr-after")
            assert after["error"] is None and after["text"] == reference.greedy(AFTER, AFTER_TOKENS)[2], after

            # -- audit: every session's events, each stored once (retries are de-duplicated)
            sids = ["nr-long", *short_sids, "nr-after"]
            routes = {sid: (await session_state(http, mesh.url, sid))["route_nodes"] for sid in sids}
            want: set[AuditKey] = set().union(*(expected_audit(sid, routes[sid]) for sid in sids))
            stored: Counter[AuditKey] = Counter()

            async def refresh() -> bool:
                stored.clear()
                stored.update(await stored_audit(mesh))
                return want <= set(stored)

            started = time.monotonic()
            while not await refresh():
                assert time.monotonic() - started < WAIT_S, f"audit events missing: {sorted(want - set(stored))}"
                await asyncio.sleep(0.2)
            assert all(stored[k] == 1 for k in want), {k: stored[k] for k in want if stored[k] != 1}
            async with http.get(f"{mesh.url}/metrics") as resp:
                metrics = await resp.text()
            audit_lines = [line for line in metrics.splitlines() if line.startswith("meshnet_gateway_audit_events_total")]
            assert audit_lines and not any("failed" in line or "dropped" in line for line in audit_lines), audit_lines

            # -- nothing leaked: the tracker saw every session end (a close published while it was
            # reconnecting is lost to it: then the hops' heartbeats, which no longer list the
            # session, end it after TrackerConfig.session_grace), the hops freed every session
            await until("the tracker to see every session end",
                        lambda: not {a.session.session_id for a in mesh.tracker.sessions.values()} & set(sids))
            missed = [r.created - resumed_wall for r in caplog.records if "no close reached the tracker" in r.getMessage()]

            async def hops_idle() -> bool:
                return all(not body["live_sessions"] and body["cache_bytes"] == 0
                           for body in (await node_sessions(http, mesh)).values())

            started = time.monotonic()
            while not await hops_idle():
                assert time.monotonic() - started < WAIT_S, await node_sessions(http, mesh)
                await asyncio.sleep(0.2)
        finally:
            follower.cancel()
            await asyncio.gather(follower, return_exceptions=True)
    print(f"nats-server down {outage_s:.2f} s; nr-long got {tokens_while_down} tokens meanwhile; after the "
          f"restart the tracker heard every node's heartbeat in {heartbeat_s * 1e3:.0f} ms, the gateway's "
          f"telemetry was back in {telemetry_s * 1e3:.0f} ms and every node had announced again "
          f"{announce_s:.1f} s after it; the tracker missed {len(missed)} close(s)"
          + (f" and ended those sessions from heartbeats {max(missed):.1f} s after the restart" if missed else ""))
