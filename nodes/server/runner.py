"""EngineRunner: the one place a node calls its ShardEngine, always from one and the same thread.

llama.cpp's CPU backend runs on OpenMP, and libgomp keeps one worker pool per thread that ever
started a parallel region; once a process holds more pool threads than it has cores, every
barrier of every graph falls back to ~100 spins and then a futex sleep. A node that loaded (and
self-measured) its shard on one thread and decoded on another paid that on each of the ~400
barriers of a decode step: about a third more compute per hop on a 2-core machine. So the
engine is built on the thread that will call it, and only that thread ever calls it.

Two placements (docs/activation-protocol.md, "Threads on a shared box"):
- inline (the default): the engine lives on the event loop's thread and each call runs in
  place, so a frame never crosses threads (each crossing costs a thread wake-up both ways).
  The hop scheduler (nodes.server.scheduler) bounds how long one call holds the loop.
- thread: the engine lives on a dedicated "shard-engine" thread and the loop stays free
  during model calls (health checks, listings and bus traffic answer immediately).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

from nodes.engine import BatchPart, PartResult, ShardEngine, ShardOutput
from schemas.sampling import SamplingParams


@dataclass(slots=True)
class WorkMeter:
    """Rolling throughput and busy time of the engine, for heartbeats.

    The decode speed is one session's: only calls of a single one-row part count. A batched
    call of k sessions' rows yields more rows per second, and reporting that made a busy
    replica look several times faster than an idle one, so the tracker's route cost (which adds
    the sessions a node already holds on top of this speed) sent every new session to the busy
    one (tests/test_restart.py's spread test saw 8 of 8 on one tail)."""

    busy_s: float = 0.0
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    decode_tokens: int = 0
    decode_s: float = 0.0
    queued: int = 0

    def record(self, n_rows: int, seconds: float, *, decode: bool, parts: int = 1) -> None:
        """Account one engine call of `n_rows` rows over `parts` sessions that took `seconds`;
        `decode`: every part of it was a decode step."""
        self.busy_s += seconds
        if not decode:
            self.prefill_tokens += n_rows
            self.prefill_s += seconds
        elif n_rows == 1 and parts == 1:
            self.decode_tokens += 1
            self.decode_s += seconds

    @property
    def decode_tps(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s else 0.0

    @property
    def prefill_tps(self) -> float:
        return self.prefill_tokens / self.prefill_s if self.prefill_s else 0.0


EnginePlacement = Literal["inline", "thread"]
PLACEMENTS: tuple[EnginePlacement, ...] = ("inline", "thread")


class EngineRunner:
    """Serializes every call into one engine, on the thread that built it."""

    def __init__(self, engine: ShardEngine, pool: ThreadPoolExecutor | None, *, owns_pool: bool = True) -> None:
        """Use EngineRunner.load. `pool` is the single thread that built `engine`, or None
        when the engine was built on (and is called from) the event loop's thread. A composite
        node's shards share one such thread (`owns_pool` False: the node shuts it down)."""
        self.engine = engine
        self.meter = WorkMeter()
        self._pool = pool
        self._owns_pool = owns_pool

    @property
    def placement(self) -> EnginePlacement:
        return "inline" if self._pool is None else "thread"

    @classmethod
    async def load(cls, factory: Callable[[], ShardEngine], placement: EnginePlacement = "inline",
                   shared: ThreadPoolExecutor | None = None) -> EngineRunner:
        """Build the engine on the thread that will make every call into it (`shared`: the
        composite node's one engine thread, for the thread placement)."""
        if placement == "inline":
            return cls(factory(), None)
        if placement != "thread":
            raise ValueError(f"engine placement must be one of {PLACEMENTS}, got {placement!r}")
        pool = shared or ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-engine")
        try:
            engine = await asyncio.get_running_loop().run_in_executor(pool, factory)
        except BaseException:
            if shared is None:
                pool.shutdown(wait=False)
            raise
        return cls(engine, pool, owns_pool=shared is None)

    async def _call(self, fn, *args, **kwargs):
        self.meter.queued += 1
        try:
            if self._pool is None:
                return fn(*args, **kwargs)
            return await asyncio.get_running_loop().run_in_executor(self._pool, lambda: fn(*args, **kwargs))
        finally:
            self.meter.queued -= 1

    async def open_session(self, session_id: str, sampling: SamplingParams | None) -> None:
        """Allocate the session's Hot KV State."""
        await self._call(self.engine.open_session, session_id, sampling)

    async def adopt_session(self, old_id: str, new_id: str, keep: int, sampling: SamplingParams | None) -> None:
        """Hand session `old_id`'s Hot KV State, cut to `keep` positions, to `new_id`."""
        await self._call(self.engine.adopt_session, old_id, new_id, keep, sampling)

    async def close_session(self, session_id: str) -> None:
        """Release the session's Hot KV State (unknown ids are ignored)."""
        await self._call(self._close_quietly, session_id)

    def _close_quietly(self, session_id: str) -> None:
        if session_id in self.engine.sessions():
            self.engine.close_session(session_id)

    def forward_batch_now(self, parts: list[BatchPart]) -> tuple[list[PartResult], float]:
        """One batched engine call, in place (inline placement): the results and the seconds.
        """
        assert self._pool is None, "forward_batch_now is for the inline placement"
        return self._timed_batch(parts)

    async def forward_batch(self, parts: list[BatchPart]) -> tuple[list[PartResult], float]:
        """One batched engine call on the engine's thread: the results and the seconds."""
        return await self._call(self._timed_batch, parts)

    def _timed_batch(self, parts: list[BatchPart]) -> tuple[list[PartResult], float]:
        t0 = time.perf_counter()
        results = self.engine.forward_batch(parts)
        seconds = time.perf_counter() - t0
        computed = sum(len(p.rows) for p in parts) - sum(r.reused for r in results if isinstance(r, ShardOutput))
        self.meter.record(computed, seconds, parts=len(parts),
                          decode=all(len(p.rows) == 1 or p.stepwise for p in parts))  # a replay costs like decode
        return results, seconds

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

    def shared_prefix_stats(self) -> dict[str, int]:
        """The engine's shared-prefix counters (nodes/shared_prefix.py); zeros for a backend
        without shared prefixes (torch)."""
        read = getattr(self.engine, "shared_prefix_stats", None)
        return read() if read is not None else {"hits": 0, "rows_reused": 0}

    async def close(self) -> None:
        """Free the engine (and stop its thread, if it has one)."""
        await self._call(self.engine.close)
        if self._pool is not None and self._owns_pool:
            self._pool.shutdown(wait=True)
