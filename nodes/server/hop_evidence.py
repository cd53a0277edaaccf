"""Hop Evidence: the rows this hop received and sent for each recent session, for the validator.

Blame for a wrong answer comes from each node's own computation (docs/validation.md, "Whom a
failure blames"): the validator recomputes a hop's layer range from the rows that hop says it
received, and compares the result with the rows it says it sent; at each seam, what one hop
says it sent must be what the next says it received. This module keeps those rows:
- the Inbound Log of a non-head hop (the rows as they arrived, by position; a head's input is
  the session's token ids, which the validator has from the gateway);
- the Seam Log of a non-tail hop (the rows it sent; a tail's output is the tokens the gateway
  recorded).
Every HopSession registers its logs when it opens (`track`); the shelf keeps them after the
session ends, oldest sessions dropped first once they hold more than `budget_bytes`. Only the
validator may ask for them (mesh.node.<id>.evidence; the reply goes to its own inbox), one
page of rows per request: a bus message carries at most 1 MB.
"""

from __future__ import annotations

import base64
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from nodes.server.seam_log import SeamLog
from schemas.validation import HopEvidence, HopEvidenceRequest

DEFAULT_BUDGET_MB = 64
PAGE_BYTES = 256 * 1024  # rows per reply: this many bytes of float32 per side, before base64


@dataclass(slots=True)
class HopRecord:
    """One session's logs on this hop."""

    session_id: str
    route_id: str
    hop_index: int
    layer_start: int
    layer_end: int
    width: int
    inbound: SeamLog | None  # None on a head
    outbound: SeamLog | None  # None on a tail
    kept: int = 0  # a Kept Hop's rows below this were computed by the session it continues
    tracked_at: float = field(default_factory=time.monotonic)

    @property
    def nbytes(self) -> int:
        return sum(log.nbytes for log in (self.inbound, self.outbound) if log is not None)


def page_rows(width: int) -> int:
    """Rows per evidence reply for rows of `width` floats (pure)."""
    return max(1, PAGE_BYTES // (4 * width))


def _b64(log: SeamLog | None, start: int, end: int) -> str:
    if log is None:
        return ""
    end = min(end, log.length)
    if start >= end:
        return ""
    return base64.b64encode(np.ascontiguousarray(log.rows(start, end), dtype=np.float32).tobytes()).decode()


class EvidenceShelf:
    """The HopRecords of the latest sessions, within a byte budget (0: keep nothing)."""

    def __init__(self, node_id: str, budget_bytes: int = DEFAULT_BUDGET_MB << 20) -> None:
        self.node_id = node_id
        self.budget_bytes = budget_bytes
        self._records: OrderedDict[str, HopRecord] = OrderedDict()  # oldest first

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    def track(self, record: HopRecord) -> None:
        """Keep a session's logs (they grow as it runs); drop the oldest beyond the budget."""
        if not self.enabled:
            return
        self._records[record.session_id] = record
        self._records.move_to_end(record.session_id)
        self._trim()

    def _trim(self) -> None:
        total = sum(r.nbytes for r in self._records.values())
        while len(self._records) > 1 and total > self.budget_bytes:
            _, old = self._records.popitem(last=False)
            total -= old.nbytes

    def get(self, session_id: str) -> HopRecord | None:
        return self._records.get(session_id)

    def answer(self, req: HopEvidenceRequest) -> HopEvidence:
        """One page of a session's rows, from `req.start`, both sides."""
        self._trim()
        r = self._records.get(req.session_id)
        if r is None:
            return HopEvidence(session_id=req.session_id, node_id=self.node_id, found=False,
                               reason="this node keeps no rows of that session (never served, or dropped)")
        end = req.start + min(req.max_rows, page_rows(r.width))
        return HopEvidence(
            session_id=r.session_id, node_id=self.node_id, found=True, route_id=r.route_id, hop_index=r.hop_index,
            layer_start=r.layer_start, layer_end=r.layer_end, width=r.width, kept=r.kept, start=req.start,
            inbound_length=r.inbound.length if r.inbound is not None else 0,
            outbound_length=r.outbound.length if r.outbound is not None else 0,
            inbound=_b64(r.inbound, req.start, end), outbound=_b64(r.outbound, req.start, end))
