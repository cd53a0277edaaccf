"""EngineRunner: the engine is built and called on one thread only (libgomp keeps a pool per
calling thread; a second pool on a small machine makes every barrier sleep).

The engine here records threads (the test is about which thread calls the engine, not about
the model; the real llama.cpp engine runs through the same runner in the route tests)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from nodes.engine import ShardOutput
from nodes.server.runner import EngineRunner


class ThreadRecordingEngine:
    """Notes the thread of construction and of every call."""

    def __init__(self) -> None:
        self.threads = {("init", threading.get_ident())}

    def _note(self, what: str) -> None:
        self.threads.add((what, threading.get_ident()))

    def forward(self, session_id: str, position: int, *, token_ids=None, hidden=None) -> ShardOutput:
        self._note("forward")
        rows = token_ids if token_ids is not None else hidden
        return ShardOutput(hidden=np.zeros((len(rows), 4), np.float32))

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


async def test_the_engine_is_built_and_called_on_one_thread_that_is_not_the_loop() -> None:
    runner = await EngineRunner.load(ThreadRecordingEngine)
    engine = runner.engine
    await runner.open_session("s", None)
    await runner.forward("s", 0, token_ids=np.zeros(8, np.int32), hidden=None)  # a prefill chunk
    await runner.forward("s", 8, token_ids=np.zeros(1, np.int32), hidden=None)  # a decode step
    await runner.snapshot()
    await runner.close_session("s")
    await runner.close()
    threads = {t for _, t in engine.threads}
    assert len(threads) == 1
    assert threading.get_ident() not in threads
    assert {w for w, _ in engine.threads} >= {"init", "forward", "open", "close_session", "close"}


async def test_a_failing_load_raises_and_leaves_no_thread_behind() -> None:
    before = {t.name for t in threading.enumerate()}

    def broken() -> ThreadRecordingEngine:
        raise RuntimeError("no such model")

    with pytest.raises(RuntimeError, match="no such model"):
        await EngineRunner.load(broken)
    for t in threading.enumerate():
        if t.name.startswith("shard-engine") and t.name not in before:
            t.join(timeout=2)
            assert not t.is_alive()
