"""Backend-independent parts of a ShardEngine: its cache slot table and the input checks.

Every check here runs before any model execution, so a rejected frame never changes state.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from nodes.engine import (
    CacheFullError,
    ConstraintError,
    InputShapeError,
    KvBudgetError,
    LayerRangeError,
    PositionMismatchError,
    SessionExistsError,
    UnknownSessionError,
)
from nodes.sampling import Constraint, TokenSampler, session_rng
from schemas.capability import ShardRange
from schemas.output_constraint import OutputConstraint
from schemas.sampling import SamplingParams

ConstraintFactory = Callable[[OutputConstraint], Constraint]


def check_layer_range(start: int, end: int, n_layer: int) -> ShardRange:
    """The ShardRange for [start, end) of an n_layer model, or LayerRangeError."""
    if not (0 <= start < end <= n_layer):
        raise LayerRangeError(
            f"layer range [{start}, {end}) is not inside [0, {n_layer})",
            start=start, end=end, n_layer=n_layer,
        )
    return ShardRange(start=start, end=end, n_layer=n_layer)


@dataclass(slots=True)
class SlotState:
    """The cache slot one Route Session holds on this shard: its bookkeeping (its Hot KV State
    lives in the backend)."""

    session_id: str
    slot: int
    sampling: SamplingParams
    rng: np.random.Generator
    sampler: TokenSampler  # the tail's choice of this session's tokens
    position: int = 0
    opened_at: float = field(default_factory=time.monotonic)


class SlotTable:
    """The backend's `max_sessions` cache slots, by the session id holding each (the node's
    SessionTable, nodes/server/table.py, owns the sessions' lifecycle)."""

    def __init__(self, max_sessions: int, constraint: ConstraintFactory | None = None) -> None:
        self.max_sessions = max_sessions
        self._constraint = constraint  # makes a session's output constraint (the tail's engine)
        self._by_id: dict[str, SlotState] = {}
        self._free = list(range(max_sessions - 1, -1, -1))  # pop() hands out slot 0 first

    def open(self, session_id: str, sampling: SamplingParams | None) -> SlotState:
        """Take a free slot for a new session at position 0. All or nothing: every check, and
        everything that can fail, runs before the slot is taken."""
        if session_id in self._by_id:
            raise SessionExistsError(f"session {session_id!r} is already open", session_id=session_id)
        if not self._free:
            raise CacheFullError(
                f"no free session slot ({self.max_sessions} in use)",
                session_id=session_id, max_sessions=self.max_sessions,
            )
        params = sampling or SamplingParams()
        rng = session_rng(params)
        state = SlotState(session_id, self._free[-1], params, rng, self._sampler(params))
        self._by_id[session_id] = state
        self._free.pop()
        return state

    @property
    def free(self) -> int:
        """Slots not held by a session."""
        return len(self._free)

    def get(self, session_id: str) -> SlotState:
        """The open session, or UnknownSessionError."""
        state = self._by_id.get(session_id)
        if state is None:
            raise UnknownSessionError(f"unknown session {session_id!r}", session_id=session_id)
        return state

    def close(self, session_id: str, *, last: bool = False) -> SlotState:
        """Forget the session and free its slot; returns its last state. `last`: the slot is
        handed out after every other free one (its cache holds a retained prefix)."""
        state = self.get(session_id)
        del self._by_id[session_id]
        if last:
            self._free.insert(0, state.slot)
        else:
            self._free.append(state.slot)
        return state

    def rename(self, old_id: str, new_id: str, keep: int, sampling: SamplingParams | None) -> SlotState:
        """Hand session `old_id`'s slot to `new_id` (a restart's Kept Hop), keeping its first
        `keep` positions; all or nothing. The caller drops the positions past `keep` from its
        backend's cache. The sampler is the new route's, its generator made anew: a seeded
        sampler draws by (seed, position), so the continuation samples as the lost route would."""
        state = self.get(old_id)
        if new_id in self._by_id:
            raise SessionExistsError(f"session {new_id!r} is already open", session_id=new_id)
        if keep > state.position:
            raise PositionMismatchError(
                f"session {old_id!r} holds {state.position} positions, cannot keep {keep}",
                session_id=old_id, position=state.position, keep=keep)
        params = sampling or SamplingParams()
        sampler = self._sampler(params)
        del self._by_id[old_id]
        kept = SlotState(new_id, state.slot, params, session_rng(params), sampler, keep, state.opened_at)
        self._by_id[new_id] = kept
        return kept

    def _sampler(self, params: SamplingParams) -> TokenSampler:
        """The session's TokenSampler (ConstraintError: its output constraint cannot be made)."""
        if params.constraint is None:
            return TokenSampler(params)
        if self._constraint is None:
            raise ConstraintError("this engine cannot constrain output (response_format)")
        return TokenSampler(params, self._constraint(params.constraint))

    def ids(self) -> list[str]:
        """Open session ids, oldest first."""
        return list(self._by_id)

    def __len__(self) -> int:
        return len(self._by_id)


DEFAULT_KV_MEMORY = 1 << 30  # bytes of Hot KV State one shard may hold, all its sessions together
MAX_SEQUENCES = 256  # llama.cpp's LLAMA_MAX_SEQ: sequence ids one context can hold


def sessions_for_memory(kv_memory: int, bytes_per_token: int, n_ctx: int, *, cap: int = MAX_SEQUENCES) -> int:
    """Session slots a KV budget of `kv_memory` bytes holds when each session may grow to
    `n_ctx` tokens of `bytes_per_token` (at most `cap`). KvBudgetError when not even one fits:
    llama.cpp would allocate it all the same, past the budget (a million-token --ctx on a small
    model asks for gigabytes, and the kernel's OOM killer ends the node on its first calls)."""
    per_session = max(1, bytes_per_token * n_ctx)
    if per_session > kv_memory:
        raise KvBudgetError(
            f"one session of {n_ctx} tokens needs {per_session / 2**20:,.0f} MiB of KV cache here "
            f"({bytes_per_token} bytes per token), more than the KV budget of {kv_memory / 2**20:,.0f} MiB: "
            f"lower --ctx (at most {kv_memory // max(1, bytes_per_token)} tokens) or raise --kv-memory",
            n_ctx=n_ctx, bytes_per_token=bytes_per_token, kv_memory=kv_memory)
    return min(cap, kv_memory // per_session)


def check_forward(
    state: SlotState,
    position: int,
    layers: ShardRange,
    *,
    hidden_size: int,
    n_vocab: int,
    n_ctx: int,
    token_ids: np.ndarray | None,
    hidden: np.ndarray | None,
) -> np.ndarray:
    """Validate one forward call; return the rows to run (int32 ids or float32 hidden)."""
    sid = state.session_id
    if position != state.position:
        raise PositionMismatchError(
            f"session {sid!r} is at position {state.position}, frame says {position}",
            session_id=sid, expected=state.position, got=position,
        )
    rows = _check_tokens(sid, token_ids, hidden, n_vocab) if layers.is_head else _check_hidden(
        sid, token_ids, hidden, hidden_size
    )
    if position + len(rows) > n_ctx:
        raise CacheFullError(
            f"session {sid!r}: {position} + {len(rows)} tokens exceed the context of {n_ctx}",
            session_id=sid, position=position, n_tokens=len(rows), n_ctx=n_ctx,
        )
    return rows


def _check_tokens(sid: str, token_ids: np.ndarray | None, hidden: np.ndarray | None, n_vocab: int) -> np.ndarray:
    if (hidden is None and type(token_ids) is np.ndarray and token_ids.shape == (1,)
            and token_ids.dtype == np.int32 and 0 <= int(token_ids[0]) < n_vocab):
        return token_ids  # a decode step's one id: the checks below, without numpy reductions
    if hidden is not None or token_ids is None:
        raise InputShapeError(f"session {sid!r}: the head shard takes token_ids, not hidden rows", session_id=sid)
    ids = np.asarray(token_ids)
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise InputShapeError(
            f"session {sid!r}: token_ids must be a non-empty 1-D integer array, got {ids.dtype}{list(ids.shape)}",
            session_id=sid, shape=list(ids.shape), dtype=str(ids.dtype),
        )
    if ids.min() < 0 or ids.max() >= n_vocab:
        bad = (ids < 0) | (ids >= n_vocab)
        raise InputShapeError(
            f"session {sid!r}: token id {int(ids[bad][0])} is outside the vocabulary [0, {n_vocab})",
            session_id=sid, token_id=int(ids[bad][0]), n_vocab=n_vocab,
        )
    return ids.astype(np.int32, copy=False)


def _check_hidden(sid: str, token_ids: np.ndarray | None, hidden: np.ndarray | None, width: int) -> np.ndarray:
    if token_ids is not None or hidden is None:
        raise InputShapeError(f"session {sid!r}: a non-head shard takes hidden rows, not token_ids", session_id=sid)
    if not isinstance(hidden, np.ndarray) or hidden.dtype != np.float32:
        raise InputShapeError(
            f"session {sid!r}: hidden rows must be float32, got {getattr(hidden, 'dtype', type(hidden).__name__)}",
            session_id=sid,
        )
    if hidden.ndim != 2 or hidden.shape[0] == 0 or hidden.shape[1] != width:
        raise InputShapeError(
            f"session {sid!r}: hidden must be [n >= 1, {width}], got {list(hidden.shape)}",
            session_id=sid, shape=list(hidden.shape), hidden_size=width,
        )
    if not np.isfinite(hidden).all():
        raise InputShapeError(f"session {sid!r}: hidden rows contain NaN or inf", session_id=sid)
    return np.ascontiguousarray(hidden)
