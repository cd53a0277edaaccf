"""SeamLog: the hidden rows a non-tail hop sent across its seam, kept per session by position.

A restart that loses the hop after this one starts that range empty on a new node, which
needs this hop's outputs for every position of the history. This hop, a Kept Hop of the
restart's route (docs/shard-runtime.md, "Kept hops"), sends them from its log instead of
recomputing its layers: the rows are the ones it sent before, so the new hop's KV is built
from the same inputs the lost hop's was. The log is this session's, freed with it; it costs
width × 4 bytes per position (3.75 KiB on the bundled model, about a tenth of the KV).
"""

from __future__ import annotations

import numpy as np

FIRST_ROWS = 256  # rows allocated at first; the log doubles as the session grows


class SeamLog:
    """Rows [0, len) of one session's outputs on this hop, float32 as computed."""

    def __init__(self, width: int, limit: int) -> None:
        self.width = width
        self.limit = limit  # the context size: no session has more positions
        self._rows = np.empty((0, width), dtype=np.float32)
        self.length = 0

    @property
    def nbytes(self) -> int:
        """Bytes allocated."""
        return self._rows.nbytes

    def put(self, position: int, rows: np.ndarray) -> bool:
        """Record `rows` as the outputs from `position` on (a copy: the engine may reuse its
        buffer). A hop computes in order, so rows before `position` are logged already; if
        not (a gap), or past the context, nothing is recorded and False is returned: the log
        is only a shortcut, never a reason to fail a frame (a restart that needs rows it lacks
        is refused, and restarts on another route)."""
        end = position + len(rows)
        if position > self.length or end > self.limit:
            return False
        if end > len(self._rows):
            grown = np.empty((min(self.limit, max(end, FIRST_ROWS, 2 * len(self._rows))), self.width),
                             dtype=np.float32)
            grown[:self.length] = self._rows[:self.length]
            self._rows = grown
        self._rows[position:end] = rows
        self.length = max(self.length, end)
        return True

    def cut(self, position: int) -> None:
        """Forget the rows from `position` on (drafts a verify step did not keep)."""
        self.length = min(self.length, position)

    def rows(self, start: int, end: int) -> np.ndarray:
        """The logged outputs of positions [start, end)."""
        if not 0 <= start <= end <= self.length:
            raise ValueError(f"seam log holds rows [0, {self.length}), not [{start}, {end})")
        return self._rows[start:end]

    def truncate(self, length: int) -> None:
        """Forget the rows from `length` on (a restart keeps only the history before it)."""
        self.length = min(self.length, length)
