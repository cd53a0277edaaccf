"""Generation Telemetry state of one Route Session: phases, progress and token rates."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from schemas.route import Phase
from schemas.telemetry import GenerationTelemetry

TERMINAL: frozenset[str] = frozenset({"completed", "failed"})


BURST_S = 0.001  # tokens this close together arrived together (a verify step's kept drafts, a flush)


@dataclass(slots=True)
class RateMeter:
    """Decode speed from token timestamps: rolling over the last `window` arrivals, and average.

    Tokens that arrive together (within BURST_S: a verify step's kept drafts, the head's
    flushed batch) are one arrival, so a window never spans only the inside of a burst."""

    window: int = 16
    _arrivals: deque[list[float]] = field(default_factory=deque)  # [time, tokens] per arrival
    first: float | None = None
    last: float | None = None
    count: int = 0

    def tick(self, now: float) -> None:
        """One more generated token at time `now` (monotonic seconds)."""
        if self.first is None:
            self.first = now
        self.last = now
        self.count += 1
        if self._arrivals and now - self._arrivals[-1][0] <= BURST_S:
            self._arrivals[-1][1] += 1
            return
        self._arrivals.append([now, 1])
        while len(self._arrivals) > self.window + 1:
            self._arrivals.popleft()

    @property
    def rolling(self) -> float:
        """Tokens per second over the last `window` arrivals: the tokens after the oldest arrival
        kept, over the time since it (0 until two arrivals)."""
        if len(self._arrivals) < 2:
            return 0.0
        span = self._arrivals[-1][0] - self._arrivals[0][0]
        tokens = sum(n for _, n in self._arrivals) - self._arrivals[0][1]
        return tokens / span if span > 0 else 0.0

    @property
    def average(self) -> float:
        """Tokens per second between the first and the last token (0 until two tokens)."""
        if self.count < 2 or self.first is None or self.last is None:
            return 0.0
        span = self.last - self.first
        return (self.count - 1) / span if span > 0 else 0.0


def should_emit(
    *, phase_changed: bool, phase: str, now: float, last_emit: float, min_interval: float
) -> bool:
    """Phase changes always emit; progress within decode at most once per `min_interval`."""
    if phase_changed or phase != "decode":
        return True
    return now - last_emit >= min_interval


class SessionTelemetry:
    """Mutable telemetry of one session; every change goes through `emit` to its hub."""

    def __init__(
        self,
        session_id: str,
        model: str,
        emit: Callable[[GenerationTelemetry, bool], None],
        *,
        min_interval: float = 0.1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.session_id = session_id
        self.model = model
        self.phase: Phase = "queued"
        self.route_id: str | None = None
        self.route_nodes: list[str] = []
        self.route_policy: str = "public"  # the policy its routes were chosen under
        self.queue_position: int | None = None  # while waiting in the admission queue
        self.prefill_done = 0
        self.prefill_total = 0
        self.rate = RateMeter()
        self.last_phase: Phase | None = None
        self.failure_reason: str | None = None
        self.finish_reason: str | None = None
        self.restarts = 0
        self.moves = 0  # routes the tracker moved it to (spreading sessions over replicas)
        self.kept_nodes: list[str] = []  # the last restart's hops that continued their Hot KV State
        self.spec_trips = 0  # speculative decoding: verify steps, their drafts and kept drafts
        self.spec_drafted = 0
        self.spec_accepted = 0
        self.spec_draft_length = 0
        self.spec_pipelined = 0  # verify steps sent before the one before them was answered
        self.restart_reason: str | None = None
        self.lost_node_id: str | None = None
        self.seq = 0
        self.created = clock()
        self._emit = emit
        self._clock = clock
        self._min_interval = min_interval
        self._last_emit = 0.0
        self._dirty = False

    @property
    def terminal(self) -> bool:
        """True once completed or failed."""
        return self.phase in TERMINAL

    def snapshot(self) -> GenerationTelemetry:
        """The current state as a telemetry event (with the current seq)."""
        return GenerationTelemetry(
            session_id=self.session_id,
            route_id=self.route_id,
            model=self.model,
            phase=self.phase,
            seq=self.seq,
            queue_position=self.queue_position,
            prefill_tokens_done=self.prefill_done,
            prefill_tokens_total=self.prefill_total,
            generated_tokens=self.rate.count,
            rolling_tokens_per_second=round(self.rate.rolling, 3),
            average_tokens_per_second=round(self.rate.average, 3),
            route_nodes=list(self.route_nodes),
            route_policy=self.route_policy,
            last_phase=self.last_phase,
            failure_reason=self.failure_reason,
            finish_reason=self.finish_reason,
            restarts=self.restarts,
            moves=self.moves,
            restart_reason=self.restart_reason,
            lost_node_id=self.lost_node_id,
            kept_nodes=list(self.kept_nodes),
            spec_trips=self.spec_trips,
            spec_accepted_per_trip=round((self.spec_accepted + self.spec_trips) / self.spec_trips, 3)
            if self.spec_trips else None,
            spec_acceptance=round(self.spec_accepted / self.spec_drafted, 3) if self.spec_drafted else None,
            spec_draft_length=self.spec_draft_length,
            spec_pipelined_trips=self.spec_pipelined,
        )

    def _changed(self, *, phase_changed: bool) -> None:
        now = self._clock()
        if not should_emit(
            phase_changed=phase_changed, phase=self.phase, now=now,
            last_emit=self._last_emit, min_interval=self._min_interval,
        ):
            self._dirty = True
            return
        self._dirty = False
        self._last_emit = now
        self.seq += 1
        self._emit(self.snapshot(), phase_changed)

    def set_phase(self, phase: Phase) -> None:
        """Enter a new phase (no-op when already terminal)."""
        if self.terminal or phase == self.phase:
            return
        self.phase = phase
        if phase != "queued":
            self.queue_position = None
        self._changed(phase_changed=True)

    def queued(self, position: int) -> None:
        """Waiting in the admission queue at 1-based `position` (an event per move)."""
        if self.terminal or (self.phase == "queued" and position == self.queue_position):
            return
        phase_changed = self.phase != "queued"
        self.phase = "queued"
        self.queue_position = position
        self._changed(phase_changed=phase_changed)

    def start(self) -> None:
        """Publish the first (queued) event."""
        self._changed(phase_changed=True)

    def routed(self, route_id: str, nodes: list[str], kept: list[str] | None = None) -> None:
        """The tracker gave a route: remember its id and nodes (and a restart's Kept Hops)."""
        self.route_id = route_id
        self.route_nodes = list(nodes)
        self.kept_nodes = list(kept or [])

    def prefill_progress(self, done: int, total: int) -> None:
        """The route's head acknowledged `done` of `total` prompt tokens (during a restart: of the
        prompt plus the tokens generated so far); the hops after it may still be computing them.
        Only the first token says the whole route has the prompt."""
        self.prefill_done, self.prefill_total = done, total
        if self.phase in ("prefill", "restarting"):
            self._changed(phase_changed=False)

    def restarting(self, attempt: int, reason: str, lost_node_id: str | None, *, move: bool = False) -> None:
        """The route lost a hop; the session moves to a new one (its `attempt`-th restart). With
        `move`, the tracker asked it to leave `lost_node_id` (a move, counted apart)."""
        if self.terminal:
            return
        if move:
            self.moves += 1
        else:
            self.restarts = attempt
        self.restart_reason, self.lost_node_id = reason, lost_node_id
        self.prefill_done = 0
        if self.phase == "restarting":
            self._changed(phase_changed=False)
        else:
            self.set_phase("restarting")

    def token(self, *, drafted: int = 0, accepted: int = 0, pipelined: bool = False) -> None:
        """One more generated token (the first one comes out of prefill); the first of a verify
        step says how many tokens its head drafted, how many the tail kept, and whether the
        step was pipelined."""
        self.rate.tick(self._clock())
        if drafted:
            self.spec_pipelined += pipelined
            self.spec_trips += 1
            self.spec_drafted += drafted
            self.spec_accepted += accepted
            self.spec_draft_length = drafted
        self._changed(phase_changed=False)

    def complete(self, finish_reason: str) -> None:
        """The session ended normally."""
        if self.terminal:
            return
        self.finish_reason = finish_reason
        self.set_phase("completed")

    def fail(self, reason: str, *, last_phase: Phase | None = None) -> None:
        """The session failed in `last_phase` (default: the current phase) for `reason`."""
        if self.terminal:
            return
        self.last_phase = last_phase or self.phase
        self.failure_reason = reason
        self.set_phase("failed")
