"""Hop Telemetry: each hop's per-session progress on mesh.session.<id>.telemetry, off the frame path."""

from __future__ import annotations

import time
from collections.abc import Callable

from bus import subjects
from bus.outbox import Outbox, Publisher
from nodes.server.session import HopSession
from schemas.frames import FrameHeader
from schemas.telemetry import HopPhase, HopTelemetry

DECODE_INTERVAL_S = 1.0  # at most one decode event per session per second
MAX_QUEUE = 256


def frame_phase(header: FrameHeader) -> HopPhase | None:
    """The hop event a finished frame may cause: prefill complete, decode progress, or none."""
    if header.phase == "prefill":
        return "prefill" if header.final else None
    return "decode"


def hop_should_publish(phase: HopPhase, now: float, last: float | None, interval: float) -> bool:
    """Prefill completion and the end always go out; decode at most once per `interval` seconds."""
    if phase != "decode" or last is None:
        return True
    return now - last >= interval


def hop_event(hs: HopSession, phase: HopPhase, reason: str | None = None) -> HopTelemetry:
    """A snapshot of `hs` as this hop's telemetry event."""
    hop, c = hs.route.hops[hs.hop_index], hs.counters
    return HopTelemetry(
        session_id=hs.session_id, route_id=hs.route.route_id, node_id=hop.node_id,
        hop_index=hs.hop_index, layer_start=hop.layer_start, layer_end=hop.layer_end, phase=phase,
        position=hs.done_position, prefill_tokens=c.prefill_tokens, decode_tokens=c.decode_tokens,
        compute_ms=c.compute_s * 1e3, cache_bytes=hs.cache_bytes_estimate, reason=reason,
    )


class HopTelemetryPublisher:
    """Session-table hooks that turn hop progress into HopTelemetry on a bounded Outbox."""

    def __init__(self, bus: Publisher, *, interval: float = DECODE_INTERVAL_S, max_queue: int = MAX_QUEUE,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = interval
        self.outbox: Outbox[HopTelemetry] = Outbox(
            bus, lambda e: subjects.hop_telemetry(e.session_id, e.node_id), max_queue=max_queue,
            name="hop telemetry")
        self.offer = self.outbox.offer
        self.run = self.outbox.run
        self._last: dict[str, float] = {}  # session_id -> when its last event was queued
        self._clock = clock

    def on_frame(self, hs: HopSession, header: FrameHeader) -> None:
        """Session-table hook: queue prefill completion and throttled decode progress."""
        phase = frame_phase(header)
        if phase is None:
            return
        now = self._clock()
        if not hop_should_publish(phase, now, self._last.get(hs.session_id), self.interval):
            return
        self._last[hs.session_id] = now
        self.offer(hop_event(hs, phase))

    async def on_ended(self, hs: HopSession) -> None:
        """Session-table hook: queue the session's last event on this hop (never waits)."""
        self._last.pop(hs.session_id, None)
        r = hs.life
        phase: HopPhase = "failed" if r.status == "failed" else "closed"
        self.offer(hop_event(hs, phase, f"{r.status}: {r.reason}"))
