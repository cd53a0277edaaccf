"""EngineRunner: the engine is built and called on one thread only (libgomp keeps a pool per
calling thread; a second pool on a small machine makes every barrier sleep), inline on the
event loop's thread by default or on a dedicated thread.

The engine here records threads (the test is about which thread calls the engine, not about
the model; the real llama.cpp engine runs through the same runner in the route tests)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import pytest

from nodes.engine import ShardOutput, TokenChoice
from nodes.server.runner import EngineRunner, inline_slice_rows, join_outputs


class ThreadRecordingEngine:
    """Notes the thread of construction and of every call."""

    def __init__(self) -> None:
        self.threads = {("init", threading.get_ident())}
        self.calls: list[tuple[int, int]] = []

    def _note(self, what: str) -> None:
        self.threads.add((what, threading.get_ident()))

    def forward(self, session_id: str, position: int, *, token_ids=None, hidden=None) -> ShardOutput:
        self._note("forward")
        rows = token_ids if token_ids is not None else hidden
        self.calls.append((position, len(rows)))
        # each output row carries its position, so a joined output shows its order
        return ShardOutput(hidden=np.arange(position, position + len(rows), dtype=np.float32)[:, None].repeat(4, 1))

    def capability(self) -> SimpleNamespace:
        return SimpleNamespace(prefill_tokens_per_second=100.0)

    def open_session(self, session_id: str, sampling=None) -> None:
        self._note("open")

    def cache_bytes(self, session_id: str) -> int:
        self._note("cache_bytes")
        return 0

    def position(self, session_id: str) -> int:
        return 0

    def sessions(self) -> list[str]:
        self._note("sessions")
        return ["s"]

    def close_session(self, session_id: str) -> None:
        self._note("close_session")

    def close(self) -> None:
        self._note("close")


@pytest.mark.parametrize("placement", ["inline", "thread"])
async def test_the_engine_is_built_and_called_on_one_thread(placement: str) -> None:
    runner = await EngineRunner.load(ThreadRecordingEngine, placement)  # type: ignore[arg-type]
    engine = runner.engine
    assert runner.placement == placement
    await runner.open_session("s", None)
    await runner.forward("s", 0, token_ids=np.zeros(8, np.int32), hidden=None)  # a prefill chunk
    await runner.forward("s", 8, token_ids=np.zeros(1, np.int32), hidden=None)  # a decode step
    await runner.snapshot()
    await runner.close_session("s")
    await runner.close()
    threads = {t for _, t in engine.threads}
    assert len(threads) == 1
    # inline: the event loop's own thread; thread: a dedicated one, never the loop's
    assert (threading.get_ident() in threads) == (placement == "inline")
    assert {w for w, _ in engine.threads} >= {"init", "forward", "open", "close_session", "close"}


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


async def test_a_long_inline_frame_runs_in_slices_and_joins_in_order() -> None:
    runner = await EngineRunner.load(ThreadRecordingEngine)
    engine = runner.engine
    runner.slice_s = 0.2  # the engine says 100 tok/s: at most 20 rows per slice, in equal slices
    out, _, _ = await runner.forward("s", 30, token_ids=np.zeros(50, np.int32), hidden=None)
    assert engine.calls == [(30, 17), (47, 17), (64, 16)]
    assert out.hidden is not None and out.hidden[:, 0].tolist() == list(range(30, 80))
    engine.calls.clear()
    await runner.forward("s", 80, token_ids=np.zeros(1, np.int32), hidden=None)  # a decode step: one call
    assert engine.calls == [(80, 1)]
    assert runner.meter.prefill_tokens == 50 and runner.meter.decode_tokens == 1
    await runner.close()


def test_slice_rows_follow_the_measured_rate_and_a_tail_keeps_its_last_token() -> None:
    assert inline_slice_rows(400.0, 0.25) == 100
    assert inline_slice_rows(10.0, 0.25) == 16  # never tiny slices
    assert inline_slice_rows(0.0, 0.25) == 64  # not measured yet
    first, last = ShardOutput(token=TokenChoice(token_id=1)), ShardOutput(token=TokenChoice(token_id=2))
    assert join_outputs([first, last]) is last
