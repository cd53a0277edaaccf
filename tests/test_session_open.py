"""Opening a session is all or nothing, and a node's slots come from its KV memory.

Every way an open can fail leaves the slot and cache counts as they were: on the engine's
session table (duplicate id, no free slot, sampling it cannot use) and on the node's table
(a hop the node does not serve, no free slot, an engine that refuses). The real llama.cpp
engine sizes its slots from `kv_memory`.
"""

from __future__ import annotations

import asyncio
import re
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from pydantic import ValidationError

from nodes.engine import CacheFullError, EngineError, KvBudgetError, SessionExistsError
from nodes.server.hop_evidence import EvidenceShelf
from nodes.server.hop_machine import HopPhase
from nodes.server.runner import EngineRunner
from nodes.server.scheduler import HopScheduler
from nodes.server.session import HopConfig
from nodes.server.table import SessionTable
from nodes.shard_checks import SlotTable, sessions_for_memory
from schemas.capability import CapabilityReport, ShardRange
from schemas.route import Hop, RouteSession
from schemas.sampling import SamplingParams


@pytest.mark.parametrize(("memory", "per_token", "n_ctx", "cap", "slots"), [
    (1 << 30, 12_288, 2048, 256, 42),  # 16 of the bundled model's layers (f16 K and V)
    (1 << 30, 11_520, 2048, 256, 45),  # 15 of them
    (12_288 * 2048, 12_288, 2048, 256, 1),  # exactly one
    (1 << 40, 1, 1, 256, 256),  # never more sequences than llama.cpp has ids
])
def test_slots_come_from_the_kv_budget(memory: int, per_token: int, n_ctx: int, cap: int, slots: int) -> None:
    assert sessions_for_memory(memory, per_token, n_ctx, cap=cap) == slots


def test_a_session_larger_than_the_kv_budget_is_refused() -> None:
    """It was given one slot all the same, which llama.cpp allocated past the budget."""
    with pytest.raises(KvBudgetError, match=re.escape("lower --ctx (at most 85 tokens) or raise --kv-memory")):
        sessions_for_memory(1 << 20, 12_288, 2048)


def test_a_negative_seed_is_refused_by_the_contract() -> None:
    with pytest.raises(ValidationError):
        SamplingParams(seed=-1)
    assert SamplingParams(seed=0).seed == 0


def test_engine_opens_are_all_or_nothing() -> None:
    table = SlotTable(2)
    table.open("a", None)
    with pytest.raises(SessionExistsError):
        table.open("a", None)
    assert (len(table), table.free) == (1, 1)
    bad = SamplingParams.model_construct(temperature=0.5, top_p=1.0, seed=-1, top_logprobs=0, logprobs=False)
    with pytest.raises(ValueError):
        table.open("b", bad)  # numpy refuses the seed: before a slot was taken
    assert (len(table), table.free, table.ids()) == (1, 1, ["a"])
    table.open("b", SamplingParams(seed=3))
    with pytest.raises(CacheFullError):
        table.open("c", None)
    assert (len(table), table.free) == (2, 0)
    table.close("a")
    table.open("c", None)  # a freed slot is usable at once
    assert table.free == 0


class CountingEngine:
    """The engine side of a node's open: counts sessions, refuses when told to."""

    def __init__(self) -> None:
        self.open: set[str] = set()
        self.refuse = False

    def open_session(self, session_id: str, sampling=None) -> None:
        if self.refuse:
            raise EngineError("scripted refusal")
        self.open.add(session_id)

    def sessions(self) -> list[str]:
        return sorted(self.open)

    def close_session(self, session_id: str) -> None:
        self.open.discard(session_id)

    def capability(self) -> CapabilityReport:
        return CAP


CAP = CapabilityReport(model_arch="llama", model_name="m", model_revision="rev", runtime="llama.cpp",
                       layers=ShardRange(start=0, end=15, n_layer=30), hidden_size=4, vocab_size=10,
                       n_ctx=64, cache_abi="abi", cache_bytes_per_token=8, max_sessions=2)


def route(sid: str, *, layers: tuple[int, int] = (0, 15), revision: str = "rev", abi: str = "abi",
          hidden: int = 4) -> RouteSession:
    hops = [Hop(node_id="me", activation_url="http://127.0.0.1:1", layer_start=layers[0], layer_end=layers[1]),
            Hop(node_id="next", activation_url="http://127.0.0.1:2", layer_start=layers[1], layer_end=30)]
    return RouteSession(session_id=sid, route_id=f"r-{sid}", model="m", model_revision=revision, cache_abi=abi,
                        n_layer=30, hidden_size=hidden, n_ctx=64, hops=hops)


async def test_node_opens_are_all_or_nothing() -> None:
    engine = CountingEngine()
    runner = EngineRunner(engine, None)  # type: ignore[arg-type]
    cfg = HopConfig(node_id="me", runner=runner, scheduler=HopScheduler(runner), hidden_size=4, n_ctx=64,
                    window=4)
    table = SessionTable(cfg, CAP, max_sessions=2, lease_s=60)

    def counts() -> tuple[int, int, int]:
        return table.free_slots, len(table.live), len(engine.open)

    refusals = [route("x1", layers=(0, 10)), route("x2", revision="other"), route("x3", abi="other"),
                route("x4", hidden=8)]
    for r in refusals:
        assert await table.open(r, 0) is not None
        assert counts() == (2, 0, 0), r.session_id
    engine.refuse = True
    assert "scripted refusal" in (await table.open(route("x5"), 0) or "")
    assert counts() == (2, 0, 0)
    engine.refuse = False
    assert await table.open(route("a"), 0) is None
    assert await table.open(route("b"), 0) is None
    assert counts() == (0, 2, 2)
    assert "no free session slot" in (await table.open(route("c"), 0) or "")
    assert counts() == (0, 2, 2)
    await table.end("a", HopPhase.CLOSED, "done")
    assert counts() == (1, 1, 1)
    assert await table.open(route("c"), 0) is None  # the slot a close freed, at once
    await table.close_all("test over")
    assert counts() == (2, 0, 0)


class BusyEngine(CountingEngine):
    """An engine whose thread is busy with a model call when an open comes: the open waits."""

    def open_session(self, session_id: str, sampling=None) -> None:
        time.sleep(0.5)  # the model call in progress on the engine's thread
        super().open_session(session_id, sampling)


async def test_a_frame_waits_for_an_open_its_directive_began_past_the_grace_period() -> None:
    """Under load the engine allocates a session behind the model call in progress, which can
    outlast the grace period. A frame whose open directive came waits for the open to finish
    (it was answered `unknown_session` before, and the gateway took the hop for lost); one for a
    session no directive named still gets that answer after the grace period."""
    engine = BusyEngine()
    with ThreadPoolExecutor(1) as pool:
        runner = EngineRunner(engine, pool, owns_pool=False)
        cfg = HopConfig(node_id="me", runner=runner, scheduler=HopScheduler(runner), hidden_size=4, n_ctx=64,
                        window=4)
        table = SessionTable(cfg, CAP, max_sessions=2, lease_s=60, grace_s=0.1)
        opening = asyncio.create_task(table.open(route("a"), 0))
        await asyncio.sleep(0)  # the directive is being applied: the engine is allocating
        found = await table.lookup("a")
        assert await opening is None and found is table.live["a"]
        missing = await table.lookup("never-opened")
        assert getattr(missing, "code", None) == "unknown_session"
        # two frames wait for "b"; the first gives up before the open begins, the second waits it out
        first = asyncio.create_task(table.lookup("b"))
        await asyncio.sleep(0.05)
        second = asyncio.create_task(table.lookup("b"))
        await asyncio.sleep(0.07)
        opening = asyncio.create_task(table.open(route("b"), 0))
        async with asyncio.timeout(10):  # a guard: the second waited for ever before
            assert getattr(await first, "code", None) == "unknown_session"
            assert await opening is None and await second is table.live["b"]
        await table.close_all("test over")


def test_the_llama_engine_sizes_its_slots_from_kv_memory(model_path) -> None:
    from nodes.llama_engine import LlamaShardEngine

    engine = LlamaShardEngine(model_path, 0, 15, n_ctx=256, kv_memory=40 * 12_288 * 256, n_threads=1,
                              measure=False)
    try:
        cap = engine.capability()
        assert cap.cache_bytes_per_token == 12_288 and cap.max_sessions == 40
        ids = [f"s{i}" for i in range(40)]
        for sid in ids:
            engine.open_session(sid)
        with pytest.raises(CacheFullError):
            engine.open_session("one-more")
        for sid in ids[:3]:
            engine.forward(sid, 0, token_ids=np.array([1, 2, 3], np.int32))
        assert sorted(engine.sessions()) == sorted(ids)
    finally:
        engine.close()


def test_a_rejected_part_inside_a_batch_leaves_the_other_sessions_untouched(model_path) -> None:
    from nodes.engine import BatchPart, PositionMismatchError
    from nodes.llama_engine import LlamaShardEngine

    engine = LlamaShardEngine(model_path, 0, 15, n_ctx=128, max_sessions=6, n_threads=1, measure=False)
    try:
        prompts = {"a": [1, 50, 60, 70], "b": [1, 80, 90], "bad": [1, 5]}

        def batch(tag: str, with_bad: bool) -> list[object]:
            for sid, ids in prompts.items():
                engine.open_session(tag + sid)
                engine.forward(tag + sid, 0, token_ids=np.array(ids, np.int32))
            parts = [BatchPart(tag + "a", 4, np.array([7], np.int32)),
                     BatchPart(tag + "bad", 9, np.array([7], np.int32)),  # the bad session is at 2
                     BatchPart(tag + "b", 3, np.array([8], np.int32))]
            return engine.forward_batch(parts if with_bad else [parts[0], parts[2]])

        with_bad, clean = batch("x-", True), batch("y-", False)
        assert isinstance(with_bad[1], PositionMismatchError)
        assert engine.position("x-bad") == 2  # the refused part left its session as it was
        assert engine.position("x-a") == 5 and engine.position("x-b") == 4
        for got, want in ((with_bad[0], clean[0]), (with_bad[2], clean[1])):
            assert np.array_equal(got.hidden, want.hidden)  # bit-identical to the batch without it
        again = engine.forward_batch([BatchPart("x-bad", 2, np.array([7], np.int32))])
        assert again[0].hidden is not None and engine.position("x-bad") == 3  # and it still works
    finally:
        engine.close()


async def test_an_ended_session_lets_go_of_its_row_logs() -> None:
    """A middle hop logs the rows it received and sent (Hop Evidence, Seam Log). Its ended
    session stays in the table's `ended` (1024 of them), and kept both logs: a node's memory
    grew with every session it served, past the Evidence Shelf's byte budget (the soak probe saw
    a composite node gain ~10 MB a wave, never given back). The shelf keeps its copy."""
    cap = CAP.model_copy(update={"layers": ShardRange(start=10, end=20, n_layer=30)})
    runner = EngineRunner(CountingEngine(), None)  # type: ignore[arg-type]
    cfg = HopConfig(node_id="me", runner=runner, scheduler=HopScheduler(runner), hidden_size=4, n_ctx=64,
                    window=4, evidence=EvidenceShelf("me"))
    table = SessionTable(cfg, cap, max_sessions=2, lease_s=60, keep_s=0)
    hops = [Hop(node_id=n, activation_url=f"http://127.0.0.1:{i + 1}", layer_start=a, layer_end=b)
            for i, (n, a, b) in enumerate([("head", 0, 10), ("me", 10, 20), ("tail", 20, 30)])]
    r = RouteSession(session_id="m", route_id="r-m", model="m", model_revision="rev", cache_abi="abi",
                     n_layer=30, hidden_size=4, n_ctx=64, hops=hops)
    assert await table.open(r, 1) is None
    hs = table.live["m"]
    assert hs.inbound_log is not None and hs.seam_log is not None
    hs.inbound_log.put(0, np.ones((3, 4), dtype=np.float32))
    await table.end("m", HopPhase.CLOSED, "done")
    assert table.ended["m"] is hs and (hs.inbound_log, hs.seam_log) == (None, None)
    kept = cfg.evidence.get("m")  # type: ignore[union-attr]
    assert kept is not None and kept.inbound is not None and kept.inbound.length == 3
