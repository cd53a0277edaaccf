"""The hop scheduler and the EngineRunner under it.

- plan_batch (pure): which sessions' rows run in one iteration, table-tested without a model;
- HopScheduler: every session's pending rows run as one engine call per iteration, a long
  prefill in slices with other sessions' decode rows in every slice, a failing part fails
  only its own Work;
- EngineRunner: the engine is built and called on one thread only (libgomp keeps a pool per
  calling thread; a second pool on a small machine makes every barrier sleep), inline on the
  event loop's thread by default or on a dedicated thread.

The engine here records calls and threads (these tests are about scheduling, not the model;
the real llama.cpp engine runs through the same scheduler in the route and gateway tests)."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from nodes.engine import BatchPart, PositionMismatchError, ShardOutput, TokenChoice
from nodes.server.engine_turns import EngineTurns
from nodes.server.runner import EngineRunner, WorkMeter
from nodes.server.scheduler import (
    HopScheduler,
    PendingView,
    Work,
    breather_wait,
    mixed_rows,
    plan_batch,
    slice_rows,
)


class ThreadRecordingEngine:
    """Notes the thread of construction and of every call, and every batch it ran."""

    def __init__(self) -> None:
        self.threads = {("init", threading.get_ident())}
        self.batches: list[list[tuple[str, int, int]]] = []  # per call: (session, position, rows)
        self.positions: dict[str, int] = {}

    def _note(self, what: str) -> None:
        self.threads.add((what, threading.get_ident()))

    def forward_batch(self, parts: list[BatchPart]) -> list[object]:
        self._note("forward")
        self.batches.append([(p.session_id, p.position, len(p.rows)) for p in parts])
        out: list[object] = []
        for p in parts:
            if p.position != self.positions.get(p.session_id, 0):
                out.append(PositionMismatchError("wrong position", session_id=p.session_id))
                continue
            self.positions[p.session_id] = p.position + len(p.rows)
            # each output row carries its position, so a joined output shows its order
            hidden = np.arange(p.position, p.position + len(p.rows), dtype=np.float32)[:, None].repeat(4, 1)
            out.append(ShardOutput(hidden=hidden, token=TokenChoice(token_id=p.position) if p.sample else None))
        return out

    def capability(self) -> SimpleNamespace:
        return SimpleNamespace(prefill_tokens_per_second=100.0)

    def open_session(self, session_id: str, sampling=None) -> None:
        self._note("open")

    def cache_bytes(self, session_id: str) -> int:
        return 0

    def position(self, session_id: str) -> int:
        return self.positions.get(session_id, 0)

    def sessions(self) -> list[str]:
        self._note("sessions")
        return ["s"]

    def close_session(self, session_id: str) -> None:
        self._note("close_session")

    def close(self) -> None:
        self._note("close")


V = PendingView


@pytest.mark.parametrize(("pending", "kw", "plan"), [
    # every decode row goes in, then prefill rows up to the mixed budget
    ([V("a", 1), V("b", 300), V("c", 1)], dict(max_rows=512, prefill_rows=256, mixed_prefill_rows=64),
     [(0, 1), (2, 1), (1, 64)]),
    # prefill only: the prefill budget, oldest first, spilling into the next prompt
    ([V("a", 100), V("b", 100)], dict(max_rows=512, prefill_rows=150, mixed_prefill_rows=64),
     [(0, 100), (1, 50)]),
    # one Work per session per iteration: a session's second Work waits for its first
    ([V("a", 1), V("a", 1), V("b", 1)], dict(max_rows=512, prefill_rows=256, mixed_prefill_rows=64),
     [(0, 1), (2, 1)]),
    ([V("a", 5), V("a", 1)], dict(max_rows=512, prefill_rows=256, mixed_prefill_rows=64), [(0, 5)]),
    # the row bound holds for decode rows too; prefill waits when decode fills the batch
    ([V(f"s{i}", 1) for i in range(5)] + [V("p", 50)], dict(max_rows=4, prefill_rows=256, mixed_prefill_rows=64),
     [(0, 1), (1, 1), (2, 1), (3, 1)]),
    ([V("a", 1), V("p", 50)], dict(max_rows=8, prefill_rows=256, mixed_prefill_rows=64), [(0, 1), (1, 7)]),
    ([], dict(max_rows=8, prefill_rows=8, mixed_prefill_rows=8), []),
    # a replay's stepwise rows: budget / 8 each (a model call per row, replays side by side), one at least
    ([V("a", 1), V("r", 40, True), V("q", 9, True), V("p", 30)],
     dict(max_rows=512, prefill_rows=256, mixed_prefill_rows=64), [(0, 1), (1, 8), (2, 8), (3, 30)]),
    ([V("r", 40, True)], dict(max_rows=512, prefill_rows=4, mixed_prefill_rows=64), [(0, 1)]),
    ([V("r", 3, True), V("p", 30)], dict(max_rows=512, prefill_rows=256, mixed_prefill_rows=64),
     [(0, 3), (1, 30)]),
    # a restart's rebuilds go first, shortest first, and take the whole prefill budget even
    # beside decode rows; a fresh prompt gets what they leave
    ([V("a", 1), V("p", 80), V("r", 90, rebuild=True), V("q", 40, rebuild=True)],
     dict(max_rows=512, prefill_rows=150, mixed_prefill_rows=64), [(0, 1), (3, 40), (2, 90), (1, 20)]),
    ([V("q", 120, rebuild=True), V("r", 90, rebuild=True)],
     dict(max_rows=512, prefill_rows=150, mixed_prefill_rows=64), [(1, 90), (0, 60)]),
    # beside decode rows a prompt that is no rebuild keeps the mixed bound
    ([V("a", 1), V("r", 10, rebuild=True), V("p", 500)],
     dict(max_rows=512, prefill_rows=150, mixed_prefill_rows=64), [(0, 1), (1, 10), (2, 64)]),
    # the row bound still holds
    ([V("a", 1), V("b", 1), V("r", 90, rebuild=True)], dict(max_rows=40, prefill_rows=150, mixed_prefill_rows=8),
     [(0, 1), (1, 1), (2, 38)]),
    # a stepwise replay is a rebuild too: beside decode rows it has the whole budget / 8
    ([V("a", 1), V("r", 40, True, True), V("q", 30, rebuild=True)],
     dict(max_rows=512, prefill_rows=150, mixed_prefill_rows=64), [(0, 1), (2, 30), (1, 18)]),
    ([V("a", 1), V("r", 40, True, True)], dict(max_rows=512, prefill_rows=160, mixed_prefill_rows=64),
     [(0, 1), (1, 20)]),
    # a rebuild that would leave a quarter of the budget or less for later runs whole
    ([V("q", 95, rebuild=True), V("r", 90, rebuild=True)],
     dict(max_rows=512, prefill_rows=150, mixed_prefill_rows=64), [(1, 90), (0, 95)]),
    ([V("q", 98, rebuild=True), V("r", 90, rebuild=True)],
     dict(max_rows=512, prefill_rows=150, mixed_prefill_rows=64), [(1, 90), (0, 60)]),
    ([V("q", 95, rebuild=True)], dict(max_rows=90, prefill_rows=80, mixed_prefill_rows=64), [(0, 80)]),  # max_rows holds
    # with hold_s, rows that are no rebuild wait while a rebuild's rows are queued, until they
    # have waited that long; a rebuild's last row (a kept hop's) is a rebuild too
    ([V("a", 1), V("p", 80), V("r", 90, rebuild=True), V("c", 1, rebuild=True)],
     dict(max_rows=512, prefill_rows=150, mixed_prefill_rows=64, hold_s=1.0), [(3, 1), (2, 90)]),
    ([V("a", 1, waited_s=1.5), V("b", 1, waited_s=0.5), V("p", 80, waited_s=2.0), V("r", 90, rebuild=True)],
     dict(max_rows=512, prefill_rows=150, mixed_prefill_rows=64, hold_s=1.0), [(0, 1), (3, 90), (2, 60)]),
    # only a rebuild with rows to compute holds the others back, not a kept hop's last row
    ([V("a", 1), V("c", 1, rebuild=True), V("p", 30)],
     dict(max_rows=512, prefill_rows=150, mixed_prefill_rows=64, hold_s=1.0), [(0, 1), (1, 1), (2, 30)]),
    # a prompt whose rows fit the budget goes before a longer one (a short request is not held
    # behind a long prompt's slices), oldest first in each group; the longer one keeps a quarter
    ([V("L", 500), V("s", 30)], dict(max_rows=512, prefill_rows=150, mixed_prefill_rows=64), [(1, 30), (0, 120)]),
    ([V("a", 1), V("L", 500), V("s", 30)], dict(max_rows=512, prefill_rows=150, mixed_prefill_rows=64),
     [(0, 1), (2, 30), (1, 34)]),
    ([V("L", 500), V("s", 140)], dict(max_rows=512, prefill_rows=150, mixed_prefill_rows=64), [(1, 113), (0, 37)]),
    ([V("L", 500), V("s", 60), V("t", 60)], dict(max_rows=512, prefill_rows=150, mixed_prefill_rows=64),
     [(1, 60), (2, 53), (0, 37)]),
    ([V("L", 500), V("M", 400), V("s", 10)], dict(max_rows=512, prefill_rows=150, mixed_prefill_rows=64),
     [(2, 10), (0, 140)]),
    # short ones that came before the longer one take their rows as oldest first gives them
    ([V("a", 1), V("s", 36), V("t", 20), V("L", 84)], dict(max_rows=512, prefill_rows=150, mixed_prefill_rows=64),
     [(0, 1), (1, 36), (2, 20), (3, 8)]),
    ([V("a", 1), V("s", 36), V("L", 84), V("t", 20)], dict(max_rows=512, prefill_rows=150, mixed_prefill_rows=64),
     [(0, 1), (1, 36), (3, 12), (2, 16)]),
    # short ones only (many users): oldest first, as before
    ([V("s", 30), V("t", 140)], dict(max_rows=512, prefill_rows=150, mixed_prefill_rows=64), [(0, 30), (1, 120)]),
    # rebuilds still go first, shortest first; short and long prompts share what they leave
    ([V("L", 500), V("s", 30), V("r", 90, rebuild=True), V("q", 40, rebuild=True)],
     dict(max_rows=512, prefill_rows=150, mixed_prefill_rows=64), [(3, 40), (2, 90), (1, 15), (0, 5)]),
    # a replay keeps its place and its rows
    ([V("L", 500), V("r", 40, True), V("s", 30)], dict(max_rows=512, prefill_rows=160, mixed_prefill_rows=64),
     [(2, 30), (1, 20), (0, 130)]),
    # beside decode rows a prompt already in its slices takes its time-bounded rows (mixed_rows);
    # a short one not priced yet runs whole, as before; without decode rows the bound is off
    ([V("a", 1), V("L", 500, mixed_rows=4), V("s", 30)], dict(max_rows=512, prefill_rows=150, mixed_prefill_rows=64),
     [(0, 1), (2, 30), (1, 4)]),
    ([V("a", 1), V("L", 500, mixed_rows=4)], dict(max_rows=512, prefill_rows=150, mixed_prefill_rows=64),
     [(0, 1), (1, 4)]),
    ([V("a", 1), V("L", 40, mixed_rows=10)], dict(max_rows=512, prefill_rows=150, mixed_prefill_rows=64),
     [(0, 1), (1, 10)]),
    ([V("a", 1), V("L", 500, mixed_rows=100)], dict(max_rows=512, prefill_rows=150, mixed_prefill_rows=64),
     [(0, 1), (1, 64)]),
    ([V("L", 500, mixed_rows=4)], dict(max_rows=512, prefill_rows=150, mixed_prefill_rows=64), [(0, 150)]),
    # and while sessions decode through the hop (their rows are on their way), prefill-only too
    ([V("L", 500, mixed_rows=4), V("s", 30)], dict(max_rows=512, prefill_rows=150, mixed_prefill_rows=64,
                                                   decoding=True), [(1, 30), (0, 4)]),
    # a rebuild beside decode rows keeps the whole budget
    ([V("a", 1), V("r", 90, rebuild=True, mixed_rows=4)], dict(max_rows=512, prefill_rows=150, mixed_prefill_rows=64),
     [(0, 1), (1, 90)]),
])
def test_plan_batch(pending: list[PendingView], kw: dict[str, int], plan: list[tuple[int, int]]) -> None:
    assert plan_batch(pending, **kw) == plan


def test_a_stream_of_short_prompts_never_starves_a_long_one() -> None:
    """Two new 60-row prompts every iteration (more than the budget of 150 rows): the short ones
    go first, and the long prompt still gets its quarter of every iteration until it is done."""
    queue: list[list] = [["L", 1000]]
    long_rows: list[int] = []
    for k in range(100):
        queue += [[f"s{k}", 60], [f"t{k}", 60]]
        plan = plan_batch([V(sid, rows) for sid, rows in queue], max_rows=512, prefill_rows=150,
                          mixed_prefill_rows=64)
        for i, n in plan:
            if queue[i][0] == "L":
                long_rows.append(n)
            queue[i][1] -= n
        queue = [w for w in queue if w[1] > 0]
        if not any(sid == "L" for sid, _ in queue):
            break
    assert sum(long_rows) == 1000
    assert min(long_rows[:-1]) >= 150 // 4
    assert len(long_rows) <= 1000 // (150 // 4) + 1


@pytest.mark.parametrize(("row_s", "rows"), [
    (0.0, None),  # not priced yet: the mixed bound
    (0.0005, 100),  # near a prompt's start: more than the mixed bound (64 rows) in 50 ms
    (0.004, 12),
    (0.023, 4),  # ~9k rows deep: at least 4
])
def test_mixed_rows_follow_the_prompts_latest_cost(row_s: float, rows: int | None) -> None:
    assert mixed_rows(row_s) == rows


def test_the_decode_speed_in_heartbeats_is_one_sessions() -> None:
    """A batched call of many sessions' rows yields more rows per second than one session's
    step: counted in, it made a busy replica look faster than an idle one, and routes piled
    onto it. Only single one-row calls measure decode; the rest is busy time."""
    meter = WorkMeter()
    meter.record(1, 0.010, decode=True)
    meter.record(8, 0.040, decode=True, parts=8)  # 200 rows/s, but one session's step took 40 ms
    meter.record(2, 0.015, decode=True, parts=2)
    meter.record(64, 0.100, decode=False)
    assert meter.decode_tps == pytest.approx(100.0)
    assert meter.prefill_tps == pytest.approx(640.0)
    assert meter.busy_s == pytest.approx(0.165)


def test_slice_rows_follow_the_measured_rate() -> None:
    assert slice_rows(400.0, 0.25) == 100
    assert slice_rows(10.0, 0.25) == 16  # never tiny slices
    assert slice_rows(0.0, 0.25) == 64  # not measured yet


@pytest.mark.parametrize("placement", ["inline", "thread"])
async def test_the_engine_is_built_and_called_on_one_thread(placement: str) -> None:
    runner = await EngineRunner.load(ThreadRecordingEngine, placement)  # type: ignore[arg-type]
    sched = HopScheduler(runner)
    engine = runner.engine
    assert runner.placement == placement
    await runner.open_session("s", None)
    await sched.run("s", 0, np.zeros(8, np.int32))  # a prefill chunk
    await sched.run("s", 8, np.zeros(1, np.int32))  # a decode step
    await runner.snapshot()
    await runner.close_session("s")
    await runner.close()
    threads = {t for _, t in engine.threads}
    assert len(threads) == 1
    # inline: the event loop's own thread; thread: a dedicated one, never the loop's
    assert (threading.get_ident() in threads) == (placement == "inline")
    assert {w for w, _ in engine.threads} >= {"init", "forward", "open", "close_session", "close"}


@pytest.mark.parametrize("placement", ["inline", "thread"])
async def test_rows_submitted_together_run_as_one_batch(placement: str) -> None:
    runner = await EngineRunner.load(ThreadRecordingEngine, placement)  # type: ignore[arg-type]
    sched = HopScheduler(runner)
    outs = await asyncio.gather(*(sched.run(f"s{i}", 0, np.zeros(1, np.int32)) for i in range(8)))
    assert runner.engine.batches == [[(f"s{i}", 0, 1) for i in range(8)]]
    assert [o.token.token_id for o, _, _ in outs] == [0] * 8
    assert sched.max_sessions_in_batch == 8
    assert runner.meter.decode_tokens == 0 and runner.meter.busy_s > 0  # not one session's step speed
    await runner.close()


@pytest.mark.parametrize(("last_call_s", "since_end_s", "wait"), [
    (0.5, 0.0, 0.005),  # a prefill slice just ended: the loop runs free 5 ms first
    (0.5, 0.002, 0.003),
    (0.5, 0.01, 0.0),  # the loop has had its turns already
    (0.02, 0.0, 0.0),  # a decode step or a mixed iteration: no breather (it would cost decode speed)
    (0.1, 0.0, 0.005),
])
def test_breather_wait(last_call_s: float, since_end_s: float, wait: float) -> None:
    assert breather_wait(last_call_s, since_end_s) == pytest.approx(wait)


class SlowEngine(ThreadRecordingEngine):
    """Every call takes 0.12 s: a long prefill slice, inline on the loop."""

    def forward_batch(self, parts: list[BatchPart]) -> list[object]:
        time.sleep(0.12)
        return super().forward_batch(parts)


async def test_the_loop_gets_its_turns_between_long_inline_slices() -> None:
    """An open directive or a connect needs several turns of the loop; between back-to-back
    inline prefill slices each turn carried a slice, so they took seconds (a seam link's
    connect timed out after 2 s on a composite node). Now the loop runs free after a long call."""
    runner = await EngineRunner.load(SlowEngine)
    sched = HopScheduler(runner, slice_s=0.1, breather_s=0.3)  # 10 rows at the reported 100 tok/s
    prefill = asyncio.ensure_future(sched.run("p", 0, np.zeros(30, np.int32), sample=False))
    calls_seen: list[int] = []

    async def four_turns() -> None:  # what reading a directive or connecting costs the loop
        for _ in range(4):
            await asyncio.sleep(0)
        calls_seen.append(len(runner.engine.batches))

    await asyncio.gather(four_turns(), prefill)
    assert calls_seen == [1], "the loop's turns each waited for a prefill slice"
    assert len(runner.engine.batches) >= 2 and prefill.result()[0].hidden.shape[0] == 30
    await runner.close()


async def test_a_long_prefill_runs_in_slices_mixed_with_decode_rows() -> None:
    runner = await EngineRunner.load(ThreadRecordingEngine)
    engine = runner.engine
    sched = HopScheduler(runner, mixed_prefill_rows=8, slice_s=0.2)  # alone: 20 rows per slice (100 tok/s)
    engine.positions.update({"d1": 5, "d2": 9})
    prefill = asyncio.ensure_future(sched.run("p", 0, np.zeros(40, np.int32), sample=False))
    tokens: list[int] = []

    async def decode(sid: str, position: int, steps: int) -> None:
        for k in range(steps):
            out, _, _ = await sched.run(sid, position + k, np.zeros(1, np.int32))
            tokens.append(out.token.token_id)

    await asyncio.gather(decode("d1", 5, 3), decode("d2", 9, 3))
    out, _, _ = await prefill
    assert out.hidden is not None and out.hidden[:, 0].tolist() == list(range(40))  # slices joined in order
    assert out.token is None  # sample=False: a prefill chunk that only fills the cache
    # every iteration while the prompt was prefilling carried both decode rows and 8 prefill rows
    assert engine.batches[:3] == [[("d1", 5 + k, 1), ("d2", 9 + k, 1), ("p", 8 * k, 8)] for k in range(3)]
    assert engine.batches[3] == [("p", 24, 16)]  # decode done: the prefill-only budget (capped by what is left)
    assert sorted(tokens) == [5, 6, 7, 9, 10, 11]
    await runner.close()


async def test_beside_decode_rows_a_prompt_in_its_slices_takes_rows_by_their_cost(monkeypatch) -> None:
    """A prompt's first slice beside decode rows is the mixed bound (64 rows); once its rows are
    priced (here 20 ms each, as ~9k rows deep) it takes what fits 50 ms, 4 rows at least."""
    runner = await EngineRunner.load(ThreadRecordingEngine)
    engine = runner.engine
    call = runner.forward_batch_now

    def priced(parts: list[BatchPart]):
        results, _ = call(parts)
        return results, 0.02 * sum(len(p.rows) for p in parts)

    monkeypatch.setattr(runner, "forward_batch_now", priced)
    sched = HopScheduler(runner, slice_s=0.2, breather_s=0.0)
    engine.positions["d"] = 5
    prefill = asyncio.ensure_future(sched.run("p", 0, np.zeros(100, np.int32), sample=False))
    for k in range(3):
        await sched.run("d", 5 + k, np.zeros(1, np.int32))
    await prefill
    assert engine.batches[:3] == [[("d", 5, 1), ("p", 0, 64)], [("d", 6, 1), ("p", 64, 4)],
                                  [("d", 7, 1), ("p", 68, 4)]]
    await runner.close()


async def test_a_rejected_part_fails_only_its_own_work() -> None:
    runner = await EngineRunner.load(ThreadRecordingEngine)
    sched = HopScheduler(runner)
    results = await asyncio.gather(sched.run("good", 0, np.zeros(1, np.int32)),
                                   sched.run("bad", 7, np.zeros(1, np.int32)), return_exceptions=True)
    assert isinstance(results[1], PositionMismatchError)
    assert not isinstance(results[0], BaseException) and results[0][0].token.token_id == 0
    assert not sched.queue
    await runner.close()


async def test_a_cancelled_wait_leaves_the_queue() -> None:
    runner = await EngineRunner.load(ThreadRecordingEngine, "thread")  # type: ignore[arg-type]
    sched = HopScheduler(runner)
    first = asyncio.ensure_future(sched.run("a", 0, np.zeros(1, np.int32)))
    second = asyncio.ensure_future(sched.run("b", 0, np.zeros(1, np.int32)))
    await asyncio.sleep(0)
    second.cancel()
    await asyncio.gather(first, second, return_exceptions=True)
    for _ in range(100):
        if not sched.queue:
            break
        await asyncio.sleep(0.01)
    assert not sched.queue, "the cancelled Work stayed queued"
    await runner.close()


def test_a_work_counts_its_remaining_rows() -> None:
    w = Work("s", 0, np.zeros(5, np.int32), lambda _: None)
    w.offset = 3
    assert w.remaining == 2
async def test_an_unknown_placement_is_refused() -> None:
    with pytest.raises(ValueError, match="placement"):
        await EngineRunner.load(ThreadRecordingEngine, "gpu")  # type: ignore[arg-type]


async def test_a_failing_load_raises_and_leaves_no_thread_behind() -> None:
    before = {t.name for t in threading.enumerate()}

    def broken() -> ThreadRecordingEngine:
        raise RuntimeError("no such model")

    for placement in ("inline", "thread"):
        with pytest.raises(RuntimeError, match="no such model"):
            await EngineRunner.load(broken, placement)
    for t in threading.enumerate():
        if t.name.startswith("shard-engine") and t.name not in before:
            t.join(timeout=2)
            assert not t.is_alive()


@pytest.mark.parametrize(("runs", "calls"), [
    # decode rows together in slot order, each prefill chunk in calls of its own
    ([(1, 5), (40, 2), (1, 1), (1, 3)], [[(2, 0, 1), (3, 0, 1), (0, 0, 1)], [(1, 0, 40)]]),
    ([(1, 5), (1000, 2)], [[(0, 0, 1)], [(1, 0, 512)], [(1, 512, 488)]]),
    ([(3, 0)], [[(0, 0, 3)]]),
    ([], []),
])
def test_batch_calls(runs: list[tuple[int, int]], calls: list[list[tuple[int, int, int]]]) -> None:
    from nodes.llama_engine import batch_calls

    assert batch_calls(runs, 512) == calls


def test_a_stepwise_part_runs_one_row_per_call() -> None:
    from nodes.llama_engine import batch_calls

    assert batch_calls([(1, 5), (3, 2), (2, 1)], 512, [False, True, False]) == [
        [(1, 0, 1), (0, 0, 1)], [(1, 1, 1)], [(1, 2, 1)], [(2, 0, 2)]]
    # two replays in waves: row w of each in the w-th call, slot order, decode rows in the first
    assert batch_calls([(2, 7), (1, 4), (3, 1)], 512, [True, False, True]) == [
        [(2, 0, 1), (1, 0, 1), (0, 0, 1)], [(2, 1, 1), (0, 1, 1)], [(2, 2, 1)]]


@pytest.mark.parametrize(("token", "step", "gone", "open_", "more"), [
    (5, 0, False, True, True),
    (5, 3, False, True, False),  # the last of 4 steps
    (2, 0, False, True, False),  # a stop id
    (5, 0, True, True, False),  # the caller went away
    (5, 0, False, False, False),  # the session ended
])
def test_a_decode_run_continues_only_while_nothing_stops_it(token: int, step: int, gone: bool, open_: bool,
                                                           more: bool) -> None:
    from nodes.server.session import run_continues

    assert run_continues(token, step, 4, frozenset({2}), caller_gone=gone, session_open=open_) is more



@pytest.mark.parametrize(("remaining", "budget", "rows"), [
    (30, 64, 30), (65, 64, 63), (66, 64, 64), (2, 1, 2), (3, 1, 1), (5, 2, 2), (1, 64, 1), (3, 2, 1),
])
def test_a_prefill_slice_never_leaves_the_last_row_alone(remaining: int, budget: int, rows: int) -> None:
    from nodes.server.scheduler import prefill_slice

    assert prefill_slice(remaining, budget) == rows
    assert rows == remaining or remaining - rows >= 2


def test_the_last_call_of_a_long_prefill_has_two_rows_at_least() -> None:
    from nodes.llama_engine import batch_calls

    assert batch_calls([(513, 0)], 512) == [[(0, 0, 511)], [(0, 511, 2)]]
    assert batch_calls([(514, 0)], 512) == [[(0, 0, 512)], [(0, 512, 2)]]


@pytest.mark.parametrize(("phase", "epoch", "moved", "rebuild"), [
    ("prefill", 1, False, False), ("prefill", 2, False, True), ("prefill", 3, False, True),
    ("decode", 2, False, False),
    ("prefill", 2, True, False),  # a move's route: the stream lost nothing, its prefill waits its turn
])
def test_a_frame_rebuilds_when_it_prefills_a_restarted_route(phase: str, epoch: int, moved: bool,
                                                              rebuild: bool) -> None:
    from nodes.server.session import HopSession
    from schemas.frames import FrameHeader

    h = FrameHeader(session_id="s", route_id="r", epoch=epoch, hop=0, seq=0, phase=phase, position=0,
                    n_rows=1, dtype="f32", width=1)
    assert HopSession.rebuilds(h, moved=moved) is rebuild


class OverlapEngine(ThreadRecordingEngine):
    """Notes whether a call began while another engine's call was running (shared `busy`)."""

    def __init__(self, busy: list[int], overlaps: list[int]) -> None:
        super().__init__()
        self.busy, self.overlaps = busy, overlaps

    def forward_batch(self, parts: list[BatchPart]) -> list[object]:
        self.overlaps.append(self.busy[0])
        self.busy[0] += 1
        time.sleep(0.005)
        self.busy[0] -= 1
        return super().forward_batch(parts)


async def test_a_composite_nodes_shards_call_their_engines_on_one_thread() -> None:
    """The thread placement with a shared engine thread (a composite node): two shards' engines
    are built and called on that one thread, so their model calls never overlap, and closing
    one shard's runner leaves the thread to the other."""
    from concurrent.futures import ThreadPoolExecutor

    busy, overlaps = [0], []
    pool = ThreadPoolExecutor(max_workers=1)
    try:
        runners = [await EngineRunner.load(lambda: OverlapEngine(busy, overlaps), "thread", pool)  # type: ignore[arg-type,return-value]
                   for _ in range(2)]
        turns = EngineTurns()
        scheds = [HopScheduler(r, turns=turns) for r in runners]
        await asyncio.gather(*(s.run(f"{who}{k}", 0, np.zeros(rows, np.int32), sample=rows == 1)
                               for k, s in enumerate(scheds) for who, rows in (("s", 1), ("t", 3))))
        threads = {t for r in runners for _, t in r.engine.threads}
        assert len(threads) == 1 and threading.get_ident() not in threads
        assert len(overlaps) >= 2 and set(overlaps) == {0}
        await runners[0].close()
        await scheds[1].run("after", 0, np.zeros(1, np.int32))  # the shared thread still serves
        await runners[1].close()
    finally:
        pool.shutdown(wait=True)


async def test_a_short_prompt_is_answered_before_a_long_one_it_came_after(model_path, shard_cache,
                                                                          monkeypatch) -> None:
    """Real llama.cpp (the bundled model's first shard): a short prompt submitted while a long
    one is in its slices completes first, and the long one still completes with all its rows."""
    from nodes.llama_engine import LlamaShardEngine
    from tests.fixtures.model import TEST_THREADS

    runner = await EngineRunner.load(lambda: LlamaShardEngine(
        model_path, 0, 15, n_ctx=2048, max_sessions=2, n_threads=TEST_THREADS, measure=False))
    try:
        sched = HopScheduler(runner, max_rows=128, slice_s=None)  # 128-row slices: the long prompt takes 12
        for sid in ("long", "short"):
            runner.engine.open_session(sid)
        ids = (np.arange(1500, dtype=np.int32) * 7) % 5000 + 100
        finished: list[str] = []
        sliced = asyncio.Event()  # the long prompt is in its slices
        call = runner.forward_batch_now

        def counted(parts: list[BatchPart]):
            out = call(parts)
            if sched.iterations >= 1:
                sliced.set()
            return out

        monkeypatch.setattr(runner, "forward_batch_now", counted)

        async def prompt(sid: str, rows: np.ndarray) -> ShardOutput:
            out, _, _ = await sched.run(sid, 0, rows, sample=False)
            finished.append(sid)
            return out

        long_task = asyncio.ensure_future(prompt("long", ids))
        await sliced.wait()
        assert not long_task.done()
        short = await prompt("short", ids[:20])
        long = await long_task
        assert finished == ["short", "long"]
        assert short.hidden is not None and short.hidden.shape[0] == 20
        assert long.hidden is not None and long.hidden.shape[0] == 1500
    finally:
        await runner.close()
