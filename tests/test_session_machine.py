"""The gateway's session machine: table-driven tests of the pure `step` (no I/O, no clock)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gateway.session_machine import (
    AskRoute,
    ClientGone,
    EmitToken,
    Fail,
    Finalized,
    Finish,
    Interrupt,
    Limits,
    MoveDeclined,
    MoveOrdered,
    Phase,
    Resumed,
    RouteAborted,
    RouteFailed,
    RouteGranted,
    RouteRefused,
    RunEnded,
    SessionRecord,
    Stalled,
    StartRoute,
    StopRoute,
    TokenArrived,
    step,
)
from schemas.route import Hop, RouteFailure, RouteSession


def route(route_id: str = "r1", *, kept: tuple[str, ...] = ()) -> RouteSession:
    hops = [Hop(node_id=n, activation_url="http://127.0.0.1:9", layer_start=a, layer_end=b,
                keep_session="s" if n in kept else "")
            for n, (a, b) in {"head": (0, 15), "tail": (15, 30)}.items()]
    return RouteSession(session_id="s", route_id=route_id, model="m", model_revision="m", cache_abi="c",
                        n_layer=30, hidden_size=8, n_ctx=256, hops=hops)


def failure(code: str = "hop_lost", node: str | None = "tail", phase: str = "decode") -> RouteFailure:
    return RouteFailure(session_id="s", route_id="r1", phase=phase, hop_index=1 if node else None, node_id=node,
                        reason=f"{code} at {node}", code=code)  # type: ignore[arg-type]


LIMITS = Limits(max_tokens=4, max_restarts=2, can_reroute=True, keep=True)
DECODING = SessionRecord(phase=Phase.DECODE, session=route(), routes=1, prompt_tokens=5, generated=2)
RESTARTING = replace(DECODING, phase=Phase.RESTARTING, restarts=1, lost_at=10.0, failure=failure())
MOVING = replace(DECODING, phase=Phase.MOVING, moves=1, lost_at=10.0, failure=failure("moved"))
TOKEN = TokenArrived(eog=False, stopped=False, at=12.0)

CASES = [
    # (name, record, event, limits, phase after, action types)
    ("first route", SessionRecord(phase=Phase.ROUTING), RouteGranted(route()), LIMITS, Phase.PREFILL, [StartRoute]),
    ("prefill's token", replace(DECODING, phase=Phase.PREFILL, generated=0), TOKEN, LIMITS, Phase.DECODE,
     [EmitToken]),
    ("a token", DECODING, TOKEN, LIMITS, Phase.DECODE, [EmitToken]),
    ("the last allowed token", replace(DECODING, generated=3), TOKEN, LIMITS, Phase.FINALIZING,
     [EmitToken, StopRoute, Finish]),
    ("end of generation", DECODING, TokenArrived(eog=True, stopped=False, at=1.0), LIMITS, Phase.FINALIZING,
     [StopRoute, Finish]),
    ("a stop string", DECODING, TokenArrived(eog=False, stopped=True, at=1.0), LIMITS, Phase.FINALIZING,
     [EmitToken, StopRoute, Finish]),
    ("finalized", replace(DECODING, phase=Phase.FINALIZING), Finalized(), LIMITS, Phase.COMPLETED, []),
    ("the run ends early", DECODING, RunEnded(), LIMITS, Phase.FAILED, [Fail]),
    ("a lost hop restarts", DECODING, RouteFailed(failure(), 10.0), LIMITS, Phase.RESTARTING, [AskRoute]),
    ("restarts off", DECODING, RouteFailed(failure(), 10.0), replace(LIMITS, max_restarts=0), Phase.FAILED, [Fail]),
    ("no rerouter", DECODING, RouteFailed(failure(), 10.0), replace(LIMITS, can_reroute=False), Phase.FAILED,
     [Fail]),
    ("restarts used up", replace(DECODING, restarts=2), RouteFailed(failure(), 10.0), LIMITS, Phase.FAILED, [Fail]),
    ("a protocol error never restarts", DECODING, RouteFailed(failure("seq_mismatch"), 10.0), LIMITS, Phase.FAILED,
     [Fail]),
    ("a restart's route granted", RESTARTING, RouteGranted(route("r2", kept=("head",))), LIMITS, Phase.RESTARTING,
     [StartRoute]),
    ("a restart's first token", RESTARTING, TOKEN, LIMITS, Phase.DECODE, [Resumed, EmitToken]),
    ("a move ordered in decode", DECODING, MoveOrdered(failure("moved")), LIMITS, Phase.DECODE, [Interrupt]),
    ("a move ordered in prefill", replace(DECODING, phase=Phase.PREFILL, generated=0),
     MoveOrdered(failure("moved")), LIMITS, Phase.PREFILL, [MoveDeclined]),
    ("a move ordered with restarts off", DECODING, MoveOrdered(failure("moved")),
     replace(LIMITS, max_restarts=0), Phase.DECODE, [MoveDeclined]),
    ("a move ordered after two moves", replace(DECODING, moves=2), MoveOrdered(failure("moved")), LIMITS,
     Phase.DECODE, [MoveDeclined]),
    ("a move ordered without kept hops", DECODING, MoveOrdered(failure("moved")), replace(LIMITS, keep=False),
     Phase.DECODE, [MoveDeclined]),
    # 279 of 300 tokens given on a 60-token prompt: the move's re-prefill of 339 rows would
    # pause the stream longer than its last 21 tokens take
    ("a move ordered near the end", replace(DECODING, prompt_tokens=60, generated=279),
     MoveOrdered(failure("moved")), replace(LIMITS, max_tokens=300), Phase.DECODE, [MoveDeclined]),
    ("a move ordered with much left", replace(DECODING, prompt_tokens=60, generated=100),
     MoveOrdered(failure("moved")), replace(LIMITS, max_tokens=300), Phase.DECODE, [Interrupt]),
    ("the moved route fails", DECODING, RouteFailed(failure("moved"), 10.0), LIMITS, Phase.MOVING, [AskRoute]),
    ("a move's first token", MOVING, TOKEN, LIMITS, Phase.DECODE, [Resumed, EmitToken]),
    ("the tracker aborts the route", DECODING, RouteAborted(failure()), LIMITS, Phase.DECODE, [Interrupt]),
    ("a stall", DECODING, Stalled(failure("hop_stalled", None)), LIMITS, Phase.DECODE, [Interrupt]),
    ("the client leaves", DECODING, ClientGone(), LIMITS, Phase.FAILED, [Fail]),
    ("nothing after the end", replace(DECODING, phase=Phase.COMPLETED), TOKEN, LIMITS, Phase.COMPLETED, []),
    ("nothing after a failure", replace(DECODING, phase=Phase.FAILED), ClientGone(), LIMITS, Phase.FAILED, []),
    ("a late end of the run while finalizing", replace(DECODING, phase=Phase.FINALIZING), RunEnded(), LIMITS,
     Phase.FINALIZING, []),
]


@pytest.mark.parametrize(("record", "event", "limits", "phase", "kinds"),
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_step(record: SessionRecord, event: object, limits: Limits, phase: Phase, kinds: list[type]) -> None:
    after, actions = step(record, event, limits)  # type: ignore[arg-type]
    assert after.phase is phase
    assert [type(a) for a in actions] == kinds


def test_a_restart_leaves_the_lost_hop_out_and_keeps_the_others() -> None:
    after, [ask] = step(DECODING, RouteFailed(failure(), 10.0), LIMITS)
    assert isinstance(ask, AskRoute)
    assert ask.epoch == 2 and ask.excluded == {"tail"} and not ask.move
    assert [k.node_id for k in ask.keep] == ["head"] and ask.keep_position == 5 + 2 - 1
    assert after.restarts == 1 and after.lost_at == 10.0 and after.failure is not None
    assert after.failure.restarts == 0  # the failure says how many restarts came before it


def test_a_stall_keeps_no_hop() -> None:
    _, [ask] = step(DECODING, RouteFailed(failure("hop_stalled", None), 10.0), LIMITS)
    assert isinstance(ask, AskRoute) and ask.keep == () and ask.excluded == frozenset()


def test_a_failed_restart_route_keeps_the_first_loss_time() -> None:
    after, [ask] = step(replace(RESTARTING, routes=2), RouteFailed(failure(), 14.0), LIMITS)
    assert isinstance(ask, AskRoute) and ask.epoch == 3
    assert after.restarts == 2 and after.lost_at == 10.0


def test_a_move_is_no_restart_and_takes_any_route_when_none_avoids_the_node() -> None:
    moving, [ask] = step(DECODING, RouteFailed(failure("moved"), 10.0), LIMITS)
    assert isinstance(ask, AskRoute) and ask.move and ask.excluded == {"tail"}
    assert moving.restarts == 0 and moving.moves == 1 and moving.phase is Phase.MOVING
    again, [any_route] = step(moving, RouteRefused("full"), LIMITS)
    assert isinstance(any_route, AskRoute) and any_route.excluded == frozenset() and any_route.keep == ask.keep
    failed, [fail] = step(again, RouteRefused("still full"), LIMITS)
    assert failed.phase is Phase.FAILED and isinstance(fail, Fail)
    assert fail.failure is not None and fail.failure.code == "route_failed" and fail.restart_failed and fail.move
    assert "the move found no new route: still full" in fail.reason


def test_a_restart_that_finds_no_route_fails_and_says_which_restart() -> None:
    restarting, _ = step(DECODING, RouteFailed(failure(), 10.0), LIMITS)
    # a lost hop is asked for again once no route avoids it (its node may live: a link reset)
    again, [any_route] = step(restarting, RouteRefused("no coverage"), LIMITS)
    assert isinstance(any_route, AskRoute) and any_route.excluded == frozenset() and any_route.any_route
    failed, [fail] = step(again, RouteRefused("no coverage"), LIMITS)
    assert failed.phase is Phase.FAILED and isinstance(fail, Fail) and fail.restart_failed and not fail.move
    assert fail.reason.endswith("restart 1 of 2 found no new route: no coverage")


def test_the_last_failure_says_how_many_restarts_came_before() -> None:
    _, [fail] = step(replace(DECODING, restarts=2), RouteFailed(failure(), 10.0), LIMITS)
    assert isinstance(fail, Fail) and fail.reason.endswith("(after 2 restart(s), at most 2)")


def test_resumed_counts_the_time_since_the_loss() -> None:
    _, actions = step(MOVING, TOKEN, LIMITS)
    assert actions[0] == Resumed(move=True, seconds=2.0)


def test_the_public_phase_of_a_move_is_restarting() -> None:
    assert Phase.MOVING.public == "restarting" and Phase.DECODE.public == "decode"


def test_a_busy_hop_that_had_not_seen_the_open_may_serve_the_restart() -> None:
    """A head that got the first frame before the route's open directive (a busy node) fails
    the session with unknown_session while alive: when no route avoids it, the restart takes
    any route, that node included, instead of failing the request."""
    restarting, [ask] = step(replace(DECODING, phase=Phase.PREFILL, generated=0),
                             RouteFailed(failure("unknown_session", "head", "prefill"), 10.0), LIMITS)
    assert isinstance(ask, AskRoute) and ask.excluded == {"head"}
    again, [any_route] = step(restarting, RouteRefused("missing layers [0,15)"), LIMITS)
    assert isinstance(any_route, AskRoute) and any_route.excluded == frozenset() and any_route.any_route
    assert again.phase is Phase.RESTARTING and again.restarts == 1
    _, [start] = step(again, RouteGranted(route("r2")), LIMITS)
    assert isinstance(start, StartRoute) and start.session.route_id == "r2"  # (restarting until its first token)
