"""All sessions' Generation Telemetry: bounded history, followers, retention, a bus sink."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from gateway.errors import SessionConflictError
from gateway.telemetry import SessionTelemetry
from schemas.telemetry import GenerationTelemetry

Sink = Callable[[GenerationTelemetry, bool], None]


@dataclass(slots=True, frozen=True)
class HubLimits:
    """Bounds of the hub: per-session history, global history, finished-session retention."""

    session_history: int = 256
    global_history: int = 1024
    retention_seconds: float = 600.0
    max_finished: int = 1024
    min_decode_interval: float = 0.1


class SessionRecord:
    """One session's telemetry plus its bounded event history and a change signal."""

    def __init__(self, telemetry: SessionTelemetry, history: int) -> None:
        self.telemetry = telemetry
        self.history: deque[GenerationTelemetry] = deque(maxlen=history)
        self.changed = asyncio.Event()
        self.finished_at: float | None = None

    @property
    def latest(self) -> GenerationTelemetry:
        """The last emitted event (or the current snapshot before the first emit)."""
        return self.history[-1] if self.history else self.telemetry.snapshot()

    def after(self, seq: int) -> list[GenerationTelemetry]:
        """Events with seq > `seq` still in the history."""
        return [e for e in self.history if e.seq > seq]

    def _signal(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()


class TelemetryHub:
    """Owns every SessionRecord; followers read history and wait on change signals."""

    def __init__(self, limits: HubLimits | None = None, *, sink: Sink | None = None) -> None:
        self.limits = limits or HubLimits()
        self._sink = sink
        self._records: OrderedDict[str, SessionRecord] = OrderedDict()
        self._global: deque[tuple[int, GenerationTelemetry]] = deque(
            maxlen=self.limits.global_history
        )
        self._global_seq = 0
        self._global_changed = asyncio.Event()
        self._added = asyncio.Event()
        self.closed = False

    def set_sink(self, sink: Sink | None) -> None:
        """Where every emitted event also goes (the bus publisher), or None."""
        self._sink = sink

    def __len__(self) -> int:
        return len(self._records)

    def open(self, session_id: str, model: str) -> SessionTelemetry:
        """Create a session's telemetry and emit `queued`; an id in use raises a 409 (a finished
        session that never had a route gives its id up)."""
        self.prune()
        if (held := self._records.get(session_id)) is not None:
            finished = held.finished_at
            if finished is None or held.telemetry.route_id is not None:
                raise SessionConflictError(session_id, None if finished is None else
                                           max(0.0, finished + self.limits.retention_seconds - time.monotonic()))
            # a request refused before it had a route (the queue, routing): no hop knows the id,
            # and its retry (the Retry-After it was given) takes it over
            del self._records[session_id]
        record: SessionRecord

        def emit(event: GenerationTelemetry, phase_changed: bool) -> None:
            self._on_event(record, event, phase_changed)

        telemetry = SessionTelemetry(
            session_id, model, emit, min_interval=self.limits.min_decode_interval
        )
        record = SessionRecord(telemetry, self.limits.session_history)
        self._records[session_id] = record
        self._added.set()
        self._added = asyncio.Event()
        telemetry.start()
        return telemetry

    def records(self) -> list[SessionRecord]:
        """Every known session's record (live and retained), oldest first."""
        return list(self._records.values())

    def get(self, session_id: str) -> SessionRecord | None:
        """The record of a session, if known (live or retained)."""
        return self._records.get(session_id)

    def _on_event(self, record: SessionRecord, event: GenerationTelemetry, phase_changed: bool) -> None:
        record.history.append(event)
        if record.telemetry.terminal and record.finished_at is None:
            record.finished_at = time.monotonic()
        self._global_seq += 1
        self._global.append((self._global_seq, event))
        record._signal()
        self._global_changed.set()
        self._global_changed = asyncio.Event()
        if self._sink is not None:
            self._sink(event, phase_changed)

    def prune(self, now: float | None = None) -> int:
        """Drop finished sessions past retention or beyond the count bound; returns how many."""
        now = time.monotonic() if now is None else now
        finished = [(sid, r) for sid, r in self._records.items() if r.finished_at is not None]
        drop = {sid for sid, r in finished if now - (r.finished_at or now) > self.limits.retention_seconds}
        excess = len(finished) - len(drop) - self.limits.max_finished
        if excess > 0:
            kept = [sid for sid, _ in finished if sid not in drop]
            drop.update(kept[:excess])
        for sid in drop:
            del self._records[sid]
        return len(drop)

    async def wait_for(self, session_id: str, wait: float) -> SessionRecord | None:
        """The record of `session_id`, waiting up to `wait` seconds for it to appear."""
        deadline = time.monotonic() + wait
        while not self.closed:
            record = self._records.get(session_id)
            if record is not None:
                return record
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            try:
                await asyncio.wait_for(self._added.wait(), remaining)
            except TimeoutError:
                return None
        return None

    async def follow(
        self, record: SessionRecord, after_seq: int, keepalive: float
    ) -> AsyncIterator[GenerationTelemetry | None]:
        """Events after `after_seq` as they happen; None means "send a keep-alive"; ends at terminal."""
        last = after_seq
        while not self.closed:
            changed = record.changed
            for event in record.after(last):
                last = event.seq
                yield event
            if record.telemetry.terminal and not record.after(last):
                return
            try:
                await asyncio.wait_for(changed.wait(), keepalive)
            except TimeoutError:
                yield None

    async def follow_all(
        self, after_seq: int, keepalive: float
    ) -> AsyncIterator[tuple[int, GenerationTelemetry] | None]:
        """Every session's events (global seq, event) as they happen; None = keep-alive."""
        last = after_seq
        while not self.closed:
            changed = self._global_changed
            for gseq, event in list(self._global):
                if gseq > last:
                    last = gseq
                    yield gseq, event
            try:
                await asyncio.wait_for(changed.wait(), keepalive)
            except TimeoutError:
                yield None

    def close(self) -> None:
        """Wake every follower and waiter so they end (shutdown)."""
        self.closed = True
        self._added.set()
        self._global_changed.set()
        for record in self._records.values():
            record.changed.set()

    async def run_pruner(self, interval: float = 30.0) -> None:
        """Background loop: prune retained sessions every `interval` seconds."""
        while not self.closed:
            await asyncio.sleep(interval)
            self.prune()
