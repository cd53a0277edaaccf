"""EngineRunner: one worker thread per ShardEngine, so blocking model calls never stall the loop.

The engine is also built on that thread (EngineRunner.load). llama.cpp's CPU backend runs on
OpenMP, and libgomp keeps one worker pool per thread that ever started a parallel region; once
a process holds more pool threads than it has cores, every barrier of every graph falls back to
~100 spins and then a futex sleep. A node that loaded (and self-measured) its shard on one thread
and decoded on another paid that on each of the ~400 barriers of a decode step: about a third
more compute per hop on a 2-core machine (docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from nodes.engine import ShardEngine, ShardOutput
from schemas.sampling import SamplingParams


@dataclass(slots=True)
class WorkMeter:
    """Rolling throughput and busy time of the engine, for heartbeats."""

    busy_s: float = 0.0
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    decode_tokens: int = 0
    decode_s: float = 0.0
    queued: int = 0

    def record(self, n_rows: int, seconds: float) -> None:
        """Account one forward call of `n_rows` rows that took `seconds`."""
        self.busy_s += seconds
        if n_rows == 1:
            self.decode_tokens += 1
            self.decode_s += seconds
        else:
            self.prefill_tokens += n_rows
            self.prefill_s += seconds

    @property
    def decode_tps(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s else 0.0

    @property
    def prefill_tps(self) -> float:
        return self.prefill_tokens / self.prefill_s if self.prefill_s else 0.0


class EngineRunner:
    """Serializes every call into one engine on a single worker thread."""

    def __init__(self, engine: ShardEngine, pool: ThreadPoolExecutor) -> None:
        """Use EngineRunner.load: `pool` must be the single thread that built `engine`."""
        self.engine = engine
        self.meter = WorkMeter()
        self._pool = pool

    @classmethod
    async def load(cls, factory: Callable[[], ShardEngine]) -> EngineRunner:
        """Build the engine on the runner's thread, the only thread that ever calls into it."""
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-engine")
        try:
            engine = await asyncio.get_running_loop().run_in_executor(pool, factory)
        except BaseException:
            pool.shutdown(wait=False)
            raise
        return cls(engine, pool)

    async def _call(self, fn, *args, **kwargs):
        loop = asyncio.get_running_loop()
        self.meter.queued += 1
        try:
            return await loop.run_in_executor(self._pool, lambda: fn(*args, **kwargs))
        finally:
            self.meter.queued -= 1

    async def open_session(self, session_id: str, sampling: SamplingParams | None) -> None:
        """Allocate the session's Hot KV State."""
        await self._call(self.engine.open_session, session_id, sampling)

    async def close_session(self, session_id: str) -> None:
        """Release the session's Hot KV State (unknown ids are ignored)."""
        await self._call(self._close_quietly, session_id)

    def _close_quietly(self, session_id: str) -> None:
        if session_id in self.engine.sessions():
            self.engine.close_session(session_id)

    async def forward(
        self, session_id: str, position: int, *, token_ids: np.ndarray | None, hidden: np.ndarray | None
    ) -> tuple[ShardOutput, float, int]:
        """Run one frame's rows; return the output, seconds in the model and the cache bytes."""

        def run() -> tuple[ShardOutput, float, int]:
            t0 = time.perf_counter()
            out = self.engine.forward(session_id, position, token_ids=token_ids, hidden=hidden)
            seconds = time.perf_counter() - t0
            return out, seconds, self.engine.cache_bytes(session_id)

        out, seconds, cache = await self._call(run)
        n = len(token_ids) if token_ids is not None else len(hidden)  # type: ignore[arg-type]
        self.meter.record(n, seconds)
        return out, seconds, cache

    async def cache_bytes(self, session_id: str) -> int:
        """Bytes of Hot KV State the session holds (0 when it has none)."""
        return await self._call(self._cache_bytes, session_id)

    def _cache_bytes(self, session_id: str) -> int:
        if session_id not in self.engine.sessions():
            return 0
        return self.engine.cache_bytes(session_id)

    async def snapshot(self) -> dict[str, tuple[int, int]]:
        """Every engine session with its (position, cache bytes), read on the worker thread."""

        def read() -> dict[str, tuple[int, int]]:
            e = self.engine
            return {s: (e.position(s), e.cache_bytes(s)) for s in e.sessions()}

        return await self._call(read)

    async def close(self) -> None:
        """Free the engine and stop the worker thread."""
        await self._call(self.engine.close)
        self._pool.shutdown(wait=True)
