"""Trackers as one queue group: kill or freeze one while requests stream in, and no request fails.

Each request reaches one tracker of the group. Every tracker reads every announcement and every
route directive, so each counts the others' routes and can close or give back any of them. A
request the tracker asked does not answer is asked again of every tracker, and one route is
opened per request id (tracker/asks.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from bus import subjects
from bus.client import Bus
from bus.jetstream import KeyValueStore
from bus.server import NatsServer
from gateway.routing import ATTEMPT_S, FIRST_ASK_S, Router
from schemas.base import BusMessage
from schemas.credentials import hop_credential
from schemas.route import ROUTE_ANSWER_S, RouteDirective, RouteReply, RouteRequest
from schemas.tracker import TrackerStatus
from tests.fixtures.nats import BusFactory
from tests.fixtures.net import Partition
from tests.test_concurrent_serving import PROMPTS, stream_chat
from tests.test_gateway_e2e import Mesh, load_reference, running_mesh
from tests.test_gateway_queue import until
from tests.test_tracker_service import FakeNode
from tracker.asks import AskClaims
from tracker.route_handler import SETTLE_MAX_S
from tracker.service import Tracker, TrackerConfig

ROOT = Path(__file__).resolve().parent.parent
CONFIG = TrackerConfig(heartbeat_interval=0.1, expire_after=1.5, tick_interval=0.05, rebalance_interval=3600.0)
FREEZE_S = 5.0  # longer than `meshnet tracker`'s 3 s expiry: judged by its own clock, every node would be dead
ROUTE_BOUND_S = FIRST_ASK_S + ATTEMPT_S  # one ask that the frozen tracker holds, then one retry


def start_tracker(nats: NatsServer, tracker_id: str, log: Path, url: str | None = None) -> subprocess.Popen[bytes]:
    """`meshnet tracker` as a process of its own (so it can be killed or frozen), logging to
    `log`; connected to `url` (a Partition's relay) instead of the server's own, if given."""
    user, password = nats.credentials("tracker")
    with open(log, "ab") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(
            [sys.executable, "-m", "meshnet.cli", "tracker", "--tracker-id", tracker_id, "--nats", url or nats.url,
             "--nats-user", user, "--nats-password", password, "--log-level", "info"],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env={**os.environ})


@contextlib.asynccontextmanager
async def fake_nodes(bus_factory: BusFactory, layers: dict[str, tuple[int, int]],
                     **kw: int) -> AsyncIterator[list[FakeNode]]:
    """Fake nodes {node_id: (start, end)} on the bus for the block."""
    nodes: list[FakeNode] = []
    try:
        for node_id, (a, b) in layers.items():
            fake = FakeNode(await bus_factory("node", name=node_id), node_id, a, b, **kw)
            await fake.start()
            nodes.append(fake)
        yield nodes
    finally:
        for fake in nodes:
            await fake.stop()


async def tracker(bus_factory: BusFactory, tracker_id: str) -> Tracker:
    return Tracker(await bus_factory("tracker", name=tracker_id), dataclasses.replace(CONFIG, tracker_id=tracker_id))


async def until_live(node_ids: set[str], *trackers: Tracker) -> None:
    """Wait (bounded) until every tracker counts every node of `node_ids` as routable."""
    for _ in range(200):
        if all(node_ids <= set(t.book.live) for t in trackers):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"nodes {sorted(node_ids)} never routable at {[t.config.tracker_id for t in trackers]}")


@contextlib.asynccontextmanager
async def two_tracker_mesh(model_path: Path, tmp_path: Path, prefix: str, net: Partition | None = None,
                           ) -> AsyncIterator[tuple[Mesh, subprocess.Popen[bytes], dict[int, Any]]]:
    """A mesh (the in-process tracker `tracker`, a gateway, nodes `<prefix>-head` and
    `<prefix>-tail`), a second tracker process `tracker-b` (on the bus through `net`, if
    given: its target port is set to the mesh's server), and the greedy answers to PROMPTS 0-3."""
    ref = load_reference(model_path)
    want = {i: ref.greedy(PROMPTS[i % len(PROMPTS)], 16) for i in range(4)}
    async with running_mesh(model_path, tmp_path, {f"{prefix}-head": "0:15", f"{prefix}-tail": "15:30"},
                            node_timeout=3.0, keepalive=1.0, session_wait=600.0) as mesh:
        if net is not None:
            net.target_port = mesh.nats.port
        second = start_tracker(mesh.nats, "tracker-b", tmp_path / "tracker-b.log", net.url if net else None)
        try:
            yield mesh, second, want
        finally:
            if second.poll() is None:
                second.send_signal(signal.SIGCONT)  # a frozen one too
                second.kill()
                second.wait()


@contextlib.asynccontextmanager
async def in_background(*coros: Coroutine[Any, Any, None]) -> AsyncIterator[None]:
    """Run `coros` as tasks for the block; cancel and await them after it."""
    tasks = [asyncio.create_task(c) for c in coros]
    try:
        yield
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_route_asked_again_of_another_tracker_is_the_same_route(bus_factory: BusFactory) -> None:
    async with fake_nodes(bus_factory, {"h": (0, 15), "t": (15, 30)}), \
            await tracker(bus_factory, "one") as one, await tracker(bus_factory, "two") as two:
        await until_live({"h", "t"}, one, two)
        req = RouteRequest(model="smol", session_id="asked-twice", request_id="ask-1")
        first = await one.handle_route_request(req)
        assert first.session is not None
        for _ in range(200):  # the open directive reaches the other tracker
            if first.session.route_id in two.sessions:
                break
            await asyncio.sleep(0.02)
        assert two.book.live["h"] == one.book.live["h"]  # it counts the route's slot too
        again = await two.handle_route_request(req)  # the gateway asks again: the first tracker "died"
        assert again.session is not None and again.session.route_id == first.session.route_id
        assert again.credentials == first.credentials
        s = again.session
        assert again.credentials[0] == hop_credential(two.book.frame_keys["h"], s.session_id, s.route_id, s.epoch, 0,
                                                      s.expires_at)
        for other in (RouteRequest(model="smol", session_id="asked-twice", epoch=2, request_id="ask-1"),
                      RouteRequest(model="smol", session_id="asked-twice", request_id="someone-else")):
            refused = await two.handle_route_request(other)  # not a retry of that ask: no route, no credentials
            assert refused.error is not None and "already has a route" in refused.error.message
        # a close seen by both ends the route in both
        gateway = await bus_factory("gateway")
        await gateway.publish(subjects.route_directive(s.route_id),
                              RouteDirective(action="close", session=s, issued_by="gateway"))
        for _ in range(200):
            if s.route_id not in one.sessions and s.route_id not in two.sessions:
                break
            await asyncio.sleep(0.02)
        assert s.route_id not in one.sessions and s.route_id not in two.sessions
        reply = await gateway.request(subjects.ROUTE_CREATE, RouteRequest(model="smol"), RouteReply, timeout=5.0)
        assert reply.session is not None  # one of the group answers, once
        await asyncio.sleep(0.3)
        assert (reply.session.route_id in one.sessions) and (reply.session.route_id in two.sessions)


@pytest.mark.asyncio(loop_scope="module")
async def test_killing_one_of_two_trackers_during_a_stream_of_requests_fails_none(
        model_path: Path, tmp_path: Path) -> None:
    async with two_tracker_mesh(model_path, tmp_path, "tg") as (mesh, second, want):
        opened: list[tuple[str, bool]] = []  # (issuer, after the kill) of every open directive
        killed = asyncio.Event()

        async def directives() -> None:
            async with mesh.monitor.subscribe(subjects.DIRECTIVE_ALL, RouteDirective) as sub:
                async for d in sub:
                    if d.action == "open":
                        opened.append((d.issued_by, killed.is_set()))

        async with in_background(directives()):
            results: list[dict] = []
            served_by_b = asyncio.Event()  # set when tracker-b is killed, with requests in flight

            async def client(k: int, http: aiohttp.ClientSession) -> None:
                for j in range(10):
                    i = (k + j) % 4
                    out = await stream_chat(http, mesh.url, PROMPTS[i % len(PROMPTS)], 16)
                    results.append({"i": i, **out})
                    await asyncio.sleep(0.05)

            async def killer() -> None:
                for _ in range(1200):  # until tracker-b (after its warm-up) has answered its share
                    if sum(1 for who, _ in opened if who == "tracker-b") >= 2:
                        break
                    await asyncio.sleep(0.05)
                served_by_b.set()
                second.send_signal(signal.SIGKILL)
                second.wait()
                # a directive tracker-b published just before its death may still be on its way
                # to the monitor: what arrives from here on was published after the kill
                await asyncio.sleep(0.5)
                killed.set()

            async with aiohttp.ClientSession() as http:
                await asyncio.gather(client(0, http), client(1, http), client(2, http), killer())
            assert second.returncode == -signal.SIGKILL and served_by_b.is_set()
            assert len(results) == 30
            failed = [r for r in results if r["status"] != 200 or r["error"]]
            assert not failed, failed[:3]
            for r in results:  # each the single-process greedy answer
                assert r["text"] == want[r["i"]][2], r
            await asyncio.sleep(0.5)
            assert mesh.tracker.sessions == {}  # every route ended, whichever tracker opened it
            assert ("tracker-b", False) in opened  # both answered before the kill ...
            assert ("tracker", False) in opened and ("tracker", True) in opened  # ... and one after it
            assert ("tracker-b", True) not in opened


async def test_a_tracker_that_starts_late_counts_the_routes_opened_before_it(bus_factory: BusFactory) -> None:
    async with fake_nodes(bus_factory, {"h2": (0, 15), "t2": (15, 30)}, max_sessions=2), \
            await tracker(bus_factory, "early") as one:
        await until_live({"h2", "t2"}, one)
        opened = await one.handle_route_request(RouteRequest(model="smol", session_id="before-late"))
        assert opened.session is not None
        # the session bucket write is off the request path: wait until it has landed
        bucket, route_id = one.routes._bucket, opened.session.route_id
        assert bucket is not None

        async def stored() -> bool:
            return await bucket.get_json(route_id) is not None

        await until(stored, "the session bucket's write of the route")
        async with await tracker(bus_factory, "late") as late:  # never saw the open directive: it reads the bucket
            assert opened.session.route_id in late.sessions
            await until_live({"h2", "t2"}, late)
            assert late.book.live == one.book.live == {"h2": 1, "t2": 1}  # the slot is taken in both views


async def test_one_route_per_request_id_whichever_trackers_read_it(bus_factory: BusFactory) -> None:
    async with fake_nodes(bus_factory, {"h3": (0, 15), "t3": (15, 30)}), \
            await tracker(bus_factory, "one3") as one, await tracker(bus_factory, "two3") as two:
        await until_live({"h3", "t3"}, one, two)
        # no session id: each tracker would name its own session, so only the claim ties the copies
        req = RouteRequest(model="smol", request_id="copies")
        first, again = await asyncio.gather(one.handle_route_request(req), two.handle_route_request(req))
        assert first.session is not None and again.session is not None
        assert again.session.route_id == first.session.route_id and again.credentials == first.credentials
        late = await two.handle_route_request(req)  # a frozen tracker reads its copy when it wakes
        assert late.session is not None and late.session.route_id == first.session.route_id
        await asyncio.sleep(0.3)
        assert list(one.sessions) == list(two.sessions) == [first.session.route_id]  # counted once, by both


@dataclass
class CutOffClaims:
    """A tracker's claims bucket behind a cut link: a claim's create waits until `heal` is set
    and only then reaches the bucket (a partition holds the bytes; nothing is lost)."""

    kv: KeyValueStore
    heal: asyncio.Event = field(default_factory=asyncio.Event)

    async def replace_json(self, key: str, value: Any, revision: int) -> int:
        await self.heal.wait()
        return await self.kv.replace_json(key, value, revision)

    async def get_json(self, key: str) -> Any | None:
        await self.heal.wait()
        return await self.kv.get_json(key)


async def test_a_tracker_cut_off_mid_claim_opens_no_second_route(bus_factory: BusFactory) -> None:
    """Tracker `cut` reads an ask and is cut off from its server while it claims it; the asker's
    copy reaches `whole`, which claims it and opens its route. When the link heals, `cut`
    learns that its claim lost and gives that route back. Before, its claim gave up after 0.1 s
    and it opened a second route for the same ask (tests/test_tracker_group.py's partition)."""
    async with fake_nodes(bus_factory, {"h5": (0, 15), "t5": (15, 30)}), \
            await tracker(bus_factory, "cut") as cut, await tracker(bus_factory, "whole") as whole:
        await until_live({"h5", "t5"}, cut, whole)
        link = CutOffClaims(cut.routes.asks._kv)  # type: ignore[arg-type]
        cut.routes.asks = AskClaims(link, attempt_s=0.2)  # type: ignore[arg-type]
        req = RouteRequest(model="smol", request_id="cut-mid-claim")
        held = asyncio.create_task(cut.handle_route_request(req))
        await asyncio.sleep(0.5)  # past a few of cut's attempts
        first = await whole.handle_route_request(req)
        assert first is not None and first.session is not None
        link.heal.set()
        again = await held
        assert again is not None and again.session is not None and again.session.route_id == first.session.route_id
        await asyncio.sleep(0.3)
        assert list(cut.sessions) == list(whole.sessions) == [first.session.route_id]  # one route, counted by both


async def test_a_claim_never_answered_opens_nothing_and_answers_nothing(bus_factory: BusFactory) -> None:
    async with fake_nodes(bus_factory, {"h6": (0, 15), "t6": (15, 30)}), await tracker(bus_factory, "mute") as mute:
        await until_live({"h6", "t6"}, mute)
        mute.routes.asks = AskClaims(CutOffClaims(mute.routes.asks._kv), settle_s=0.6, attempt_s=0.2)  # type: ignore[arg-type]
        assert await mute.handle_route_request(RouteRequest(model="smol", request_id="never-answered")) is None
        assert mute.sessions == {}  # no slot counted: the asker asks every tracker again
        took = await mute.handle_route_request(RouteRequest(model="smol"))  # an ask with no request id is not claimed
        assert took is not None and took.session is not None


@dataclass
class CountingBus:
    """The router's bus, counting its asks (the subject of each)."""

    bus: Bus
    asks: list[str] = field(default_factory=list)

    async def request(self, subject: str, msg: BusMessage, reply_model: type[RouteReply],
                      timeout: float = 2.0) -> RouteReply:
        self.asks.append(subject)
        return await self.bus.request(subject, msg, reply_model, timeout)

    async def publish(self, subject: str, msg: BusMessage) -> None:
        await self.bus.publish(subject, msg)


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("fault", ["freeze", "partition"])
async def test_freezing_or_partitioning_one_of_two_trackers_during_a_stream_of_requests_fails_none(
        model_path: Path, tmp_path: Path, fault: str) -> None:
    """`freeze`: SIGSTOP of tracker-b, SIGCONT after FREEZE_S. `partition`: tracker-b keeps
    running but its bus connection goes silent both ways for FREEZE_S (Partition: nothing is
    closed, so neither it nor the server sees a disconnect), then carries on. Judged by its own
    running clock, every node was silent past its expiry; it must not expire one."""
    async with Partition(0) as net, two_tracker_mesh(model_path, tmp_path, "fz",
                                                     net if fault == "partition" else None) as (mesh, second, want):
        phase = ["before"]  # before, frozen, after (the SIGCONT)
        seen: list[tuple[str, RouteDirective]] = []  # (phase, directive) of every directive
        status_b: list[TrackerStatus] = []

        async def watch() -> None:
            async with mesh.monitor.subscribe(subjects.DIRECTIVE_ALL, RouteDirective) as sub:
                async for d in sub:
                    seen.append((phase[0], d))

        async def watch_status() -> None:
            async with mesh.monitor.subscribe(subjects.TRACKER_STATUS, TrackerStatus) as sub:
                async for st in sub:
                    if st.tracker_id == "tracker-b" and phase[0] == "after":
                        status_b.append(st)

        prober_bus = CountingBus(await Bus.connect(mesh.nats.url, role="gateway", name="prober"))
        router = Router(prober_bus, timeout=10.0)
        probes: list[tuple[str, float, int]] = []  # (phase, seconds, asks) of each route made
        results: list[dict] = []
        done = asyncio.Event()
        async with in_background(watch(), watch_status()), prober_bus.bus:
            async def prober() -> None:  # the gateway's own route requests, measured one by one
                k = 0
                while not done.is_set():
                    p, t0, before = phase[0], time.monotonic(), len(prober_bus.asks)
                    s = await router.create(RouteRequest(model="smollm2-135m-instruct", session_id=f"probe-{k}"))
                    probes.append((p, time.monotonic() - t0, len(prober_bus.asks) - before))
                    await router.release(s, "close")
                    k += 1
                    await asyncio.sleep(0.1)

            async def client(k: int, http: aiohttp.ClientSession) -> None:
                while not done.is_set():
                    i, p = k % 4, phase[0]
                    out = await stream_chat(http, mesh.url, PROMPTS[i], 16)
                    results.append({"i": i, "phase": p, **out})
                    k += 1
                    await asyncio.sleep(0.05)

            async def freezer() -> None:
                for _ in range(1200):  # until tracker-b (after its warm-up) has answered its share
                    if sum(1 for _, d in seen if d.issued_by == "tracker-b" and d.action == "open") >= 2:
                        break
                    await asyncio.sleep(0.05)
                net.cut() if fault == "partition" else second.send_signal(signal.SIGSTOP)
                phase[0] = "frozen"
                await asyncio.sleep(FREEZE_S)
                net.heal() if fault == "partition" else second.send_signal(signal.SIGCONT)
                phase[0] = "after"
                for _ in range(1200):  # the woken tracker answers again, past its re-warm
                    if any(p == "after" and d.issued_by == "tracker-b" and d.action == "open" for p, d in seen) \
                            and sum(1 for p, *_ in probes if p == "after") >= 30:
                        break
                    await asyncio.sleep(0.05)
                done.set()

            async with aiohttp.ClientSession() as http:
                await asyncio.gather(client(0, http), client(1, http), client(2, http), prober(), freezer())
            failed = [r for r in results if r["status"] != 200 or r["error"]]
            assert not failed, failed[:3]
            for r in results:  # each the single-process greedy answer
                assert r["text"] == want[r["i"]][2], r
            assert any(r["phase"] == "frozen" for r in results)
            frozen = [(t, asks) for p, t, asks in probes if p == "frozen"]
            assert any(asks == 2 for _, asks in frozen), frozen  # some first asks reached the frozen one ...
            assert all(asks <= 2 and t <= ROUTE_BOUND_S for t, asks in frozen), frozen  # ... and cost one retry
            # the woken tracker corrupts nothing: it expires no node, orders nothing, and opens no
            # route for an ask it read while frozen (every request id has one route, in all)
            assert not [d for p, d in seen if d.issued_by == "tracker-b" and d.action != "open"]
            opened = [d.session for _, d in seen if d.action == "open"]
            by_ask = {s.request_id for s in opened}
            assert len(by_ask) == len(opened) and "" not in by_ask
            for _ in range(200):  # every route ended in both trackers' books
                if not mesh.tracker.sessions and status_b and status_b[-1].n_sessions == 0:
                    break
                await asyncio.sleep(0.05)
            assert mesh.tracker.sessions == {}
            assert status_b and status_b[-1].n_sessions == 0 and status_b[-1].n_nodes == 2, status_b[-1:]


def test_a_live_trackers_own_waits_fit_in_the_first_asks_wait() -> None:
    assert SETTLE_MAX_S < ROUTE_ANSWER_S < FIRST_ASK_S  # a healthy tracker is not retried
    assert ROUTE_BOUND_S == FIRST_ASK_S + ATTEMPT_S == 2.5
