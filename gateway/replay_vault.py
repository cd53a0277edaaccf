"""The ids of sessions sampled for replay validation, held for the validator to fetch.

Audit events carry only digests (monitors read them), so the prompt and output ids of a
sampled session, and the random salt its event's digests are under (without which a monitor
cannot confirm a guessed prompt or output), stay in this gateway's memory until the validator
asks for them over mesh.gateway.replay (a request only the validator's user may publish,
answered into its own inbox; schemas/validation.py). A record is handed out once and then
dropped; records nobody fetched leave after `ttl_s`, and at most `max_records` (oldest first)
are kept, so memory is bounded whatever the validator does.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from schemas.validation import ReplayRecord, ReplayRecordRequest

DEFAULT_MAX_RECORDS = 1024
DEFAULT_TTL_S = 600.0


class ReplayVault:
    """Sampled sessions' ReplayRecords by session id, bounded in count and age."""

    def __init__(self, *, max_records: int = DEFAULT_MAX_RECORDS, ttl_s: float = DEFAULT_TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_records = max_records
        self.ttl_s = ttl_s
        self.clock = clock
        self._records: OrderedDict[str, tuple[float, ReplayRecord]] = OrderedDict()
        self.dropped = 0  # records that left unfetched (too old, or pushed out)
        self.handed_out = 0

    def __len__(self) -> int:
        return len(self._records)

    def keep(self, record: ReplayRecord) -> None:
        """Hold `record` until it is fetched, too old, or pushed out by newer ones."""
        self._prune()
        self._records[record.session_id] = (self.clock(), record)
        self._records.move_to_end(record.session_id)
        while len(self._records) > self.max_records:
            self._records.popitem(last=False)
            self.dropped += 1

    def take(self, session_id: str) -> ReplayRecord | None:
        """The record of `session_id` (then dropped), or None if this gateway has none."""
        self._prune()
        entry = self._records.pop(session_id, None)
        if entry is None:
            return None
        self.handed_out += 1
        return entry[1]

    def answer(self, request: ReplayRecordRequest) -> ReplayRecord | None:
        """The bus handler: a gateway without the record stays silent (another may hold it)."""
        return self.take(request.session_id)

    def _prune(self) -> None:
        cutoff = self.clock() - self.ttl_s
        while self._records:
            at, _ = next(iter(self._records.values()))
            if at >= cutoff:
                break
            self._records.popitem(last=False)
            self.dropped += 1
