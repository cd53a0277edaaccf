"""Frame admission: the checks a hop makes on a frame header before reading or running anything."""

from __future__ import annotations

from dataclasses import dataclass

from schemas.credentials import CREDENTIAL_HEADER, CREDENTIAL_TTL_S, credential_matches
from schemas.frames import FrameError, FrameHeader, has_credit


@dataclass(frozen=True, slots=True)
class SessionView:
    """What admission needs to know about one open Route Session on this hop."""

    route_id: str
    epoch: int
    hop_index: int
    next_seq: int
    next_position: int
    credit: int
    decoding: bool  # the final prefill frame has been accepted
    running: bool  # a Decode Run (or its lane, after the head) holds the session until it ends
    is_head: bool
    hidden_size: int
    n_ctx: int
    # the earliest position a decode frame may start at: next_position, or after a verify step
    # the position after its first row (a step may drop the drafts the tail did not keep)
    rewind_floor: int = -1


def check_credential(expected: str, expires_at: int, presented: str | None, now: float) -> FrameError | None:
    """The refusal for a request to a session without that session's credential for this hop
    and epoch, or after it expired; None when it may go on. Checked before anything else, so a
    sender without the credential learns nothing about the session's state."""
    if not credential_matches(presented, expected):
        what = "no" if not presented else "a wrong"
        return FrameError(code="bad_credential", message=f"{what} {CREDENTIAL_HEADER} for this session, epoch and hop")
    if now >= expires_at:  # stamped on the tracker's clock, read on this node's
        return FrameError(code="bad_credential", message=(
            f"this session's credentials have expired: at {expires_at} (unix s), {now - expires_at:.0f} s ago by "
            f"this node's clock (they last {CREDENTIAL_TTL_S} s from the tracker's; a node clock that far ahead "
            "of the tracker's expires them early)"))
    return None


def check_frame(view: SessionView, h: FrameHeader) -> FrameError | None:
    """Return the typed error for a frame this hop must refuse, or None to accept it."""
    if h.route_id != view.route_id:
        return FrameError(code="route_mismatch", message=f"session is on route {view.route_id}",
                          expected={"route_id": view.route_id})
    if h.epoch != view.epoch:
        return FrameError(code="epoch_mismatch", message=f"session is at epoch {view.epoch}",
                          expected={"epoch": view.epoch})
    if h.hop != view.hop_index:
        return FrameError(code="hop_mismatch", message=f"this node is hop {view.hop_index}",
                          expected={"hop": view.hop_index})
    if view.running:
        return FrameError(code="session_busy", message="a Decode Run is in progress on this session; "
                          "wait for its last event")
    if h.seq != view.next_seq:
        return FrameError(code="seq_mismatch", message=f"expected frame {view.next_seq}, got {h.seq}",
                          expected={"seq": view.next_seq})
    if not has_credit(h.seq, view.credit):
        return FrameError(code="no_credit", message=f"credit allows seq < {view.credit}",
                          expected={"credit": view.credit})
    if h.position != view.next_position and not (h.phase == "decode" and rewinds(view, h.position)):
        return FrameError(code="position_mismatch",
                          message=f"expected position {view.next_position}, got {h.position}",
                          expected={"position": view.next_position})
    return _check_phase(view, h) or _check_shape(view, h)


def rewinds(view: SessionView, position: int) -> bool:
    """Whether a decode step at `position` starts back where a verify step's kept rows end,
    dropping the rest."""
    return 0 <= view.rewind_floor <= position < view.next_position


def _check_phase(view: SessionView, h: FrameHeader) -> FrameError | None:
    if view.decoding and h.phase == "prefill":
        return FrameError(code="phase_mismatch", message="prefill is over; send decode frames",
                          expected={"phase": "decode"})
    if not view.decoding and h.phase == "decode":
        return FrameError(code="phase_mismatch", message="prefill has not finished",
                          expected={"phase": "prefill"})
    if h.phase == "decode" and (h.n_rows != 1 or not h.final):
        return FrameError(code="bad_frame", message="a decode frame is one final row")
    if h.draft and h.phase != "decode":
        return FrameError(code="bad_frame", message="draft (drafted tokens per step) is for a Decode Run or a lane")
    if h.steps > 1 and not h.is_run:
        return FrameError(code="bad_frame", message="steps > 1 is for a Decode Run (a decode frame to the head)",
                          expected={"steps": 1})
    if h.is_run and not view.is_head:
        return FrameError(code="bad_frame", message="a decode frame is a Decode Run, to the head; past it "
                                                    "decode steps travel as lanes of a Seam Link")
    if h.stream and (h.phase != "decode" or view.is_head):
        return FrameError(code="bad_frame", message="a lane carries one-row decode steps to a hop after the head")
    if h.direct and not h.stream:
        return FrameError(code="bad_frame", message="only a lane's steps return directly (direct needs stream)")
    if h.is_run and h.position + h.steps > view.n_ctx:
        return FrameError(code="bad_frame",
                          message=f"a Decode Run of {h.steps} steps from position {h.position} would pass "
                                  f"the context size {view.n_ctx}", expected={"n_ctx": view.n_ctx})
    return None


def _check_shape(view: SessionView, h: FrameHeader) -> FrameError | None:
    if view.is_head and (h.dtype != "i32" or h.width != 1):
        return FrameError(code="bad_frame", message="a head shard takes int32 token ids (width 1)",
                          expected={"dtype": "i32", "width": 1})
    if not view.is_head and (h.dtype == "i32" or h.width != view.hidden_size):
        return FrameError(code="bad_frame",
                          message=f"this shard takes float hidden rows of width {view.hidden_size}",
                          expected={"width": view.hidden_size})
    if h.position + h.n_rows > view.n_ctx:
        return FrameError(code="bad_frame", message=f"frame would pass the context size {view.n_ctx}",
                          expected={"n_ctx": view.n_ctx})
    return None
