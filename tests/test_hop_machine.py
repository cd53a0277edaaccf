"""The node's session machine: table-driven tests of the pure `transition` (no I/O, no clock)."""

from __future__ import annotations

import pytest

from nodes.server.hop_machine import (
    Adopted,
    End,
    Freed,
    HopLife,
    HopPhase,
    PromptIn,
    RunIn,
    RunOut,
    StreamIn,
    StreamOut,
    parks,
    transition,
)
from schemas.route import RouteFailure

P = HopPhase


def lost(node: str | None = "other", code: str = "hop_lost") -> RouteFailure:
    return RouteFailure(session_id="s", route_id="r", phase="decode", hop_index=0 if node else None, node_id=node,
                        reason=f"{code} at {node}", code=code)  # type: ignore[arg-type]


def at(phase: HopPhase) -> HopLife:
    return HopLife(phase=phase)


PARKED = HopLife(P.PARKED, P.ABORTED, "head lost", lost(), 50.0)
LOST = End(P.ABORTED, "head lost", lost(), "me", keep_until=50.0)  # another hop lost: may park

CASES = [
    # (name, record, event, phase after, how it ended after)
    ("the prompt's last chunk", at(P.PREFILL), PromptIn(), P.DECODING, None),
    ("a Decode Run starts", at(P.DECODING), RunIn(), P.RUNNING, None),
    ("the Decode Run ends", at(P.RUNNING), RunOut(), P.DECODING, None),
    ("a lane takes the session", at(P.DECODING), StreamIn(), P.STREAMING, None),
    ("the lane lets go", at(P.STREAMING), StreamOut(), P.DECODING, None),
    ("a stream's end outside a stream", at(P.DECODING), StreamOut(), P.DECODING, None),
    ("a frame's end outside a run", at(P.DECODING), RunOut(), P.DECODING, None),
    ("a close", at(P.DECODING), End(P.CLOSED, "done"), P.CLOSED, P.CLOSED),
    ("an idle expiry", at(P.PREFILL), End(P.EXPIRED, "idle"), P.EXPIRED, P.EXPIRED),
    ("a plain abort", at(P.DECODING), End(P.ABORTED, "client gone", node_id="me", keep_until=50.0), P.ABORTED,
     P.ABORTED),
    ("another hop lost in decode", at(P.DECODING), LOST, P.PARKED, P.ABORTED),
    ("another hop lost in a Decode Run", at(P.RUNNING), LOST, P.PARKED, P.ABORTED),
    ("another hop lost in a lane", at(P.STREAMING), LOST, P.PARKED, P.ABORTED),
    ("the next hop unreachable", at(P.DECODING), End(P.FAILED, "unreachable", lost("next"), "me", 50.0), P.PARKED,
     P.FAILED),
    ("another hop lost in prefill", at(P.PREFILL), LOST, P.ABORTED, P.ABORTED),
    ("this node named as the lost one", at(P.DECODING), End(P.ABORTED, "lost", lost("me"), "me", 50.0), P.ABORTED,
     P.ABORTED),
    ("a node that keeps nothing", at(P.DECODING), End(P.ABORTED, "lost", lost(), "me", None), P.ABORTED, P.ABORTED),
    ("never parks when told", at(P.DECODING), End(P.ABORTED, "lost", lost(), "me", 50.0, park=False), P.ABORTED,
     P.ABORTED),
    ("a restart continuing it parks it", at(P.DECODING), End(P.ABORTED, "continued", None, "me", 50.0, park=True),
     P.PARKED, P.ABORTED),
    ("a restart takes the parked state", PARKED, Adopted(), P.ABORTED, P.ABORTED),
    ("the parked state is freed", PARKED, Freed(), P.ABORTED, P.ABORTED),
]


@pytest.mark.parametrize(("name", "record", "event", "phase", "ended"), CASES, ids=[c[0] for c in CASES])
def test_transition(name: str, record: HopLife, event: object, phase: HopPhase, ended: HopPhase | None) -> None:
    after = transition(record, event)  # type: ignore[arg-type]
    assert (after.phase, after.ended) == (phase, ended)
    assert (after.kept_until is not None) == (phase is P.PARKED)
    assert after.status == ("open" if ended is None else ended.value)


IGNORED = [
    # (name, record, event): the record stays the same object
    ("a second end", at(P.CLOSED), End(P.ABORTED, "late")),
    ("an end of a parked session", PARKED, End(P.CLOSED, "shutdown")),
    ("a stream that lets go after the end", at(P.FAILED), StreamOut()),
    ("a stream that begins after the end", at(P.ABORTED), StreamIn()),
    ("a restart reaching for freed state", at(P.ABORTED), Adopted()),
    ("a second free", at(P.FAILED), Freed()),
    ("an open session is not freed", at(P.DECODING), Freed()),
    ("a Decode Run during prefill", at(P.PREFILL), RunIn()),
    ("a second prompt end", at(P.DECODING), PromptIn()),
]


@pytest.mark.parametrize(("name", "record", "event"), IGNORED, ids=[c[0] for c in IGNORED])
def test_an_event_that_does_not_apply_changes_nothing(name: str, record: HopLife, event: object) -> None:
    assert transition(record, event) is record  # type: ignore[arg-type]


def test_an_end_keeps_why_and_the_failure() -> None:
    after = transition(at(P.RUNNING), LOST)
    assert (after.reason, after.failure, after.kept_until) == ("head lost", lost(), 50.0)
    freed = transition(after, Freed())
    assert (freed.reason, freed.failure, freed.kept_until) == ("head lost", lost(), None)


def test_a_session_ends_only_as_an_ending() -> None:
    with pytest.raises(ValueError):
        transition(at(P.DECODING), End(P.PARKED, "no"))


def test_phase_properties() -> None:
    assert [p for p in P if p.open] == [P.PREFILL, P.DECODING, P.RUNNING, P.STREAMING]
    assert [p for p in P if p.decoding] == [P.DECODING, P.RUNNING, P.STREAMING]
    assert [p for p in P if p.holds_steps] == [P.RUNNING, P.STREAMING]


def test_only_a_session_that_lost_another_hop_parks() -> None:
    assert parks(P.ABORTED, lost("other"), "me")
    assert parks(P.FAILED, lost("other"), "me")
    assert not parks(P.ABORTED, lost("me"), "me")  # this node is the lost one: free it
    assert not parks(P.CLOSED, lost("other"), "me")
    assert not parks(P.ABORTED, lost("other", "session_aborted"), "me")
    assert not parks(P.ABORTED, lost(None), "me")
    assert not parks(P.ABORTED, None, "me")
