"""The Tracker over a real nats-server, with fake nodes (bus clients that announce and heartbeat)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from bus import subjects
from bus.client import Bus
from bus.server import NatsServer
from schemas.capability import CapabilityReport, ShardRange
from schemas.node import NodeAnnouncement, NodeHeartbeat, NodeKey
from schemas.rebalance import RebalanceDirective
from schemas.route import (
    KeepHop,
    RouteDirective,
    RouteError,
    RoutePolicy,
    RouteReply,
    RouteRequest,
    RouteSession,
    RouteWithdrawal,
)
from schemas.tracker import TrackerHello, TrackerStatus
from tests.fixtures.nats import BusFactory
from tracker.service import Tracker, TrackerConfig
from tracker.spread import SpreadConfig

WAIT = 30.0  # guards against hanging only; no test asserts on elapsed time
N_LAYER = 30


def capability(start: int, end: int, *, tps: float = 100.0, max_sessions: int = 4) -> CapabilityReport:
    return CapabilityReport(
        model_arch="llama", model_name="smol", model_revision="rev1", runtime="llama.cpp",
        layers=ShardRange(start=start, end=end, n_layer=N_LAYER), hidden_size=576,
        vocab_size=49152, n_ctx=4096, cache_abi="llama.cpp/f16", cache_bytes_per_token=1024,
        decode_tokens_per_second=tps, max_sessions=max_sessions,
    )  # fmt: skip


class FakeNode:
    """A bus client that behaves like a node on the control plane (no model)."""

    def __init__(self, bus: Bus, node_id: str, start: int, end: int, *, announce_first: bool = True,
                 max_sessions: int = 4, beat_free_slots: int = 4, spare: bool = False, process_id: str = ""):
        self.bus = bus
        self.process_id = process_id
        self.spare = spare  # willing to act on rebalance orders
        self.node_id = node_id
        self.cap = capability(start, end, max_sessions=max_sessions)
        self.beat_free_slots = beat_free_slots  # what its heartbeats claim (the tracker counts itself)
        self.beat_load = 0.0
        self.held: list[str] | None = None  # the session ids its heartbeats list (None: not listed)
        self.clock_skew = 0.0  # its wall clock against this machine's (another machine's clock)
        self.announce_first = announce_first
        self.leaving = False  # shutting down: its announcements say so
        self.rebalance: list[RebalanceDirective] = []
        self.announcements = 0
        self._tasks: list[asyncio.Task[None]] = []

    async def announce(self) -> None:
        self.announcements += 1
        await self.bus.publish(subjects.node_key(self.node_id), NodeKey(node_id=self.node_id, key="ab" * 32))
        msg = NodeAnnouncement(
            node_id=self.node_id, activation_url=f"http://127.0.0.1:1/{self.node_id}",
            capability=self.cap, started_at=1.0, spare=self.spare, process_id=self.process_id,
            leaving=self.leaving,
        )  # fmt: skip
        await self.bus.publish(subjects.node_announce(self.node_id), msg)

    async def _beat(self) -> None:
        while True:
            hb = NodeHeartbeat(node_id=self.node_id, decode_tokens_per_second=100.0,
                               free_session_slots=self.beat_free_slots, load=self.beat_load,
                               session_ids=self.held, ts=time.time() + self.clock_skew)
            await self.bus.publish(subjects.node_heartbeat(self.node_id), hb)
            await asyncio.sleep(0.1)

    async def _follow(
        self, subject: str, model: type, handle: Callable[..., Awaitable[None]], ready: asyncio.Event
    ) -> None:
        async with self.bus.subscribe(subject, model) as sub:
            ready.set()
            async for msg in sub:
                await handle(msg)

    async def _on_hello(self, hello: TrackerHello) -> None:
        if not hello.node_ids or self.node_id in hello.node_ids:
            await self.announce()

    async def _on_rebalance(self, order: RebalanceDirective) -> None:
        self.rebalance.append(order)

    async def start(self) -> None:
        for subject, model, handle in (
            (subjects.TRACKER_HELLO, TrackerHello, self._on_hello),
            (subjects.rebalance(self.node_id), RebalanceDirective, self._on_rebalance),
        ):
            ready = asyncio.Event()
            self._tasks.append(asyncio.create_task(self._follow(subject, model, handle, ready)))
            await ready.wait()
        await self.bus.flush()
        if self.announce_first:
            await self.announce()
        self._tasks.append(asyncio.create_task(self._beat()))

    def start_heartbeats(self) -> None:
        self._tasks.append(asyncio.create_task(self._beat()))

    async def stop_heartbeats(self) -> None:
        beat = self._tasks.pop()
        beat.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await beat

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task


CONFIG = TrackerConfig(
    heartbeat_interval=0.1, expire_after=1.5, tick_interval=0.05, status_interval=0.1,
    rebalance_interval=3600.0,
)  # fmt: skip


async def until(pred: Callable[[], bool]) -> None:
    """Poll tracker state (in-process) until pred holds."""
    async with asyncio.timeout(WAIT):
        for _ in itertools.count():
            if pred():
                return
            await asyncio.sleep(0.02)


@pytest.fixture
async def nodes(bus_factory: BusFactory) -> AsyncIterator[Callable[..., Awaitable[FakeNode]]]:
    made: list[FakeNode] = []

    async def make(node_id: str, start: int, end: int, **kw: bool | int | str) -> FakeNode:
        fake = FakeNode(await bus_factory("node", name=node_id), node_id, start, end, **kw)
        await fake.start()
        made.append(fake)
        return fake

    yield make
    for fake in made:
        await fake.stop()


async def test_route_lifecycle_expiry_gap_and_abort(bus_factory: BusFactory, nodes) -> None:  # type: ignore[no-untyped-def]
    tbus = await bus_factory("tracker")
    gateway = await bus_factory("gateway")
    async with Tracker(tbus, CONFIG) as tracker:
        head = await nodes("head", 0, 15)
        tail = await nodes("tail", 15, 30)
        await until(lambda: {"head", "tail"} <= set(tracker.book.live))

        async with (
            gateway.subscribe(subjects.DIRECTIVE_ALL, RouteDirective) as directives,
            gateway.subscribe(subjects.TRACKER_STATUS, TrackerStatus) as status,
        ):
            await gateway.flush()
            reply = await gateway.request(subjects.ROUTE_CREATE, RouteRequest(model="smol"), RouteReply, timeout=WAIT)
            assert reply.error is None and reply.session is not None
            session = reply.session
            assert [(h.node_id, h.layer_start, h.layer_end) for h in session.hops] == [
                ("head", 0, 15), ("tail", 15, 30),
            ]  # fmt: skip
            assert session.session_id and session.route_id
            # the open directive went out before the reply (same connection => already buffered)
            assert directives.pending >= 1
            opened = await directives.next(WAIT)
            assert directives.last_subject == f"mesh.route.{session.route_id}.directive"
            assert opened.action == "open" and opened.session.model_dump() == session.model_dump()
            # the hops' credentials came in the reply only; the directive (monitors read it)
            # carries each hop's next credential sealed with that hop's key
            assert len(session.credentials) == 2
            assert not any(c in opened.model_dump_json() for c in session.credentials)
            assert opened.session.hops[0].sealed_next and not opened.session.hops[1].sealed_next

            # a gateway close ends a second session in the tracker
            second = await gateway.request(
                subjects.ROUTE_CREATE, RouteRequest(model="smol", session_id="gw-session-2"), RouteReply, timeout=WAIT
            )
            assert second.session is not None and second.session.session_id == "gw-session-2"
            assert (await directives.next(WAIT)).action == "open"
            close = RouteDirective(action="close", session=second.session, issued_by="gateway")
            await gateway.publish(subjects.route_directive(second.session.route_id), close)
            await until(lambda: second.session.route_id not in tracker.sessions)
            assert (await directives.next(WAIT)).action == "close"
            assert set(tracker.sessions) == {session.route_id}

            # audit: one route participation per hop, per session, stored in JetStream
            await tracker.audit.drained()
            assert await tbus.audit_count("mesh.audit.route_participation.tracker") == 4

            # the tail stops heartbeating: it expires, its session is aborted, the gap is reported
            await tail.stop_heartbeats()
            aborted = await directives.next(WAIT)
            assert aborted.action == "abort"
            assert aborted.session.route_id == session.route_id
            assert aborted.reason is not None and "tail" in aborted.reason
            assert "tail" not in tracker.registry
            assert tracker.sessions == {}

            [cov] = tracker.coverage()
            assert cov.status == "gap" and cov.gaps == ((15, 30),) and not cov.routable

            def gap_reported(st: TrackerStatus) -> bool:
                return st.n_nodes == 1 and st.coverage[0].gaps == [(15, 30)]

            async with asyncio.timeout(WAIT):
                async for st in status:
                    if gap_reported(st):
                        break

            refused = await gateway.request(subjects.ROUTE_CREATE, RouteRequest(model="smol"), RouteReply, timeout=WAIT)
            assert refused.session is None and refused.error is not None
            assert refused.error.code == "no_coverage"
            assert refused.error.missing_ranges == [(15, 30)]
            unknown = await gateway.request(subjects.ROUTE_CREATE, RouteRequest(model="nope"), RouteReply, timeout=WAIT)
            assert unknown.error is not None and unknown.error.code == "unknown_model"
        assert head.node_id in tracker.registry


async def test_another_trackers_open_read_after_its_close_counts_no_route(  # type: ignore[no-untyped-def]
        bus_factory: BusFactory, nodes) -> None:
    """A partitioned tracker opens a route; another tracker gives it to the asker's second ask
    (the claim is the first one's) and the asker closes it, all before the first tracker's open
    directive gets through. That late open must not count a route nobody will close again."""
    tbus = await bus_factory("tracker")
    gateway = await bus_factory("gateway")
    async with Tracker(tbus, CONFIG) as tracker:
        await nodes("head", 0, 15)
        await nodes("tail", 15, 30)
        await until(lambda: {"head", "tail"} <= set(tracker.book.live))
        reply = await gateway.request(subjects.ROUTE_CREATE, RouteRequest(model="smol", session_id="s1"),
                                      RouteReply, timeout=WAIT)
        assert reply.session is not None
        late, witness = (reply.session.model_copy(update={"route_id": r, "session_id": r}) for r in ("late", "witness"))
        await gateway.publish(subjects.route_directive("late"),
                              RouteDirective(action="close", session=late, issued_by="gateway"))
        for s in (late, witness):
            await gateway.publish(subjects.route_directive(s.route_id),
                                  RouteDirective(action="open", session=s, issued_by="tracker-b"))
        await until(lambda: "witness" in tracker.sessions)
        assert "late" not in tracker.sessions


async def test_a_slot_freed_by_a_close_serves_the_very_next_request(bus_factory: BusFactory, nodes) -> None:  # type: ignore[no-untyped-def]
    tbus = await bus_factory("tracker")
    gateway = await bus_factory("gateway")
    async with Tracker(tbus, CONFIG) as tracker:
        # one slot per node; the heartbeats lag behind and claim none is free
        await nodes("head", 0, 15, max_sessions=1, beat_free_slots=0)
        await nodes("tail", 15, 30, max_sessions=1, beat_free_slots=0)
        await until(lambda: {"head", "tail"} <= set(tracker.book.live) and all(
            s.heartbeat is not None for s in tracker.registry))

        async def ask(session_id: str) -> RouteReply:
            req = RouteRequest(model="smol", session_id=session_id)
            return await gateway.request(subjects.ROUTE_CREATE, req, RouteReply, timeout=WAIT)

        first = await ask("s1")
        assert first.session is not None, f"first route refused: {first.error}"
        assert tracker.book.live == {"head": 0, "tail": 0}
        full = await ask("s2")
        assert full.error is not None and full.error.code == "no_capacity"
        held = first.session
        noise = RouteDirective(action="open", session=held, issued_by="elsewhere")
        for action, sid in (("close", "s3"), ("abort", "s4")):
            for _ in range(200):  # a backlog of other routes' directives the tracker has to read first
                await gateway.publish(subjects.route_directive("other"), noise)
            # the end of a session, then at once the next request, on the same connection
            await gateway.publish(subjects.route_directive(held.route_id),
                                  RouteDirective(action=action, session=held, issued_by="gateway"))
            reply = await ask(sid)
            assert reply.session is not None, f"route after {action} refused: {reply.error}"
            held = reply.session
        assert set(tracker.sessions) == {held.route_id}
        assert tracker.book.live == {"head": 0, "tail": 0}


async def test_a_restart_leaves_the_lost_hops_process_whole(  # type: ignore[no-untyped-def]
        bus_factory: BusFactory, nodes) -> None:
    """Two composite processes, each a head and a tail (`meshnet up --replicas 2`). A gateway
    loses the head of a route whose tail shares its process: the restart leaves out that tail
    too (it would keep it as a Kept Hop: its process is dead, though it has not expired yet),
    and both are out of new routes."""
    tbus = await bus_factory("tracker")
    gateway = await bus_factory("gateway")
    async with Tracker(tbus, CONFIG) as tracker:
        made = {n: await nodes(n, start, end, process_id=p) for n, start, end, p in (
            ("head-a", 0, 15, "aa"), ("tail-a", 15, 30, "aa"), ("head-b", 0, 15, "bb"), ("tail-b", 15, 30, "bb"))}
        for n in ("head-b", "tail-b"):
            made[n].beat_load = 0.9  # every route prefers process a while it is routable
        await until(lambda: set(made) <= set(tracker.book.live) and all(
            s.heartbeat is not None and (s.node_id.endswith("-a") or s.heartbeat.load > 0) for s in tracker.registry))
        first = await gateway.request(subjects.ROUTE_CREATE, RouteRequest(model="smol", session_id="s1"),
                                      RouteReply, timeout=WAIT)
        assert first.session is not None and [h.node_id for h in first.session.hops] == ["head-a", "tail-a"]
        restart = RouteRequest(model="smol", session_id="s1-e2", epoch=2, keep_position=7,
                               keep=[KeepHop(node_id="tail-a", session_id="s1", layer_start=15, layer_end=30)],
                               policy=RoutePolicy(exclude_nodes=["head-a"]))
        # the route it asks for before any tracker has read the loss
        again = await gateway.request(subjects.ROUTE_CREATE, restart, RouteReply, timeout=WAIT)
        assert again.session is not None and [h.node_id for h in again.session.hops] == ["head-b", "tail-b"]
        await gateway.publish(subjects.route_directive(first.session.route_id), RouteDirective(
            action="abort", session=first.session, issued_by="gateway", reason="hop unreachable",
            lost_node_id="head-a"))
        await until(lambda: {"head-a", "tail-a"} <= set(tracker.book.suspects))
        assert not {"head-a", "tail-a"} & set(tracker.book.live) and "head-b" not in tracker.book.suspects


async def _head_and_two_tails(tracker: Tracker, nodes) -> dict[str, FakeNode]:  # type: ignore[no-untyped-def]
    """A head and two tails, tail-b loaded so that every route prefers tail-a while it is routable."""
    await nodes("head", 0, 15)
    tails = {n: await nodes(n, 15, 30) for n in ("tail-a", "tail-b")}
    tails["tail-b"].beat_load = 0.9
    await until(lambda: {"head", "tail-a", "tail-b"} <= set(tracker.book.live) and all(
        s.heartbeat is not None and (s.node_id != "tail-b" or s.heartbeat.load > 0) for s in tracker.registry))
    return tails


async def test_a_hop_a_gateway_lost_is_out_of_new_routes_until_heard_from_again(  # type: ignore[no-untyped-def]
        bus_factory: BusFactory, nodes) -> None:
    tbus = await bus_factory("tracker")
    gateway = await bus_factory("gateway")
    async with Tracker(tbus, CONFIG) as tracker:
        tails = await _head_and_two_tails(tracker, nodes)

        async def ask(session_id: str, *exclude: str) -> RouteReply:
            req = RouteRequest(model="smol", session_id=session_id, policy=RoutePolicy(exclude_nodes=list(exclude)))
            return await gateway.request(subjects.ROUTE_CREATE, req, RouteReply, timeout=WAIT)

        async def held(session_id: str) -> RouteError:  # a route only through the held tail
            refused = (await ask(session_id, "tail-b")).error
            assert refused is not None and refused.code == "no_coverage", refused
            return refused

        first = (await ask("s1")).session
        assert first is not None
        lost, other = first.hops[1].node_id, "tail-b"
        assert lost == "tail-a"
        await tails[lost].stop_heartbeats()  # dead, as far as anyone can tell
        await gateway.publish(subjects.route_directive(first.route_id), RouteDirective(
            action="abort", session=first, issued_by="gateway", reason="hop unreachable", lost_node_id=lost))
        await until(lambda: lost in tracker.book.suspects)
        for sid in ("s2", "s3", "s4"):
            again = (await ask(sid)).session
            assert again is not None and again.hops[1].node_id == other  # at once, not at its expiry
        # the only gap is the held node: the refusal names it (an asker waits for it), and no hold is left
        refused = await held("h1")
        assert refused.held_nodes == [lost] and refused.held_s == 0.0 and lost in refused.message, refused
        plain = (await ask("h2", "tail-b", lost)).error  # nothing held would close the gap: a plain refusal
        assert plain is not None and plain.code == "no_coverage" and plain.held_nodes == [], plain
        tails[lost].start_heartbeats()  # it was only frozen: it speaks again, and routes may use it
        await until(lambda: lost in tracker.book.live and lost not in tracker.book.suspects)
        # lost again after it came back (a node whose bus works and whose port does not): its
        # heartbeats no longer bring it back at once (tracker/suspicion.py)
        second = (await ask("s5")).session
        assert second is not None and second.hops[1].node_id == lost
        await gateway.publish(subjects.route_directive(second.route_id), RouteDirective(
            action="abort", session=second, issued_by="gateway", reason="hop unreachable", lost_node_id=lost))
        await until(lambda: lost in tracker.book.suspects)
        reported_at = tracker.book.suspects[lost].reported_at

        def beat_after_report() -> bool:
            state = tracker.registry.get(lost)
            return state is not None and state.heartbeat is not None and state.heartbeat.ts > reported_at + 0.5
        await until(beat_after_report)
        assert lost in tracker.book.suspects and lost not in tracker.book.live
        refused = await held("h3")  # the second strike's hold (10 s) is what is left to wait
        assert refused.held_nodes == [lost] and 8.0 < refused.held_s <= 10.0, refused
        again = (await ask("s6")).session
        assert again is not None and again.hops[1].node_id == other


async def test_a_node_that_leaves_is_out_of_routes_and_its_routes_restart_at_once(  # type: ignore[no-untyped-def]
        bus_factory: BusFactory, nodes) -> None:
    """A node shutting down (SIGTERM) announces that it is leaving: the tracker takes it out of
    new routes and aborts its routes as a loss of it, with its expiry an hour away (before, it
    stayed routable until its heartbeats expired). Its last heartbeats do not bring it back."""
    tbus = await bus_factory("tracker")
    gateway = await bus_factory("gateway")
    async with Tracker(tbus, dataclasses.replace(CONFIG, expire_after=3600.0)) as tracker:
        tails = await _head_and_two_tails(tracker, nodes)

        async def ask(session_id: str) -> RouteSession:
            reply = await gateway.request(subjects.ROUTE_CREATE, RouteRequest(model="smol", session_id=session_id),
                                          RouteReply, timeout=WAIT)
            assert reply.session is not None
            return reply.session

        first = await ask("s1")
        assert first.hops[1].node_id == "tail-a"
        async with gateway.subscribe(subjects.route_directive(first.route_id), RouteDirective) as directives:
            await gateway.flush()
            tails["tail-a"].leaving = True
            await tails["tail-a"].announce()
            async with asyncio.timeout(WAIT):
                abort = await anext(d async for d in directives if d.action == "abort")
        assert abort.lost_node_id == "tail-a" and "left the mesh" in abort.reason
        assert "tail-a" not in tracker.registry and "tail-a" not in tracker.book.live
        for sid in ("s2", "s3"):
            assert (await ask(sid)).hops[1].node_id == "tail-b"
        await asyncio.sleep(0.5)  # its heartbeats go on until its process ends: each hello gets "leaving"
        assert "tail-a" not in tracker.registry and tails["tail-a"].announcements > 1


@pytest.mark.parametrize("skew", [-90.0, 90.0])
async def test_a_lost_hops_way_back_is_timed_on_the_trackers_clock_not_the_nodes(  # type: ignore[no-untyped-def]
        bus_factory: BusFactory, nodes, skew: float) -> None:
    """Machines' wall clocks differ. A node 90 s behind the gateway must not stay out of routes
    90 s after its first loss (its next word brings it back), nor one 90 s ahead escape the hold
    of a second loss (tracker/suspicion.py)."""
    tbus = await bus_factory("tracker")
    gateway = await bus_factory("gateway")
    async with Tracker(tbus, CONFIG) as tracker:
        await nodes("head", 0, 15)
        tails = {n: await nodes(n, 15, 30) for n in ("tail-a", "tail-b")}
        tails["tail-a"].clock_skew = skew
        tails["tail-b"].beat_load = 0.9  # every route prefers tail-a while it is routable
        await until(lambda: {"head", "tail-a", "tail-b"} <= set(tracker.book.live) and all(
            s.heartbeat is not None and (s.node_id != "tail-b" or s.heartbeat.load > 0) for s in tracker.registry))

        async def lose(session_id: str) -> None:
            reply = await gateway.request(subjects.ROUTE_CREATE, RouteRequest(model="smol", session_id=session_id),
                                          RouteReply, timeout=WAIT)
            assert reply.session is not None and reply.session.hops[1].node_id == "tail-a"
            await gateway.publish(subjects.route_directive(reply.session.route_id), RouteDirective(
                action="abort", session=reply.session, issued_by="gateway", reason="hop unreachable",
                lost_node_id="tail-a"))
            await until(lambda: "tail-a" in tracker.book.suspects)

        await lose("s1")  # its heartbeats go on (its bus works): the first loss holds it out for none
        async with asyncio.timeout(5.0):
            while "tail-a" in tracker.book.suspects or "tail-a" not in tracker.book.live:  # noqa: ASYNC110
                await asyncio.sleep(0.02)
        await lose("s2")  # lost again after it came back: held out for HOLD_S[1], whatever its clock
        await asyncio.sleep(1.0)  # ten of its heartbeats
        assert "tail-a" in tracker.book.suspects and "tail-a" not in tracker.book.live


async def test_a_withdrawn_ask_opens_no_route_and_closes_the_one_it_opened(  # type: ignore[no-untyped-def]
        bus_factory: BusFactory, nodes) -> None:
    """An asker that gave up (gateway/routing.py) withdraws its ask: a tracker reading the ask
    later (it was frozen, or the bus delivered it on reconnecting) refuses it, and a route
    opened for it before the withdrawal is closed: nobody would drive it."""
    tbus = await bus_factory("tracker")
    gateway = await bus_factory("gateway")
    async with Tracker(tbus, CONFIG) as tracker, gateway.subscribe(subjects.DIRECTIVE_ALL, RouteDirective) as seen:
        await nodes("head", 0, 15)
        await nodes("tail", 15, 30)
        await until(lambda: {"head", "tail"} <= set(tracker.book.live))

        async def ask(request_id: str) -> RouteReply:
            req = RouteRequest(model="smol", session_id=f"s-{request_id}", request_id=request_id)
            return await gateway.request(subjects.ROUTE_CREATE, req, RouteReply, timeout=WAIT)

        await gateway.publish(subjects.ROUTE_WITHDRAW, RouteWithdrawal(request_id="late", reason="timed out"))
        await until(lambda: "late" in tracker.routes._withdrawn)
        refused = await ask("late")
        assert refused.session is None and refused.error is not None and "withdrawn" in refused.error.message
        assert not tracker.book.sessions

        opened = (await ask("early")).session
        assert opened is not None and opened.route_id in tracker.book.sessions
        await gateway.publish(subjects.ROUTE_WITHDRAW, RouteWithdrawal(request_id="early", reason="client left"))
        async with asyncio.timeout(WAIT):
            async for d in seen:
                if d.action == "close" and d.session.route_id == opened.route_id:
                    break
        assert d.issued_by == CONFIG.tracker_id and "withdrawn" in (d.reason or "")
        assert not tracker.book.sessions and "s-early" not in tracker.book.session_routes


async def test_malformed_route_request_gets_a_typed_reply(bus_factory: BusFactory) -> None:
    tbus = await bus_factory("tracker")
    gateway = await bus_factory("gateway")
    async with Tracker(tbus, CONFIG):
        raw = await gateway._nc.request(subjects.ROUTE_CREATE, b'{"v": 1, "model": 5}', timeout=WAIT)
        reply = RouteReply.from_json(raw.data)
        assert reply.error is not None and reply.error.code == "bad_request"
        bad_id = await gateway.request(
            subjects.ROUTE_CREATE, RouteRequest(model="smol", session_id="a.b"), RouteReply, timeout=WAIT
        )
        assert bad_id.error is not None and bad_id.error.code == "bad_request"


async def test_restarted_tracker_rebuilds_state_from_hello(bus_factory: BusFactory, nodes) -> None:  # type: ignore[no-untyped-def]
    tbus = await bus_factory("tracker")
    head = await nodes("head", 0, 15)
    tail = await nodes("tail", 15, 30)
    async with Tracker(tbus, CONFIG) as first:
        await until(lambda: {"head", "tail"} <= set(first.book.live))
    before = head.announcements + tail.announcements
    async with Tracker(tbus, CONFIG) as second:  # fresh state: only hello makes nodes re-announce
        await until(lambda: {"head", "tail"} <= set(second.book.live))
        assert head.announcements + tail.announcements >= before + 2
        gateway = await bus_factory("gateway")
        reply = await gateway.request(subjects.ROUTE_CREATE, RouteRequest(model="smol"), RouteReply, timeout=WAIT)
        assert reply.session is not None


async def test_heartbeat_from_unknown_node_gets_a_targeted_hello(bus_factory: BusFactory, nodes) -> None:  # type: ignore[no-untyped-def]
    tbus = await bus_factory("tracker")
    async with Tracker(tbus, CONFIG) as tracker:
        late = await nodes("late", 0, 30, announce_first=False)  # heartbeats, never announced
        await until(lambda: "late" in tracker.registry)
        assert late.announcements >= 1


async def test_rebalance_orders_a_redundant_node_to_the_thin_range(bus_factory: BusFactory, nodes) -> None:  # type: ignore[no-untyped-def]
    tbus = await bus_factory("tracker")
    config = TrackerConfig(
        heartbeat_interval=0.1, expire_after=1.5, tick_interval=0.05, rebalance_interval=3600.0,
        target_replicas=2,
    )  # fmt: skip
    async with Tracker(tbus, config) as tracker:
        # only nodes that act on orders are asked (spare=True); h1 is the first of them by rank
        fakes = [await nodes(f"h{i}", 0, 15, spare=True) for i in (1, 2, 3)] + [await nodes("t1", 15, 30)]
        await until(lambda: len(tracker.registry) == 4)
        [cov] = tracker.coverage()
        assert cov.status == "under_provisioned" and cov.under_provisioned == ((15, 30),)
        sent = await tracker.placement.rebalance_tick()
        assert [(d.node_id, d.layer_start, d.layer_end) for d in sent] == [("h1", 15, 30)]
        assert "1/2 replicas" in sent[0].reason
        await until(lambda: bool(fakes[0].rebalance))
        assert fakes[0].rebalance[0].model == "smol" and fakes[0].rebalance[0].n_layer == N_LAYER
        assert await tracker.placement.rebalance_tick() == []  # not repeated while pending


async def test_a_session_no_hop_holds_ends_although_its_close_was_lost(bus_factory: BusFactory, nodes) -> None:  # type: ignore[no-untyped-def]
    tbus = await bus_factory("tracker")
    gateway = await bus_factory("gateway")
    async with Tracker(tbus, dataclasses.replace(CONFIG, session_grace=0.3)) as tracker:
        head = await nodes("head", 0, 15)
        tail = await nodes("tail", 15, 30)
        await until(lambda: {"head", "tail"} <= set(tracker.book.live))
        routes = {}
        for sid in ("kept", "lost-close"):
            reply = await gateway.request(subjects.ROUTE_CREATE, RouteRequest(model="smol", session_id=sid),
                                          RouteReply, timeout=WAIT)
            assert reply.session is not None
            routes[sid] = reply.session.route_id
        # "lost-close" ended on its hops (closed over HTTP) and its close directive never came
        head.held, tail.held = ["kept"], ["kept"]
        await until(lambda: routes["lost-close"] not in tracker.sessions)
        assert set(tracker.sessions) == {routes["kept"]}
        assert tracker.book.live == {"head": 3, "tail": 3}  # the slot it held is free again
        head.held = tail.held = None  # not listed: nothing is concluded from the heartbeat
        await asyncio.sleep(0.5)
        assert set(tracker.sessions) == {routes["kept"]}


async def test_nodes_do_not_expire_while_the_trackers_bus_is_down(  # type: ignore[no-untyped-def]
        nats_server: NatsServer, bus_factory: BusFactory, nodes) -> None:
    tbus = await bus_factory("tracker")
    gateway = await bus_factory("gateway")
    async with Tracker(tbus, CONFIG) as tracker:
        await nodes("head", 0, 15)
        await nodes("tail", 15, 30)
        await until(lambda: {"head", "tail"} <= set(tracker.book.live))
        reply = await gateway.request(subjects.ROUTE_CREATE, RouteRequest(model="smol"), RouteReply, timeout=WAIT)
        assert reply.session is not None
        joined = {s.node_id: s.announced_at for s in tracker.registry}
        await nats_server.stop()
        await asyncio.sleep(CONFIG.expire_after + 1.0)  # no heartbeat reaches anyone meanwhile
        resumed = time.time()
        await nats_server.resume()
        await until(lambda: all(s.heartbeat is not None and s.heartbeat.ts > resumed for s in tracker.registry))
        # the same nodes as before the outage (none expired and re-joined), the session untouched
        assert {s.node_id: s.announced_at for s in tracker.registry} == joined
        assert set(tracker.sessions) == {reply.session.route_id}
        assert {"head", "tail"} <= set(tracker.book.live)


async def test_spread_moves_sessions_off_a_crowded_replica_and_a_move_is_no_loss(  # type: ignore[no-untyped-def]
        bus_factory: BusFactory, nodes) -> None:
    """Two tails, every session on one (the other was out): a spread round orders moves off it,
    each as a directive the gateway acts on; the gateway's abort of a moved route leaves the node
    routable (a lost hop's makes it a suspect and quiets spreading), and the move's route is
    marked as one (its rebuild waits its turn on the nodes)."""
    tbus = await bus_factory("tracker")
    gateway = await bus_factory("gateway")
    config = dataclasses.replace(CONFIG, spread_config=SpreadConfig(min_age_s=0.0, quiet_s=1.0, cooldown_s=0.0))
    async with Tracker(tbus, config) as tracker:
        await nodes("head-a", 0, 15)
        await nodes("head-b", 0, 15)
        tails = {n: await nodes(n, 15, 30) for n in ("tail-a", "tail-b")}
        tails["tail-b"].beat_load = 0.9  # routes prefer tail-a while the load says so
        await until(lambda: {"head-a", "head-b", "tail-a", "tail-b"} <= set(tracker.book.live) and all(
            s.heartbeat is not None and (s.node_id != "tail-b" or s.heartbeat.load > 0) for s in tracker.registry))

        async def ask(req: RouteRequest) -> RouteSession:
            reply = await gateway.request(subjects.ROUTE_CREATE, req, RouteReply, timeout=WAIT)
            assert reply.session is not None, reply.error
            return reply.session

        routes = [await ask(RouteRequest(model="smol", session_id=f"s{i}")) for i in range(4)]
        assert {r.hops[1].node_id for r in routes} == {"tail-a"}
        orders: list[RouteDirective] = []
        async with gateway.subscribe(subjects.DIRECTIVE_ALL, RouteDirective) as sub:
            await until(lambda: not tracker.nodes.rewarming())
            sent = await tracker.placement.spread_tick()
            async with asyncio.timeout(WAIT):
                async for d in sub:
                    if d.action == "move":
                        orders.append(d)
                    if len(orders) == len(sent):
                        break
        moved_tails = [d for d in orders if d.lost_node_id == "tail-a"]
        assert len(moved_tails) == 2 and {d.session.route_id for d in moved_tails} <= {r.route_id for r in routes}
        assert not await tracker.placement.spread_tick()  # ordered already: no second order for them
        # the gateway follows one: it aborts that route (moved) and asks for a route without tail-a
        d = moved_tails[0]
        await gateway.publish(subjects.route_directive(d.session.route_id), RouteDirective(
            action="abort", session=d.session, issued_by="gateway", reason=d.reason, lost_node_id="tail-a",
            moved=True))
        await until(lambda: d.session.route_id not in tracker.sessions)
        assert "tail-a" not in tracker.book.suspects and "tail-a" in tracker.book.live  # a move is no loss
        new = await ask(RouteRequest(model="smol", session_id=f"{d.session.session_id}-e2", epoch=2, move=True,
                                     policy=RoutePolicy(exclude_nodes=["tail-a"])))
        assert new.moved and new.hops[1].node_id == "tail-b"
        assert tracker.clock() - tracker.book.last_loss > 1.0  # no loss seen: spreading goes on
        # a lost hop quiets spreading for quiet_s: its streams' rebuilds run first
        lost = next(r for r in routes if r.route_id != d.session.route_id)
        await gateway.publish(subjects.route_directive(lost.route_id), RouteDirective(
            action="abort", session=lost, issued_by="gateway", reason="hop unreachable",
            lost_node_id=lost.hops[0].node_id))
        await until(lambda: tracker.clock() - tracker.book.last_loss < 1.0)
        assert not await tracker.placement.spread_tick()


@pytest.mark.parametrize("how", ["timeout", "cancelled"])
async def test_a_gateway_withdraws_the_ask_it_gives_up_on(bus_factory: BusFactory, how: str) -> None:
    """No tracker answers (one frozen holding the ask): the Router's timeout, or its caller
    leaving, withdraws the ask under its request id."""
    from gateway.errors import RouteUnavailableError
    from gateway.routing import Router

    frozen = await bus_factory("tracker")
    gateway = await bus_factory("gateway")
    async with frozen.subscribe(subjects.ROUTE_CREATE, RouteRequest) as asks, \
            frozen.subscribe(subjects.ROUTE_WITHDRAW, RouteWithdrawal) as withdrawals:
        router = Router(gateway, timeout=0.3 if how == "timeout" else 30.0)
        asking = asyncio.create_task(router.create(RouteRequest(model="smol", session_id="s1")))
        async with asyncio.timeout(WAIT):
            held = await anext(aiter(asks))  # it reached a tracker, which never answers
        if how == "cancelled":
            asking.cancel()
        with pytest.raises(asyncio.CancelledError if how == "cancelled" else RouteUnavailableError):
            await asking
        async with asyncio.timeout(WAIT):
            withdrawal = await anext(aiter(withdrawals))
    assert withdrawal.request_id == held.request_id and withdrawal.session_id == "s1"
    assert withdrawal.reason.startswith("the asker left" if how == "cancelled"
                                        else "routing failed: no tracker answered within 0.3s")


async def test_a_range_whose_new_node_leaves_soon_after_is_ordered_again_at_once(  # type: ignore[no-untyped-def]
        bus_factory: BusFactory, nodes) -> None:
    """The rebalance cooldown covers an ordered node's fetch and load: once it serves the range,
    losing it again is a gap ordered to the next donor on the next tick, not 30 s later."""
    tbus = await bus_factory("tracker")
    async with Tracker(tbus, CONFIG) as tracker:
        await nodes("h", 0, 15)
        tail = await nodes("t", 15, 30)
        d1, d2 = await nodes("d1", 0, 15, spare=True), await nodes("d2", 0, 15, spare=True)
        await until(lambda: len(tracker.registry) == 4)

        async def leave(node) -> None:  # type: ignore[no-untyped-def]
            node.leaving = True
            await node.announce()
            await node.stop()

        await leave(tail)
        await until(lambda: "t" not in tracker.book.live)
        sent = await tracker.placement.rebalance_tick()
        assert [(d.node_id, d.layer_start, d.layer_end) for d in sent] == [("d1", 15, 30)]
        d1.cap = capability(15, 30)  # it loaded the range and serves it
        await d1.announce()
        await until(lambda: [c.status for c in tracker.coverage()] == ["covered"])
        await leave(d1)
        await until(lambda: "d1" not in tracker.book.live)
        sent = await tracker.placement.rebalance_tick()
        assert [(d.node_id, d.layer_start, d.layer_end) for d in sent] == [("d2", 15, 30)]
        await until(lambda: bool(d2.rebalance))
        assert (d2.rebalance[0].layer_start, d2.rebalance[0].layer_end) == (15, 30)
