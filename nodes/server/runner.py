"""EngineRunner: the one place a node calls its ShardEngine, always from one and the same thread.

llama.cpp's CPU backend runs on OpenMP, and libgomp keeps one worker pool per thread that ever
started a parallel region; once a process holds more pool threads than it has cores, every
barrier of every graph falls back to ~100 spins and then a futex sleep. A node that loaded (and
self-measured) its shard on one thread and decoded on another paid that on each of the ~400
barriers of a decode step: about a third more compute per hop on a 2-core machine. So the
engine is built on the thread that will call it, and only that thread ever calls it.

Two placements (docs/activation-protocol.md, "Threads on a shared box"):
- inline (the default): the engine lives on the event loop's thread and each call runs in
  place. A frame never crosses threads; on the 2-core reference VM each crossing costs
  ~0.17 ms out and ~0.25 ms back (waking a sleeping thread), ~0.4 ms per hop per decode step.
  A long prefill frame runs in equal slices of at most about INLINE_SLICE_S each, with the loop let through
  in between, so heartbeats (a node expires after 3 s of silence), credit polls and other
  sessions' decode steps wait at most one slice.
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


INLINE_SLICE_S = 0.5  # longest one inline model call should hold the event loop (heartbeats: 1 s, expiry: 3 s)
SLICE_YIELD_S = 0.001  # between slices: a timer, so everything already runnable (and what it wakes) goes first
MIN_SLICE_ROWS = 16
UNMEASURED_SLICE_ROWS = 64


def inline_slice_rows(prefill_tps: float, slice_s: float) -> int:
    """Rows an engine prefilling `prefill_tps` tokens/s runs in about `slice_s` (at least 16)."""
    if prefill_tps <= 0:
        return UNMEASURED_SLICE_ROWS
    return max(MIN_SLICE_ROWS, int(prefill_tps * slice_s))


def join_outputs(parts: list[ShardOutput]) -> ShardOutput:
    """One frame's output from the outputs of its consecutive slices."""
    if len(parts) == 1:
        return parts[0]
    last = parts[-1]
    if last.hidden is None:
        return last  # a tail: the token (and logits) of the frame's last row
    return ShardOutput(hidden=np.concatenate([p.hidden for p in parts if p.hidden is not None]))


EnginePlacement = Literal["inline", "thread"]
PLACEMENTS: tuple[EnginePlacement, ...] = ("inline", "thread")


class EngineRunner:
    """Serializes every call into one engine, on the thread that built it."""

    def __init__(self, engine: ShardEngine, pool: ThreadPoolExecutor | None) -> None:
        """Use EngineRunner.load. `pool` is the single thread that built `engine`, or None
        when the engine was built on (and is called from) the event loop's thread."""
        self.engine = engine
        self.meter = WorkMeter()
        self.slice_s: float | None = INLINE_SLICE_S  # None: never slice
        self._pool = pool

    @property
    def placement(self) -> EnginePlacement:
        return "inline" if self._pool is None else "thread"

    @classmethod
    async def load(cls, factory: Callable[[], ShardEngine], placement: EnginePlacement = "inline") -> EngineRunner:
        """Build the engine on the thread that will make every call into it."""
        if placement == "inline":
            return cls(factory(), None)
        if placement != "thread":
            raise ValueError(f"engine placement must be one of {PLACEMENTS}, got {placement!r}")
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-engine")
        try:
            engine = await asyncio.get_running_loop().run_in_executor(pool, factory)
        except BaseException:
            pool.shutdown(wait=False)
            raise
        return cls(engine, pool)

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

    async def close_session(self, session_id: str) -> None:
        """Release the session's Hot KV State (unknown ids are ignored)."""
        await self._call(self._close_quietly, session_id)

    def _close_quietly(self, session_id: str) -> None:
        if session_id in self.engine.sessions():
            self.engine.close_session(session_id)

    async def forward(
        self, session_id: str, position: int, *, token_ids: np.ndarray | None, hidden: np.ndarray | None
    ) -> tuple[ShardOutput, float, int]:
        """Run one frame's rows; return the output, seconds in the model and the cache bytes.

        Inline, a frame longer than one slice runs as consecutive calls of at most
        `slice_rows(slice_s)` rows with the loop let through in between (heartbeats, credit polls,
        other sessions' decode steps), so no single call holds the loop much longer than
        `slice_s`."""
        rows = token_ids if token_ids is not None else hidden
        assert rows is not None
        n = len(rows)
        sliced = self._pool is None and self.slice_s is not None and n > MIN_SLICE_ROWS
        step = self.slice_rows(self.slice_s) if sliced else n
        if step >= n:  # every decode step, and most prefill chunks
            out, seconds, cache = await self._call(self._run_forward, session_id, position, token_ids, hidden)
            self.meter.record(n, seconds)
            return out, seconds, cache
        parts: list[ShardOutput] = []
        seconds = 0.0
        cache = 0
        step = -(-n // -(-n // step))  # equal slices: 128 rows at most 90 per slice -> 64 + 64
        for lo in range(0, n, step):
            part = rows[lo:lo + step]
            if lo:
                await asyncio.sleep(SLICE_YIELD_S)
            out, secs, cache = await self._call(
                self._run_forward, session_id, position + lo,
                part if token_ids is not None else None, part if hidden is not None else None)
            parts.append(out)
            seconds += secs
        self.meter.record(n, seconds)
        return join_outputs(parts), seconds, cache

    def can_run_now(self, n_rows: int) -> bool:
        """Whether forward_now may run a call of `n_rows`: an inline engine, no slicing."""
        return self._pool is None and n_rows <= MIN_SLICE_ROWS

    def forward_now(self, session_id: str, position: int, *, token_ids: np.ndarray | None,
                    hidden: np.ndarray | None) -> tuple[ShardOutput, float, int]:
        """forward() for a call can_run_now allows, without an await (a decode step run in
        the callback that admitted it)."""
        rows = token_ids if token_ids is not None else hidden
        assert rows is not None and self.can_run_now(len(rows))
        out, seconds, cache = self._run_forward(session_id, position, token_ids, hidden)
        self.meter.record(len(rows), seconds)
        return out, seconds, cache

    def _run_forward(self, session_id: str, position: int, token_ids: np.ndarray | None,
                     hidden: np.ndarray | None) -> tuple[ShardOutput, float, int]:
        t0 = time.perf_counter()
        out = self.engine.forward(session_id, position, token_ids=token_ids, hidden=hidden)
        seconds = time.perf_counter() - t0
        return out, seconds, self.engine.cache_bytes(session_id)

    def slice_rows(self, slice_s: float) -> int:
        """Rows per inline model call: what the engine prefills in about `slice_s` seconds."""
        rate = self.meter.prefill_tps or self.engine.capability().prefill_tokens_per_second
        return inline_slice_rows(rate, slice_s)

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
        """Free the engine (and stop its thread, if it has one)."""
        await self._call(self.engine.close)
        if self._pool is not None:
            self._pool.shutdown(wait=True)
