"""Time per output token from token batches (pure; time is passed in).

The route's head sends decoded tokens in batches (at most every `flush_ms`), so arrival times
at the gateway say when a batch left the head, not when each token was generated: tokens of
one batch arrive microseconds apart. Until results carry a per-token generation time, each
token of a batch is credited with an equal share of the time since the previous batch
arrived, which is the route's mean time per token over that batch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class TokenPacer:
    """Feed `arrived` per output token and `batch_end` when no more tokens are ready."""

    _last_batch_at: float | None = None  # arrival of the previous batch's first token
    _batch_at: float | None = None  # arrival of the open batch's first token
    _batch_tokens: int = 0

    def arrived(self, now: float) -> None:
        """One output token arrived at `now` (monotonic seconds)."""
        if self._batch_at is None:
            self._batch_at = now
        self._batch_tokens += 1

    def batch_end(self) -> list[float]:
        """Close the open batch: one sample (seconds per token) per token in it; none for the
        first batch (its token is the time to first token) or when no batch is open."""
        if self._batch_at is None:
            return []
        samples: list[float] = []
        if self._last_batch_at is not None:
            share = (self._batch_at - self._last_batch_at) / self._batch_tokens
            samples = [share] * self._batch_tokens
        self._last_batch_at, self._batch_at, self._batch_tokens = self._batch_at, None, 0
        return samples
