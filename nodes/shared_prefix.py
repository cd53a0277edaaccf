"""Shared prefixes: a hop reuses the Hot KV State one of its own sessions already holds for the
same leading rows, instead of computing them again.

Chat requests share their template's opening (the system prompt), and a restart's rebuild
carries the same opening again (docs/shard-runtime.md, "Shared prefixes"). A hop keeps, per
session, a chained digest of each leading input row it computed in a batched
prefill (token ids on a head, hidden rows elsewhere); the rows of a position depend only on the
rows before it, so two sessions whose first m input rows are equal hold equal KV for those m
positions. A new session whose first part starts with rows some open session holds copies that
session's KV within this node (the engine's sequence copy; Hot KV State never leaves the node),
computes only the rest, and a non-tail hop answers the reused rows from the outputs it kept.
A closed session's rows may stay too, in its free slot (LlamaShardEngine.close_session).

Only rows from batched prefill parts of two or more rows count: with the default KV profile,
llama.cpp's one-row calls (decode steps, a stepwise replay) give a row other arithmetic than a
batched prefill, so their KV is not what a prefill of the same tokens makes. And at least two
rows of a part are always computed (MIN_COMPUTED), for the same reason. With those two rules,
a reused prefix gives bit-identical KV and outputs (tests/test_shared_prefix.py). This module
is bookkeeping only: the engine does the copy.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

DEFAULT_PREFIX_ROWS = 256  # leading positions per session a hop indexes (and, off the tail, keeps outputs of)
MIN_REUSE = 8  # shorter matches are not worth a sequence copy
MIN_COMPUTED = 2  # rows of a part always computed: a one-row call has other arithmetic


def chain_digests(rows: np.ndarray, previous: bytes = b"") -> Iterator[bytes]:
    """Digest i covers rows[0..i] (and whatever `previous` covered): equal digests, equal prefixes."""
    for row in rows:
        previous = hashlib.blake2b(previous + row.tobytes(), digest_size=16).digest()
        yield previous


@dataclass(slots=True)
class _Held:
    """What one session holds: the digests of its leading positions, their outputs (non-tail)."""

    digests: list[bytes] = field(default_factory=list)
    outputs: np.ndarray | None = None  # [max_rows, hidden] float32; the first len(digests) rows are valid


@dataclass(slots=True)
class PrefixMatch:
    """A session whose first `rows` positions hold the new session's first rows."""

    holder: str
    rows: int


class SharedPrefixIndex:
    """Which open session holds which leading rows, on one hop (pure bookkeeping, no model)."""

    def __init__(self, max_rows: int = DEFAULT_PREFIX_ROWS, hidden_size: int | None = None) -> None:
        self.max_rows = max_rows
        self.hidden_size = hidden_size  # set on non-tail hops: outputs are kept to answer reused rows
        self._held: dict[str, _Held] = {}
        self._holders: dict[bytes, set[str]] = {}
        self.hits = 0
        self.rows_reused = 0

    @property
    def enabled(self) -> bool:
        return self.max_rows >= MIN_REUSE

    def match(self, rows: np.ndarray) -> PrefixMatch | None:
        """The longest prefix of `rows` (a new session's first part) a session or a retained prefix holds,
        leaving at least MIN_COMPUTED rows to compute; None if shorter than MIN_REUSE."""
        limit = min(self.max_rows, len(rows) - MIN_COMPUTED)
        if not self.enabled or limit < MIN_REUSE:
            return None
        best = None
        for i, digest in enumerate(chain_digests(rows[:limit])):  # chained: the first miss ends every longer match
            holders = self._holders.get(digest)
            if not holders:
                break
            best = (next(iter(holders)), i + 1)
        if best is None or best[1] < MIN_REUSE:
            return None
        return PrefixMatch(*best)

    def outputs(self, holder: str, n: int) -> np.ndarray | None:
        """The first `n` output rows `holder` kept (non-tail hops), copied."""
        held = self._held.get(holder)
        if held is None or held.outputs is None:
            return None
        return held.outputs[:n].copy()

    def reused(self, session_id: str, match: PrefixMatch) -> None:
        """`session_id` now holds `match.rows` rows copied from the holder."""
        src = self._held[match.holder]
        held = self._held.setdefault(session_id, _Held())
        self._drop_digests(session_id, held, 0)
        held.digests = src.digests[:match.rows]
        for d in held.digests:
            self._holders.setdefault(d, set()).add(session_id)
        if src.outputs is not None:
            held.outputs = self._outputs_of(held)
            held.outputs[:match.rows] = src.outputs[:match.rows]
        self.hits += 1
        self.rows_reused += match.rows

    def extend(self, session_id: str, position: int, rows: np.ndarray, outputs: np.ndarray | None) -> None:
        """A batched prefill part of `rows` ran at `position` (`outputs`: its output rows, off
        the tail): index those past what the session holds. Only a part of two or more rows
        that reaches past the held rows without a gap counts."""
        held = self._held.setdefault(session_id, _Held())
        n_held, end = len(held.digests), position + len(rows)
        if len(rows) < MIN_COMPUTED or not position <= n_held < min(end, self.max_rows):
            return
        skip, take = n_held - position, min(end, self.max_rows) - n_held
        new = list(chain_digests(rows[skip:skip + take], held.digests[-1] if held.digests else b""))
        for d in new:
            self._holders.setdefault(d, set()).add(session_id)
        held.digests.extend(new)
        if outputs is not None and self.hidden_size is not None:
            held.outputs = self._outputs_of(held)
            held.outputs[n_held:n_held + take] = outputs[skip:skip + take]

    def cut(self, session_id: str, keep: int) -> None:
        """The session's KV was cut back to `keep` positions (or lost from there)."""
        held = self._held.get(session_id)
        if held is not None and keep < len(held.digests):
            self._drop_digests(session_id, held, keep)

    def rename(self, old: str, new: str) -> None:
        """The session continues under a new id (a Kept Hop)."""
        held = self._held.pop(old, None)
        if held is None:
            return
        for d in held.digests:
            holders = self._holders[d]
            holders.discard(old)
            holders.add(new)
        self._held[new] = held

    def drop(self, session_id: str) -> None:
        """The session's KV is gone."""
        held = self._held.pop(session_id, None)
        if held is not None:
            self._drop_digests(session_id, held, 0)

    def held_rows(self, session_id: str) -> int:
        held = self._held.get(session_id)
        return 0 if held is None else len(held.digests)

    def _outputs_of(self, held: _Held) -> np.ndarray:
        if held.outputs is None:
            assert self.hidden_size is not None
            held.outputs = np.empty((self.max_rows, self.hidden_size), dtype=np.float32)
        return held.outputs

    def _drop_digests(self, session_id: str, held: _Held, keep: int) -> None:
        for d in held.digests[keep:]:
            holders = self._holders.get(d)
            if holders is not None:
                holders.discard(session_id)
                if not holders:
                    del self._holders[d]
        del held.digests[keep:]
