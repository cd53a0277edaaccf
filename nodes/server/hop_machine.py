"""A Route Session's lifecycle on one hop: a HopPhase, one small record (HopLife), and
one pure `transition(life, event) -> life`.

HopSession (nodes/server/session.py) feeds it what happens to the session on this hop (the
prompt's last chunk accepted, a Decode Run or a lane taking or letting go of the
decode steps, the session ending) and the SessionTable (nodes/server/table.py) what happens
to a parked session's Hot KV State (a restart continues it, or it is freed). The record is
the only copy of the phase; the I/O each phase implies (stop the worker, free or keep the
cache) stays with its owners.

    prefill -> decoding <-> running     (the head's Decode Run)
                  ^
                  +-----> streaming     (a lane from the previous hop)
    any open phase -> closed | aborted | failed | expired      (its Hot KV State freed)
    decoding, running, streaming -> parked -> aborted | failed  (kept for a restart, then
                                                                 continued or freed)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum

from schemas.route import RouteFailure


class HopPhase(StrEnum):
    PREFILL = "prefill"  # taking the prompt's chunks
    DECODING = "decoding"  # prompt done: decode steps come (a Decode Run to the head, lanes past it)
    RUNNING = "running"  # the head runs a Decode Run: it feeds each token back by itself
    STREAMING = "streaming"  # a lane from the previous hop carries the decode steps
    PARKED = "parked"  # ended because another hop was lost: its Hot KV State waits for a restart
    CLOSED = "closed"
    ABORTED = "aborted"
    FAILED = "failed"
    EXPIRED = "expired"  # idle for longer than the lease

    @property
    def open(self) -> bool:
        """Frames may still run: the session has not ended."""
        return self in _OPEN

    @property
    def decoding(self) -> bool:
        """The prompt is in: decode steps are what comes next."""
        return self in _DECODING

    @property
    def holds_steps(self) -> bool:
        """A Decode Run or a lane carries the decode steps through this hop."""
        return self in (HopPhase.RUNNING, HopPhase.STREAMING)


_OPEN = frozenset({HopPhase.PREFILL, HopPhase.DECODING, HopPhase.RUNNING, HopPhase.STREAMING})
_DECODING = frozenset({HopPhase.DECODING, HopPhase.RUNNING, HopPhase.STREAMING})
ENDINGS = frozenset({HopPhase.CLOSED, HopPhase.ABORTED, HopPhase.FAILED, HopPhase.EXPIRED})


@dataclass(frozen=True, slots=True)
class HopLife:
    """One session's lifecycle on this hop."""

    phase: HopPhase = HopPhase.PREFILL
    ended: HopPhase | None = None  # how it ended (one of ENDINGS), a parked session's too
    reason: str | None = None  # why it ended
    failure: RouteFailure | None = None  # what a frame of the ended session is answered with
    kept_until: float | None = None  # parked: monotonic time its Hot KV State is freed

    @property
    def status(self) -> str:
        """`open`, or how the session ended (GET /v1/sessions, error messages)."""
        return "open" if self.ended is None else self.ended.value


# -- events ---------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class PromptIn:
    """The prompt's last chunk was accepted."""


@dataclass(frozen=True, slots=True)
class RunIn:
    """A Decode Run was accepted on the head."""


@dataclass(frozen=True, slots=True)
class RunOut:
    """The Decode Run's frame finished."""


@dataclass(frozen=True, slots=True)
class StreamIn:
    """A lane from the previous hop took the session."""


@dataclass(frozen=True, slots=True)
class StreamOut:
    """The lane let go of the session."""


@dataclass(frozen=True, slots=True)
class End:
    """The session ends `how` (one of ENDINGS). It parks instead when `park` says so, or, when
    `park` is None, when `parks` says so and the prompt was in (a restart keeps hops only of a
    route that was decoding); either way only if this node keeps state (`keep_until`)."""

    how: HopPhase
    reason: str
    failure: RouteFailure | None = None
    node_id: str = ""  # this node: a loss that names it frees at once
    keep_until: float | None = None  # when parked state is freed; None: this node keeps none
    park: bool | None = None  # the caller's say: always (a restart continues it now) or never


@dataclass(frozen=True, slots=True)
class Adopted:
    """A restart's session took the parked Hot KV State."""


@dataclass(frozen=True, slots=True)
class Freed:
    """The parked Hot KV State was freed (its slot was needed, its time ran out, shutdown)."""


Event = PromptIn | RunIn | RunOut | StreamIn | StreamOut | End | Adopted | Freed

# the moves of an open session's phase: (phase, event) -> next phase
MOVES: dict[tuple[HopPhase, type], HopPhase] = {
    (HopPhase.PREFILL, PromptIn): HopPhase.DECODING,
    (HopPhase.DECODING, RunIn): HopPhase.RUNNING,
    (HopPhase.RUNNING, RunOut): HopPhase.DECODING,
    (HopPhase.DECODING, StreamIn): HopPhase.STREAMING,
    (HopPhase.STREAMING, StreamOut): HopPhase.DECODING,
}


def parks(how: HopPhase, failure: RouteFailure | None, node_id: str) -> bool:
    """Whether a session that ends so keeps its Hot KV State for a restart (pure): it was
    aborted or failed because another hop of its route was lost. Its KV still holds the
    history, so a restart's route may continue on this node (a Kept Hop) instead of
    prefilling it again. Every other end frees at once."""
    return (how in (HopPhase.ABORTED, HopPhase.FAILED) and failure is not None and failure.code == "hop_lost"
            and failure.node_id is not None and failure.node_id != node_id)


def transition(r: HopLife, event: Event) -> HopLife:
    """The session's record after `event`. An event that does not apply to the phase leaves
    the record as it is (the same object): a second end, a stream letting go of a session
    that already ended, a restart or a reaper reaching for state that is no longer parked."""
    if isinstance(event, End):
        return _end(r, event) if r.phase.open else r
    if isinstance(event, Adopted | Freed):
        if r.phase is not HopPhase.PARKED:
            return r
        assert r.ended is not None
        return replace(r, phase=r.ended, kept_until=None)
    nxt = MOVES.get((r.phase, type(event)))
    return r if nxt is None else replace(r, phase=nxt)


def _end(r: HopLife, e: End) -> HopLife:
    if e.how not in ENDINGS:
        raise ValueError(f"a session cannot end as {e.how!r}")
    park = e.park if e.park is not None else parks(e.how, e.failure, e.node_id) and r.phase.decoding
    if park and e.keep_until is not None:
        return HopLife(HopPhase.PARKED, e.how, e.reason, e.failure, e.keep_until)
    return HopLife(e.how, e.how, e.reason, e.failure)
