"""The one interface every shard backend implements, and its typed errors.

A ShardEngine executes layers [start, end) of one model for many Route Sessions at once.
Inputs are token ids on a head shard and hidden rows everywhere else. A non-tail shard
returns hidden rows; the tail applies the final norm and LM head and samples one token
from the last row. Every check on the inputs happens before any model execution.
"""

from __future__ import annotations

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


class ShardEngine(Protocol):
    """A loaded shard that serves many sessions. Calls are not thread-safe; callers serialize."""

    @property
    def layers(self) -> ShardRange: ...

    @property
    def hidden_size(self) -> int: ...

    def capability(self) -> CapabilityReport: ...

    def open_session(self, session_id: str, sampling: SamplingParams | None = None) -> None:
        """Allocate an empty Hot KV State for a session (position 0)."""

    def forward(
        self,
        session_id: str,
        position: int,
        *,
        token_ids: np.ndarray | None = None,
        hidden: np.ndarray | None = None,
        want_logits: bool = False,
    ) -> ShardOutput:
        """Run a prefill chunk (n rows) or a decode step (1 row) at `position`.

        `position` must equal the session's current position; afterwards it advances
        by the number of rows. Head shards take `token_ids` [n] int32; others take
        `hidden` [n, hidden_size] float32.
        """

    def position(self, session_id: str) -> int: ...

    def cache_bytes(self, session_id: str) -> int: ...

    def close_session(self, session_id: str) -> None:
        """Release the session's cache; unknown ids raise UnknownSessionError."""

    def sessions(self) -> list[str]: ...

    def close(self) -> None:
        """Free the model and every session."""
