"""The one interface every shard backend implements, and its typed errors.

A ShardEngine executes layers [start, end) of one model for many Route Sessions at once:
one `forward_batch` call runs the rows of several sessions together (one llama.cpp batch
with one sequence id per session). Inputs are token ids on a head shard and hidden rows
everywhere else. A non-tail shard returns hidden rows; the tail applies the final norm and
LM head and samples one token from each part's last row. Every check on a part happens
before any model execution, and a part that fails its checks fails alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from schemas.capability import CapabilityReport, ShardRange
from schemas.sampling import SamplingParams


class EngineError(Exception):
    """Base of the backend's typed errors; `code` is stable and machine readable."""

    code = "engine_error"

    def __init__(self, message: str, **fields: object) -> None:
        super().__init__(message)
        self.fields = fields


class UnknownSessionError(EngineError):
    code = "unknown_session"


class SessionExistsError(EngineError):
    code = "session_exists"


class PositionMismatchError(EngineError):
    code = "position_mismatch"


class InputShapeError(EngineError):
    code = "bad_input"


class LayerRangeError(EngineError):
    code = "bad_layer_range"


class CacheFullError(EngineError):
    code = "cache_full"


class KvBudgetError(EngineError):
    """One session of the node's context does not fit its KV budget (`--ctx` against `--kv-memory`)."""

    code = "kv_budget"


class ConstraintError(EngineError):
    """An output constraint that cannot be made, or a token outside what it allows."""


class UnsupportedModelError(EngineError):
    code = "unsupported_model"


@dataclass(slots=True)
class TokenChoice:
    """The tail's sampled token for the last input row."""

    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)


@dataclass(slots=True)
class ShardOutput:
    """Result of one forward call: hidden rows (non-tail) or a sampled token (tail)."""

    hidden: np.ndarray | None = None  # [n_rows, hidden_size] float32, non-tail only
    token: TokenChoice | None = None  # tail only
    logits: np.ndarray | None = None  # [vocab] float32 of the last row; tail, if asked
    accepted: list[TokenChoice] = field(default_factory=list)  # tail, a verify step: the kept drafts before `token`
    reused: int = 0  # leading rows of the part this hop did not compute: a shared prefix's


@dataclass(slots=True)
class BatchPart:
    """One session's rows in a batched engine call, starting at `position`."""

    session_id: str
    position: int
    rows: np.ndarray  # head: token ids [n] int32; elsewhere: hidden rows [n, hidden_size] float32
    sample: bool = True  # tail only: sample a token from the last row (False: only fill the cache)
    want_logits: bool = False  # tail only: also return the last row's logits
    stepwise: bool = False  # each row its own model call: the numerics of one decode step per row
    # a verify step (nodes/speculation.py): rows 1.. are these drafted tokens; the tail chooses
    # a token from every row and keeps the drafts it agrees with (ShardOutput.accepted)
    drafts: Sequence[int] | None = None
    rewind: bool = False  # `position` may be behind the session's: its later rows (drafts) are dropped first


PartResult = ShardOutput | EngineError


def single_result(results: Sequence[PartResult]) -> ShardOutput:
    """The output of a one-part batch, raising the part's error."""
    (result,) = results
    if isinstance(result, EngineError):
        raise result
    return result


class ShardEngine(Protocol):
    """A loaded shard that serves many sessions. Calls are not thread-safe; callers serialize."""

    @property
    def layers(self) -> ShardRange: ...

    @property
    def hidden_size(self) -> int: ...

    def capability(self) -> CapabilityReport: ...

    def open_session(self, session_id: str, sampling: SamplingParams | None = None) -> None:
        """Allocate an empty Hot KV State for a session (position 0)."""

    def adopt_session(self, old_id: str, new_id: str, keep: int, sampling: SamplingParams | None = None) -> None:
        """Continue session `old_id` as `new_id` (a restart's Kept Hop): its Hot KV State stays
        in place, cut to its first `keep` positions. PositionMismatchError if it holds fewer."""

    def forward_batch(self, parts: Sequence[BatchPart]) -> list[PartResult]:
        """Run every part's rows in one model call; one result per part, in order.

        Each part's `position` must equal its session's current position; afterwards it
        advances by the part's rows. At most one part per session. A part that fails its
        checks gets its EngineError and leaves its session as it was; the others run.
        """

    def forward(
        self,
        session_id: str,
        position: int,
        *,
        token_ids: np.ndarray | None = None,
        hidden: np.ndarray | None = None,
        want_logits: bool = False,
    ) -> ShardOutput:
        """forward_batch of one part: a prefill chunk (n rows) or a decode step (1 row).

        Head shards take `token_ids` [n] int32; others take `hidden` [n, hidden_size] float32.
        """

    def position(self, session_id: str) -> int: ...

    def cache_bytes(self, session_id: str) -> int: ...

    def close_session(self, session_id: str) -> None:
        """Release the session's cache; unknown ids raise UnknownSessionError."""

    def sessions(self) -> list[str]: ...

    def close(self) -> None:
        """Free the model and every session."""
