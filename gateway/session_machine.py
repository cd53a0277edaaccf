"""The gateway's machine of one session's lifecycle: a Phase, one small record, and one pure
`step(record, event, limits) -> (record, actions)`.

Generation (gateway/generation.py) feeds it what happens to the session (a route granted, a
token arrived, the route failed, the tracker ordered a move, the route stalled, the client
left, a restart found no route) and carries out the actions it returns (start a route, emit a
token, interrupt the route, ask for a new route, finish, fail). Every decision about restarts
and moves is made here and nowhere else; the record is the only copy of the phase.

    queued -> routing -> prefill -> decode -> finalizing -> completed
                            |          |  \\
                            |          |   moving ------> (route granted) -> decode ...
                            +----------+-> restarting --> (route granted) -> decode ...
                       any phase -> failed
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum

from schemas.route import KeepHop, RouteFailure, RouteSession

MAX_MOVES = 2  # moves one session accepts (tracker/spread.py): past that it stays where it is
MOVE_LEFT_RATIO = 0.25  # a move is declined when fewer tokens are left than this share of the history

# failures that say the hop may be gone (its connection broke: the node died, or only the link
# to it reset): when no route avoids it, a restart takes it again only once the tracker has
# heard from it again (the restart waits while the tracker holds it out: gateway/held_wait.py); the others came
# from a node that answered, so it may serve the new route at once
NODE_GONE: frozenset[str] = frozenset({"hop_lost"})

# failures that say the gateway or a node broke the protocol, not that a hop was lost: a new
# route would break the same way
NOT_RESTARTABLE: frozenset[str] = frozenset({
    "bad_frame", "seq_mismatch", "phase_mismatch", "position_mismatch", "hop_mismatch",
    "route_mismatch", "epoch_mismatch", "invalid_value",
})


class Phase(StrEnum):
    QUEUED = "queued"
    ROUTING = "routing"
    PREFILL = "prefill"
    DECODE = "decode"
    RESTARTING = "restarting"
    MOVING = "moving"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    FAILED = "failed"

    @property
    def public(self) -> str:
        """The phase as Generation Telemetry names it (a move shows as `restarting`, with `moves`)."""
        return "restarting" if self is Phase.MOVING else self.value

    @property
    def terminal(self) -> bool:
        return self in (Phase.COMPLETED, Phase.FAILED)


@dataclass(frozen=True, slots=True)
class Limits:
    """What a session may do, fixed when it starts."""

    max_tokens: int
    max_restarts: int = 0  # new routes it may take after losing a hop
    can_reroute: bool = False  # a restart route can be asked for at all
    keep: bool = True  # a restart continues on the lost route's surviving hops (Kept Hops)


@dataclass(frozen=True, slots=True)
class SessionRecord:
    """One session's state on the gateway."""

    phase: Phase = Phase.QUEUED
    session: RouteSession | None = None  # the route it is on (or last was on)
    routes: int = 0  # routes taken: the current one's epoch
    restarts: int = 0
    moves: int = 0
    prompt_tokens: int = 0
    generated: int = 0
    lost_at: float | None = None  # when the current restart or move began
    asked: AskRoute | None = None  # the last restart's or move's ask for a route, until it gives a token
    finish: str | None = None
    failure: RouteFailure | None = None


# -- events ---------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Queued:
    """Waiting in the admission queue."""


@dataclass(frozen=True, slots=True)
class Routing:
    """Asking the tracker for the first route."""


@dataclass(frozen=True, slots=True)
class RouteGranted:
    session: RouteSession


@dataclass(frozen=True, slots=True)
class TokenArrived:
    """The route's next token; `stopped`: the text it completes matched a stop string."""

    eog: bool
    stopped: bool
    at: float


@dataclass(frozen=True, slots=True)
class RunEnded:
    """The route stopped giving tokens before a stop condition."""


@dataclass(frozen=True, slots=True)
class RouteFailed:
    failure: RouteFailure
    at: float


@dataclass(frozen=True, slots=True)
class RouteRefused:
    """A new route was asked for and none was given."""

    message: str


@dataclass(frozen=True, slots=True)
class MoveOrdered:
    """The tracker asks the session to leave a hop (a `moved` failure naming it)."""

    failure: RouteFailure


@dataclass(frozen=True, slots=True)
class RouteAborted:
    """Someone else (the tracker) aborted the route: a hop is lost."""

    failure: RouteFailure


@dataclass(frozen=True, slots=True)
class Stalled:
    """No progress within the stall deadline."""

    failure: RouteFailure


@dataclass(frozen=True, slots=True)
class RouteBroken:
    """The route broke in a way no new route mends (the gateway's own error)."""

    failure: RouteFailure


@dataclass(frozen=True, slots=True)
class ClientGone:
    reason: str = "client disconnected"


@dataclass(frozen=True, slots=True)
class Finalized:
    """The answer's last text went out."""


Event = (Queued | Routing | RouteGranted | TokenArrived | RunEnded | RouteFailed | RouteRefused | MoveOrdered
         | RouteAborted | Stalled | RouteBroken | ClientGone | Finalized)


# -- actions --------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class StartRoute:
    """Open the route and put the history (the prompt, then any tokens generated) into it."""

    session: RouteSession
    kept: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class EmitToken:
    """Hand the token that arrived to the client."""


@dataclass(frozen=True, slots=True)
class StopRoute:
    """Stop the route's decoding and release it (the session is done with it)."""


@dataclass(frozen=True, slots=True)
class Interrupt:
    """Break the route now: whatever waits on it fails with `failure`."""

    failure: RouteFailure


@dataclass(frozen=True, slots=True)
class AskRoute:
    """Ask for the route of a restart or a move."""

    failure: RouteFailure
    epoch: int
    excluded: frozenset[str]
    keep: tuple[KeepHop, ...]
    keep_position: int
    move: bool
    any_route: bool = False  # asked again: no route avoids the node it left


@dataclass(frozen=True, slots=True)
class Resumed:
    """A restart's (or move's) new route gave its first token after `seconds`."""

    move: bool
    seconds: float


@dataclass(frozen=True, slots=True)
class MoveDeclined:
    pass


@dataclass(frozen=True, slots=True)
class Finish:
    reason: str


@dataclass(frozen=True, slots=True)
class Fail:
    """The session ends with `failure` (`gone`: the client left; nobody reads an error)."""

    failure: RouteFailure | None
    reason: str
    last_phase: Phase
    gone: bool = False
    restart_failed: bool = False  # a restart or move began and never gave a token
    move: bool = False


Action = StartRoute | EmitToken | StopRoute | Interrupt | AskRoute | Resumed | MoveDeclined | Finish | Fail


# -- pure decisions -------------------------------------------------------------------------------

def finish_reason_for(*, token_is_eog: bool, stopped: bool, generated: int, max_tokens: int) -> str | None:
    """Why generation ends after this token, or None to continue."""
    if token_is_eog or stopped:
        return "stop"
    if generated >= max_tokens:
        return "length"
    return None


def keep_for_restart(session: RouteSession, failure: RouteFailure, history: int,
                     generated: int) -> tuple[list[KeepHop], int]:
    """The hops of a lost route a restart may continue on, and the history positions they
    keep: every hop but the one the failure names as lost, keeping all of the history but its
    last token, once the session has generated any. Each of those hops then computed that
    history's rows and sent them on (else the tail could not have sampled the last token), so
    its Hot KV State holds them; the new route sends the last token through every hop. None
    for a failure in prefill, a restart's rebuild included (a hop may hold only part of the
    history then), nor when the failure does not say which hop was lost (a stall)."""
    if (not generated or failure.phase != "decode" or failure.code not in ("hop_lost", "moved")
            or not failure.node_id or history < 2):
        return [], 0
    keep = [KeepHop(node_id=h.node_id, session_id=session.session_id, layer_start=h.layer_start,
                    layer_end=h.layer_end) for h in session.hops if h.node_id != failure.node_id]
    return (keep, history - 1) if keep else ([], 0)


def may_move(*, phase: Phase, generated: int, restarts_allowed: bool, keep: bool, moves: int,
             prompt_tokens: int = 0, max_tokens: int | None = None) -> bool:
    """Whether a session may follow a tracker's order to move off a hop now: it decodes (a
    move keeps the other hops' Hot KV State, which needs the whole prompt there), it has a token
    (so that state holds the history), restarts are on for it (a client that turned them off
    keeps its route) and so are Kept Hops (else a move would re-prefill every hop), it moved
    fewer than MAX_MOVES times, and it has enough left to run (`worth_moving`)."""
    return (phase is Phase.DECODE and generated > 0 and restarts_allowed and keep and moves < MAX_MOVES
            and (max_tokens is None or worth_moving(prompt_tokens + generated, max_tokens - generated)))


def worth_moving(history: int, left: int) -> bool:
    """Whether a session with `history` rows and at most `left` tokens to come gains from a move
    (pure). The move's pause is the moved range prefilling the history again; where the answer
    has less left than MOVE_LEFT_RATIO of its history, that pause outlasts the rest of the answer
    (a prefill row costs about a quarter of a decode step on the bundled model: 180 rows in 1.2 s,
    40 tok/s). Before, a session restarted after a loss was ordered off the survivor with 21 of
    300 tokens to go and paused 2.8 s for them."""
    return left >= history * MOVE_LEFT_RATIO


def may_restart(failure: RouteFailure, *, restarts: int, max_restarts: int) -> bool:
    """Whether a session that failed this way moves to a new route: its restarts so far are
    under the bound, and the failure is a lost or broken hop, not a protocol error."""
    return restarts < max_restarts and failure.code not in NOT_RESTARTABLE


# -- the transition -------------------------------------------------------------------------------

Step = tuple[SessionRecord, list[Action]]


def step(r: SessionRecord, event: Event, limits: Limits) -> Step:
    """The session's next record and what to do, for one event."""
    if r.phase.terminal or (r.phase is Phase.FINALIZING and not isinstance(event, Finalized | ClientGone)):
        return r, []  # the answer is decided: what the route still says no longer matters
    match event:
        case Queued():
            return replace(r, phase=Phase.QUEUED), []
        case Routing():
            return replace(r, phase=Phase.ROUTING), []
        case RouteGranted(session):
            first = r.routes == 0
            kept = tuple(h.node_id for h in session.hops if h.keep_session)
            phase = Phase.PREFILL if first else r.phase
            return replace(r, phase=phase, session=session, routes=r.routes + 1), [StartRoute(session, kept)]
        case TokenArrived():
            return _token(r, event, limits)
        case RunEnded():
            assert r.session is not None
            failure = RouteFailure(session_id=r.session.session_id, route_id=r.session.route_id, phase="decode",
                                   reason="the route's Decode Run ended before a stop condition", code="route_failed")
            return _failed(r, failure)
        case RouteFailed(failure, at):
            return _route_failed(r, failure, at, limits)
        case RouteRefused(message):
            return _refused(r, message, limits)
        case RouteBroken(failure):
            return _failed(r, failure)
        case Finalized():
            return replace(r, phase=Phase.COMPLETED), []
        case MoveOrdered(failure):
            allowed = limits.can_reroute and limits.max_restarts > 0
            if may_move(phase=r.phase, generated=r.generated, restarts_allowed=allowed, keep=limits.keep,
                        moves=r.moves, prompt_tokens=r.prompt_tokens, max_tokens=limits.max_tokens):
                return r, [Interrupt(failure)]
            return r, [MoveDeclined()]
        case RouteAborted(failure) | Stalled(failure):
            return r, [Interrupt(failure)]
        case ClientGone(reason):
            return replace(r, phase=Phase.FAILED), [Fail(None, reason, r.phase, gone=True)]
    raise TypeError(f"unknown event {event!r}")


def _token(r: SessionRecord, e: TokenArrived, limits: Limits) -> Step:
    actions: list[Action] = []
    if r.lost_at is not None:  # the new route's first token: the restart (or move) is done
        actions.append(Resumed(r.phase is Phase.MOVING, max(0.0, e.at - r.lost_at)))
    generated = r.generated + (not e.eog)
    if not e.eog:
        actions.append(EmitToken())
    finish = finish_reason_for(token_is_eog=e.eog, stopped=e.stopped, generated=generated,
                               max_tokens=limits.max_tokens)
    r = replace(r, phase=Phase.DECODE, generated=generated, lost_at=None, asked=None)
    if finish is None:
        return r, actions
    return replace(r, phase=Phase.FINALIZING, finish=finish), [*actions, StopRoute(), Finish(finish)]


def _failed(r: SessionRecord, failure: RouteFailure) -> Step:
    last = Phase(failure.phase) if failure.phase in Phase.__members__.values() else r.phase
    began = r.lost_at is not None
    return replace(r, phase=Phase.FAILED, failure=failure), [
        Fail(failure, failure.reason, last, restart_failed=began, move=r.phase is Phase.MOVING)]


def _route_failed(r: SessionRecord, failure: RouteFailure, at: float, limits: Limits) -> Step:
    failure = failure.model_copy(update={"restarts": r.restarts})
    move = failure.code == "moved" and r.lost_at is None and limits.can_reroute
    if not move and not (limits.can_reroute and may_restart(failure, restarts=r.restarts,
                                                             max_restarts=limits.max_restarts)):
        if r.restarts:
            failure = failure.model_copy(update={
                "reason": f"{failure.reason} (after {r.restarts} restart(s), at most {limits.max_restarts})"})
        return _failed(r, failure)
    assert r.session is not None
    moving = move or r.phase is Phase.MOVING
    restarts = r.restarts + (not move)
    history = r.prompt_tokens + r.generated
    keep, keep_position = keep_for_restart(r.session, failure, history, r.generated) if limits.keep else ([], 0)
    # only the hop just lost: one lost earlier may be back (the tracker knows which nodes are
    # alive, and keeps a reported one out until it is heard from)
    excluded = frozenset({failure.node_id} if failure.node_id else ())
    ask = AskRoute(failure, r.routes + 1, excluded, tuple(keep), keep_position, move)
    r = replace(r, phase=Phase.MOVING if moving else Phase.RESTARTING, restarts=restarts, moves=r.moves + move,
                lost_at=r.lost_at if r.lost_at is not None else at, failure=failure, asked=ask)
    return r, [ask]


def _refused(r: SessionRecord, message: str, limits: Limits) -> Step:
    ask = r.asked
    assert ask is not None
    failure = ask.failure
    if ask.excluded:
        # nowhere else to go: a route that may take the node it left again, one that is alive
        # (it answered: a busy head that had not yet seen the route's open directive), or one
        # whose connection broke while the node lives (a reset link: the tracker routes through
        # it again once it is heard from, a dead node it never routes through again)
        again = replace(ask, excluded=frozenset(), any_route=True)
        return replace(r, asked=again), [again]
    if ask.move:
        reason = f"{failure.reason}; the move found no new route: {message}"
        return _failed(r, failure.model_copy(update={"code": "route_failed", "reason": reason}))
    reason = f"{failure.reason}; restart {r.restarts} of {limits.max_restarts} found no new route: {message}"
    return _failed(r, failure.model_copy(update={"restarts": r.restarts, "reason": reason}))
