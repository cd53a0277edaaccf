"""Kept Hops, piece by piece: which rows each hop of a restart's route receives, computes and
sends on (pure), what the gateway asks to keep, how the tracker honours it, how a node parks,
adopts and frees a session's Hot KV State, and that a llama.cpp session cut back and continued
gives the logits of the uninterrupted one (the real bundled model)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from gateway.session_machine import keep_for_restart
from nodes.engine import PositionMismatchError
from nodes.server.hop_machine import HopPhase, PromptIn
from nodes.server.runner import EngineRunner
from nodes.server.scheduler import HopScheduler
from nodes.server.seam_log import SeamLog
from nodes.server.session import HopConfig
from nodes.server.table import SessionTable
from nodes.shard_checks import SlotTable
from schemas.capability import CapabilityReport, ShardRange
from schemas.route import (
    Hop,
    KeepHop,
    RouteFailure,
    RoutePolicy,
    RouteRequest,
    RouteSession,
    inbound_start,
)
from schemas.sampling import SamplingParams
from schemas.session_id import derived_session_id
from tests.fixtures.model import route_prefill
from tests.test_tracker_routing import node
from tracker.routing import (
    RouteQuery,
    build_index,
    kept_hops,
    plan_route,
    route_session,
    same_session,
)


def hop(node_id: str, start: int, end: int, keep: str = "", at: int = 0) -> Hop:
    return Hop(node_id=node_id, activation_url=f"http://127.0.0.1/{node_id}", layer_start=start, layer_end=end,
               keep_session=keep, keep_position=at)


def session(sid: str, hops: list[Hop]) -> RouteSession:
    return RouteSession(session_id=sid, route_id=f"r-{sid}", model="smol", model_revision="rev1",
                        cache_abi="abi", n_layer=30, hidden_size=4, n_ctx=64, hops=hops)


# --- which rows go where (pure) -------------------------------------------------------------

def test_a_new_head_receives_the_whole_history_and_a_kept_tail_only_its_last_token() -> None:
    hops = [hop("h2", 0, 15), hop("t", 15, 30, "s", 40)]
    assert [inbound_start(hops, i) for i in range(2)] == [0, 40]


def test_a_kept_head_receives_everything_when_the_tail_starts_empty() -> None:
    hops = [hop("h", 0, 15, "s", 40), hop("t2", 15, 30)]
    assert [inbound_start(hops, i) for i in range(2)] == [0, 0]  # its Seam Log serves rows [0, 40)


def test_a_lost_middle_needs_the_head_from_the_start_and_the_tail_only_at_its_keep() -> None:
    hops = [hop("h", 0, 10, "s", 40), hop("m2", 10, 20), hop("t", 20, 30, "s", 40)]
    assert [inbound_start(hops, i) for i in range(3)] == [0, 0, 40]
    assert [h.kept for h in hops] == [40, 0, 40]
    assert hop("x", 0, 10, "", 40).kept == 0  # a position without a session keeps nothing


# --- what the gateway asks to keep (pure) -----------------------------------------------------

LOST_ROUTE = session("s", [hop("h", 0, 15), hop("t", 15, 30)])


def lost(node_id: str | None, code: str = "hop_lost", phase: str = "decode") -> RouteFailure:
    return RouteFailure(session_id="s", route_id="r-s", phase=phase, node_id=node_id, reason="x", code=code)  # type: ignore[arg-type]


def test_the_gateway_keeps_every_hop_but_the_lost_one_at_all_but_the_last_token() -> None:
    keep, at = keep_for_restart(LOST_ROUTE, lost("h"), history=50, generated=10)
    assert keep == [KeepHop(node_id="t", session_id="s", layer_start=15, layer_end=30)]
    assert at == 49


@pytest.mark.parametrize(("failure", "generated"), [
    (lost("h"), 0),  # lost in prefill: a hop may hold only part of the prompt
    (lost(None, "hop_stalled"), 10),  # a stall does not say which hop is lost
    (lost("h", "engine_error"), 10),
])
def test_the_gateway_keeps_nothing_when_it_cannot_know_what_each_hop_holds(failure: RouteFailure,
                                                                            generated: int) -> None:
    assert keep_for_restart(LOST_ROUTE, failure, history=50, generated=generated) == ([], 0)


# --- how the tracker honours it ---------------------------------------------------------------

def restart_request(keep: list[KeepHop], *, sid: str = "client-1-e2", epoch: int = 2, at: int = 49) -> RouteRequest:
    return RouteRequest(model="smol", session_id=sid, epoch=epoch, keep=keep, keep_position=at)


def test_only_sessions_of_the_same_client_session_can_be_kept() -> None:
    mine = KeepHop(node_id="t-a", session_id="client-1", layer_start=15, layer_end=30)
    other = KeepHop(node_id="t-a", session_id="client-2", layer_start=15, layer_end=30)
    assert same_session("client-1", "client-1-e3") and same_session("client-1-e2", "client-1-e3")
    assert not same_session("client-1", "client-2-e2")
    assert not same_session("client-10", "client-1-e2") and not same_session("x", "-e2")
    long_id = "c" * 64
    for epoch in (2, 3, 10, 123456):
        again = derived_session_id(long_id, f"-e{epoch}")
        assert len(again) <= 64 and same_session(long_id, again) and same_session(again, derived_session_id(long_id, "-e2"))
    other_long = "c" * 63 + "d"  # alike in its first 63 characters: another session all the same
    assert not same_session(other_long, derived_session_id(long_id, "-e2"))
    assert derived_session_id(other_long, "-n1") != derived_session_id(long_id, "-n1")
    assert derived_session_id("client-1", "-n1") == "client-1-n1"  # short ids just take the suffix
    assert not same_session("c" * 70, "c" * 10 + "-e2")
    assert kept_hops(restart_request([mine, other])) == [mine]
    assert kept_hops(restart_request([mine], epoch=1)) == []  # not a restart
    assert kept_hops(restart_request([mine], at=0)) == []


def test_the_tracker_keeps_a_surviving_hop_even_when_it_is_dearer_and_has_no_free_slot() -> None:
    views = [node("h-a", 0, 15), node("h-b", 0, 15), node("t-a", 15, 30, tps=10.0, free=0),
             node("t-b", 15, 30, tps=200.0)]
    keep = [KeepHop(node_id="t-a", session_id="client-1", layer_start=15, layer_end=30)]
    req = restart_request(keep).model_copy(update={"policy": RoutePolicy(exclude_nodes=["h-a"])})

    plan = plan_route(build_index(views), RouteQuery.from_request(req), live={v.node_id: v.free_slots for v in views})
    assert not isinstance(plan, Exception) and [v.node_id for v in plan.hops] == ["h-b", "t-a"]  # type: ignore[union-attr]
    s = route_session(plan, req, session_id="client-1-e2", route_id="r2")  # type: ignore[arg-type]
    assert [(h.keep_session, h.keep_position) for h in s.hops] == [("", 0), ("client-1", 49)]
    without = plan_route(build_index(views), RouteQuery.from_request(restart_request([])),
                         live={v.node_id: v.free_slots for v in views})
    assert [v.node_id for v in without.hops][1] == "t-b"  # type: ignore[union-attr]


def test_a_kept_hop_that_is_excluded_or_gone_is_not_kept() -> None:
    views = [node("h-a", 0, 15), node("t-a", 15, 30), node("t-b", 15, 30)]
    keep = [KeepHop(node_id="t-a", session_id="client-1", layer_start=15, layer_end=30)]
    req = restart_request(keep)
    live = {"h-a": 4, "t-b": 4}  # t-a expired
    plan = plan_route(build_index(views), RouteQuery.from_request(req), live=live)
    assert [v.node_id for v in plan.hops] == ["h-a", "t-b"]  # type: ignore[union-attr]
    assert all(not h.keep_session for h in route_session(plan, req, session_id="client-1-e2", route_id="r").hops)  # type: ignore[arg-type]


# --- the Seam Log -----------------------------------------------------------------------------

def test_the_seam_log_keeps_rows_by_position_and_grows() -> None:
    log = SeamLog(width=3, limit=1000)
    rows = np.arange(300 * 3, dtype=np.float32).reshape(300, 3)
    log.put(0, rows[:200])
    log.put(200, rows[200:])
    assert log.length == 300 and np.array_equal(log.rows(10, 300), rows[10:])
    log.put(299, rows[299:])  # the same row again (a Kept Hop's last token) is fine
    log.truncate(120)
    assert log.length == 120
    with pytest.raises(ValueError):
        log.rows(100, 121)
    assert not log.put(121, rows[:1])  # a gap: not recorded (the log is a shortcut, never an error)
    assert not log.put(990, rows[:20])  # past the context
    assert log.length == 120


# --- parking and adopting on a node -----------------------------------------------------------

class PositionEngine:
    """The engine side of parking: sessions with a position; adopt cuts and renames."""

    def __init__(self, slots: int) -> None:
        self.table = SlotTable(slots)

    def open_session(self, session_id: str, sampling=None) -> None:
        self.table.open(session_id, sampling)

    def adopt_session(self, old_id: str, new_id: str, keep: int, sampling=None) -> None:
        self.table.rename(old_id, new_id, keep, sampling)

    def sessions(self) -> list[str]:
        return self.table.ids()

    def close_session(self, session_id: str) -> None:
        self.table.close(session_id)

    def position(self, session_id: str) -> int:
        return self.table.get(session_id).position

    def cache_bytes(self, session_id: str) -> int:
        return 8 * self.position(session_id)

    def capability(self) -> CapabilityReport:
        return CAP


CAP = CapabilityReport(model_arch="llama", model_name="m", model_revision="rev1", runtime="llama.cpp",
                       layers=ShardRange(start=15, end=30, n_layer=30), hidden_size=4, vocab_size=10,
                       n_ctx=64, cache_abi="abi", cache_bytes_per_token=8, max_sessions=2)


def tail_route(sid: str, keep: str = "", at: int = 0) -> RouteSession:
    """This node's tail hop; a restart's route (`keep`) has another head, the lost one left out."""
    return session(sid, [hop("head-b" if keep else "head", 0, 15), hop("me", 15, 30, keep, at)])


async def node_table(slots: int = 2, keep_s: float = 10.0) -> tuple[SessionTable, PositionEngine]:
    engine = PositionEngine(slots)
    runner = EngineRunner(engine, None)  # type: ignore[arg-type]
    cfg = HopConfig(node_id="me", runner=runner, scheduler=HopScheduler(runner), hidden_size=4, n_ctx=64, window=4)
    return SessionTable(cfg, CAP, max_sessions=slots, lease_s=60, keep_s=keep_s), engine


async def served(table: SessionTable, engine: PositionEngine, sid: str, positions: int, *,
                 decoding: bool = True) -> None:
    assert await table.open(tail_route(sid), 1) is None
    engine.table.get(sid).position = positions  # as if it had run that many rows
    hs = table.live[sid]
    hs.done_position = positions
    if decoding:
        hs.apply(PromptIn())


async def test_a_parked_session_is_continued_by_the_restart_that_keeps_it() -> None:
    table, engine = await node_table()
    await served(table, engine, "s", 30)
    assert await table.end("s", HopPhase.ABORTED, "head lost", lost("head"))
    assert list(table.parked) == ["s"] and engine.sessions() == ["s"]  # its KV stays
    assert table.free_slots == 2  # parked state is only kept in case it helps
    assert await table.open(tail_route("s-e2", "s", 29), 1) is None
    assert engine.sessions() == ["s-e2"] and engine.position("s-e2") == 29
    hs = table.live["s-e2"]
    assert (hs.kept, hs.next_position, hs.seam_log) == (29, 29, None)  # a tail has no Seam Log
    assert table.kept_total == 1 and not table.parked


async def test_a_restart_that_comes_before_the_abort_ends_the_old_session_itself() -> None:
    table, engine = await node_table()
    await served(table, engine, "s", 30)
    assert await table.open(tail_route("s-e2", "s", 29), 1) is None
    assert "s" not in table.live and table.ended["s"].life.phase is HopPhase.ABORTED
    assert engine.sessions() == ["s-e2"]


async def test_a_live_session_whose_route_lost_nothing_is_not_taken() -> None:
    table, engine = await node_table()
    await served(table, engine, "s", 30)
    same_hops = session("s-e2", [hop("head", 0, 15), hop("me", 15, 30, "s", 29)])  # every old hop is on it
    assert await table.open(same_hops, 1) is not None
    assert table.live["s"].open and engine.sessions() == ["s"]


async def test_a_session_that_lost_a_hop_before_its_prompt_was_in_is_freed_at_once() -> None:
    table, engine = await node_table()
    await served(table, engine, "s", 30, decoding=False)
    await table.end("s", HopPhase.ABORTED, "head lost", lost("head"))
    assert not table.parked and engine.sessions() == []  # a restart never keeps a hop in prefill


async def test_a_keep_the_node_cannot_honour_is_refused_and_frees_nothing_else() -> None:
    table, engine = await node_table()
    await served(table, engine, "s", 30)
    await table.end("s", HopPhase.ABORTED, "head lost", lost("head"))
    reason = await table.open(tail_route("s-e2", "s", 31), 1)  # more than it holds
    assert reason is not None and "31" in reason
    assert engine.sessions() == []  # the parked state could not be used: freed
    assert await table.open(tail_route("x-e2", "x", 3), 1) is not None  # never held here
    assert not table.live


async def test_parked_state_gives_way_to_new_sessions_and_expires() -> None:
    table, engine = await node_table(slots=2, keep_s=5.0)
    await served(table, engine, "a", 10)
    await served(table, engine, "b", 10)
    await table.end("a", HopPhase.ABORTED, "head lost", lost("head"))
    await table.end("b", HopPhase.ABORTED, "head lost", lost("head"))
    assert list(table.parked) == ["a", "b"]
    assert await table.open(tail_route("c"), 1) is None  # needs a slot: the oldest parked goes
    assert sorted(engine.sessions()) == ["b", "c"] and list(table.parked) == ["b"]
    import time

    await table.expire_idle(time.monotonic() + 6.0)
    assert list(table.parked) == [] and engine.sessions() == ["c"]


async def test_a_new_session_opening_beside_a_restart_does_not_free_the_state_it_continues() -> None:
    """A node applies directives concurrently: a restart's open continuing a parked session may
    still be under way when another session's open needs a slot. The parked state it continues
    is that open's slot, not a spare one to free (before, it was freed and the restart lost
    its Kept Hop)."""
    table, engine = await node_table(slots=3)
    await served(table, engine, "x", 10)
    await served(table, engine, "s", 30)
    await table.end("s", HopPhase.ABORTED, "head lost", lost("head"))
    old = table.parked["s"]
    old.stopped.clear()  # as if its worker were still stopping: the restart's open waits for it
    restart = asyncio.create_task(table.open(tail_route("s-e2", "s", 29), 1))
    await asyncio.sleep(0.01)  # the restart's open is under way
    asyncio.get_running_loop().call_later(0.05, old.stopped.set)
    assert await table.open(tail_route("z"), 1) is None
    assert await restart is None and table.live["s-e2"].kept == 29
    assert sorted(engine.sessions()) == ["s-e2", "x", "z"]


async def test_a_plain_abort_and_a_shutdown_free_at_once() -> None:
    table, engine = await node_table()
    await served(table, engine, "a", 10)
    await table.end("a", HopPhase.ABORTED, "client went away")
    await served(table, engine, "b", 10)
    await table.end("b", HopPhase.ABORTED, "head lost", lost("head"))
    assert engine.sessions() == ["b"]
    await table.close_all("node shutting down")
    assert engine.sessions() == [] and not table.parked


# --- the real engine: cut back and continued equals uninterrupted ------------------------------

def test_engine_rename_is_all_or_nothing() -> None:
    t = SlotTable(2)
    t.open("a", None).position = 5
    t.open("b", None)
    with pytest.raises(PositionMismatchError):
        t.rename("a", "c", 6, None)
    from nodes.engine import SessionExistsError

    with pytest.raises(SessionExistsError):
        t.rename("a", "b", 3, None)
    assert t.ids() == ["a", "b"] and t.get("a").position == 5
    kept = t.rename("a", "c", 3, SamplingParams(seed=4))
    assert (kept.position, kept.sampling.seed, t.ids(), t.free) == (3, 4, ["b", "c"], 0)


@pytest.mark.parametrize("backend", ["llama.cpp", "torch"])
def test_a_session_cut_back_and_continued_gives_the_uninterrupted_logits(shard_engine, backend: str) -> None:
    head, tail = shard_engine(0, 15, backend), shard_engine(15, 30, backend)
    ids = list(range(100, 140))
    engines = [head, tail]
    for e in engines:
        e.open_session("keep-a")
    try:
        route_prefill(engines, "keep-a", ids)
        tokens = [11, 12, 13, 14]
        pos = len(ids)
        outs = []
        for t in tokens:
            outs.append(route_prefill(engines, "keep-a", [t], pos).logits)
            pos += 1
        # cut both halves back to before the third token, under a new id, and run it again
        for e in engines:
            e.adopt_session("keep-a", "keep-b", len(ids) + 2)
        assert "keep-a" not in head.sessions() and head.position("keep-b") == len(ids) + 2
        again = route_prefill(engines, "keep-b", [tokens[2]], len(ids) + 2).logits
        assert np.array_equal(again, outs[2])
    finally:
        for e in engines:
            for sid in ("keep-a", "keep-b"):
                if sid in e.sessions():
                    e.close_session(sid)


async def test_a_shutdown_ends_every_session_as_a_loss_of_this_node() -> None:
    """The frames still waiting are answered with `hop_lost` naming this node, so the gateway's
    restart leaves it (and its process) out of the new route (before: `session_closed`, no node
    named, and the restart was given the closing node again)."""
    table, engine = await node_table()
    await served(table, engine, "a", 10)
    await table.close_all("node shutting down")
    failure = table.ended["a"].failure
    assert failure is not None
    assert (failure.code, failure.node_id, failure.hop_index) == ("hop_lost", "me", 1)
    assert "node shutting down" in failure.reason
    assert engine.sessions() == [] and not table.parked
