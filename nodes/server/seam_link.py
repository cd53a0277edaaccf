"""The receiving end of a Seam Link: LinkIn, one per link, and LaneIn, one per lane on it.

One POST /v1/links from the previous hop's node carries the decode steps of every session
routed from it to this node (docs/activation-protocol.md, "Seam Links"; the sender is
wire.seam_link). Each chunk of its body is one message: the parts the sender's iteration
produced, taken here in one pass, so the scheduler's next iteration runs them as one batch. A
lane is one session's Decode Run: its opening part carries the run's FrameHeader (with `stream`)
and this hop's credential for the session, admitted once as a frame's header would be; each
step is then checked against the session (still open, seq and position where the lane left
them, no more steps in flight than the lane's window, the context not passed, the part's size
one step) and runs through the session like a frame (HopSession.accept). Each step is answered by one event of the lane,
`{"result": ...}` with the tail's token, or, on a `direct` lane (a route of 3 or more hops), by
nothing: the tail writes the token to the head's Return Stream (nodes/server/return_stream.py).
On a speculative lane (`draft` > 0) each step says its position (which may go back inside an
earlier verify step, to where its kept tokens end), its guess and its drafted ids
(schemas.frames.step_chunk); up to SPEC_DEPTH steps may be in flight (pipelined verify steps).
The sender ends the lane when the run ends; the hop answers with `{"end": true, "credit",
"done"}` as the lane's last event.

A step that cannot run ends its lane with `{"error": FrameError}`, a broken route with
`{"failure": RouteFailure}`: that session alone; the link and its other lanes go on. A message
that does not parse ends every lane and the connection. While a lane is open it holds the
session: any other frame is refused (`session_busy`), as during a Decode Run on the head.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from nodes.server.admission import rewinds
from nodes.server.frame_plane import Admitted, run_event
from nodes.server.return_stream import Attached
from nodes.server.session import HopSession
from schemas.frames import (
    LANE_END,
    LANE_OPEN,
    LANE_RETURN,
    LANE_STEP,
    LINK_PART,
    MAX_LINK_MESSAGE,
    SPEC_DEPTH,
    FrameError,
    FrameFormatError,
    FrameHeader,
    HopMark,
    RunEvent,
    WireResult,
    decode_rows,
    link_answer,
    lost_hop_of,
    parse_lane_open,
    parse_link_message,
    parse_step_chunk,
    run_token_bytes,
    split_upstream,
)
from schemas.route import RouteFailure
from wire.server import RunStream

log = logging.getLogger("meshnet.node.link")

_FAILING: set[asyncio.Task[None]] = set()  # sessions failing because their lane's link was lost


class LaneIn:
    """One lane on this hop: takes each step's payload, runs it through the session, and
    writes its answer; the owner (the link) feeds steps and reports the lane's end or the
    connection's loss."""

    def __init__(self, hs: HopSession, header: FrameHeader, max_chunk: int, answer: RunStream) -> None:
        self.hs = hs
        self.header = header
        self.max_chunk = max_chunk  # the most bytes one step's payload may carry
        self.answer = answer
        self.seq = header.seq
        self.position = header.position
        self.in_flight = 0
        # A speculative lane's head pipelines up to SPEC_DEPTH verify steps. A direct step's
        # answer (the tail's token) reaches the sender by another path, and can outrun this
        # hop's own bookkeeping of the step it forwarded: the next step may then arrive first,
        # and queues behind it in the session.
        self.window = (SPEC_DEPTH if header.draft else 1) + (1 if header.direct else 0)
        self.ending = False  # the sender ended its body
        self.over = False  # the stream no longer holds the session
        hs.begin_stream()
        if header.direct:
            answer.start()  # no step is answered here: the sender's request returns on the head alone

    def step(self, payload: bytes, wire_bytes: int) -> None:
        """One part: one decode step's rows."""
        if self.over:
            return
        hs = self.hs
        if not hs.open:
            failure = hs.failure
            self._stop(RunEvent(failure=failure) if failure is not None else RunEvent(error=FrameError(
                code="session_closed", message=f"session {hs.life.status}: {hs.life.reason}")))
            return
        if self.in_flight >= self.window:
            many = "one step" if self.window == 1 else f"{self.window} steps"
            self.refuse(f"a lane carries at most {many} in flight: send the next after an answer")
            return
        if len(payload) > self.max_chunk:
            self.refuse(f"a step over {self.max_chunk} bytes")
            return
        try:
            marks: list[HopMark] = []
            if self.header.direct:  # the middle hops' timings, which the tail's answer carries to the head
                marks, payload = split_upstream(payload, self.header.hop)
            if self.header.draft:  # a speculative stream: each step says where it starts, and its drafts
                position, guess, drafts, rows = parse_step_chunk(self.header, payload)
            else:
                position, guess, drafts, rows = self.position, -1, [], decode_rows(self.header, payload)
        except FrameFormatError as exc:
            self.refuse(str(exc))
            return
        if self.seq != hs.next_seq or not (position == hs.next_position or rewinds(hs.view(), position)):
            self.refuse(f"step {self.seq} at position {position}, but the session is at frame {hs.next_seq} "
                        f"and position {hs.next_position}", code="seq_mismatch")
            return
        if position + len(rows) > hs.cfg.n_ctx:
            self.refuse(f"step would pass the context size {hs.cfg.n_ctx}")
            return
        seq = self.seq
        self.seq += 1
        self.position = position + len(rows)
        self.in_flight += 1
        hs.accept(self.header, rows, wire_bytes, len(payload), reply=self._answered, seq=seq, position=position,
                  drafts=drafts or None, guess=guess, upstream=marks)

    def _answered(self, outcome: WireResult | RouteFailure | None) -> None:
        self.in_flight -= 1
        if isinstance(outcome, RouteFailure):
            self._stop(RunEvent(failure=outcome))
            return
        if outcome is not None and self.header.direct:  # direct return: the tail's token goes to the head
            self.hs.token_return.send(run_token_bytes(outcome))
        if self.over:
            return
        if outcome is not None and not self.header.direct and not self.answer.send([run_token_bytes(outcome)]):
            self._release()  # the sender is gone
        elif self.ending and not self.in_flight:
            self._finish()

    def end(self) -> None:
        """The sender ended the lane: end its answers once every step is answered."""
        self.ending = True
        if not self.in_flight and not self.over:
            self._finish()

    def lost(self, lost_hop: int | None = None) -> None:
        """The connection closed (or, `lost_hop`, the previous hop's own feed was lost after
        that hop: LANE_LOST): the lane lets go of the session. On a direct lane the loss goes
        on: a middle hop ends its lane to the next hop as lost, and the route's tail fails the
        session naming the hop before the broken link (`hop_lost`), so its Return Stream tells
        the head at once: otherwise nobody hears of it (the head waits on the tail's tokens,
        the hops before the break on the head's next step) until the gateway's stall deadline."""
        if self.over:
            return
        hs = self.hs
        lost = hs.hop_index - 1 if lost_hop is None else lost_hop
        if self.header.direct and not hs.is_tail and hs.open:
            hs.end_stream_out(lost)
        self._release()
        if self.header.direct and hs.is_tail and hs.open:
            where = "from the previous hop" if lost_hop is None else f"after hop {lost}"
            failure = hs.make_failure(hs.phase, f"the Seam Link {where} broke mid-run", lost, code="hop_lost")
            task = asyncio.get_running_loop().create_task(hs.fail(failure))
            _FAILING.add(task)
            task.add_done_callback(_FAILING.discard)

    def _finish(self) -> None:
        self._release()
        hs = self.hs
        self.answer.end([run_event(RunEvent(end=True, credit=hs.credit, done=hs.done))])

    def refuse(self, message: str, *, code: str = "bad_frame") -> None:
        """End the stream with a refusal (a step that cannot run, or a malformed chunk)."""
        log.warning("session %s: lane refused a step: %s", self.hs.session_id, message)
        self._stop(RunEvent(error=FrameError(code=code, message=message)))  # type: ignore[arg-type]

    def _stop(self, event: RunEvent) -> None:
        self._release()
        self.answer.end([run_event(event)])  # once: a later end is a no-op

    def _release(self) -> None:
        if self.over:
            return
        self.over = True
        self.hs.end_stream()
        self.hs.end_stream_out()  # a middle hop's own lane to the next hop ends with this one


class LaneAnswer:
    """A lane's share of the link's answer (a RunStream): its events, each tagged with the lane."""

    def __init__(self, link: LinkIn, lane: int) -> None:
        self.link = link
        self.lane = lane
        self.started = True
        self.ended = False

    def send(self, events: Sequence[bytes]) -> bool:
        if self.ended or self.link.over:
            return False
        for event in events:
            self.link.emit(link_answer(self.lane, event, False))
        return True

    def start(self) -> bool:
        return not (self.ended or self.link.over)

    def end(self, events: Sequence[bytes]) -> None:
        if self.ended:
            return
        self.ended = True
        *first, last = events or [run_event(RunEvent(end=True))]
        for event in first:
            self.link.emit(link_answer(self.lane, event, False))
        self.link.emit(link_answer(self.lane, last, True))
        self.link.lane_over(self.lane)


class LinkIn:
    """One Seam Link on this node: its messages' parts go to their lanes in one pass; its lanes'
    events go back together, once per turn of the event loop."""

    def __init__(self, admit: Callable[[str, str], Admitted | FrameError],
                 attach_return: Callable[[str, str, RunStream], Attached | FrameError], answer: RunStream,
                 close: Callable[[], None]) -> None:
        self._admit = admit  # a lane's header and credential, admitted as a frame's would be
        self._attach_return = attach_return  # a LANE_RETURN's request and credential: the tail's tokens
        self.answer = answer
        self._close = close  # drops the connection (a message that does not parse)
        self.lanes: dict[int, LaneIn] = {}
        self.returns: dict[int, Attached] = {}  # Return Streams: this tail's tokens for a head
        self.max_chunk = MAX_LINK_MESSAGE
        self.over = False
        self.proven = False  # a lane or Return Stream was admitted (until then the link is held briefly)
        self.ending = False  # the sender ended the link
        self._outbox: list[bytes] = []
        self._flush_due = False
        answer.start()

    def message(self, payload: bytes, wire_bytes: int) -> None:
        """One message: every part goes to its lane now (a step joins the scheduler's next batch)."""
        try:
            parts = parse_link_message(payload)
        except FrameFormatError as exc:
            self.refuse(str(exc))
            return
        framing = wire_bytes - len(payload)  # the chunk's size line: booked to the first part
        for lane_id, kind, data in parts:
            if self.over:
                return  # refused (a lane opened twice): the rest of the message is not read
            nbytes, framing = LINK_PART.size + len(data) + framing, 0
            lane = self.lanes.get(lane_id)
            if kind == LANE_OPEN:
                self._open(lane_id, data, nbytes)
            elif kind == LANE_RETURN:
                self._open_return(lane_id, data)
            elif lane_id in self.returns and kind == LANE_END:
                self._end_return(lane_id)
            elif lane is None:
                continue  # a lane that was refused or ended: its refusal is on its way to the sender
            elif kind == LANE_STEP:
                lane.step(data, nbytes)
            elif (lost := lost_hop_of(data)) is not None:  # the sender's feed was lost: so is this lane's
                lane.lost(lost)
                lane.answer.end([])
            else:
                lane.end()

    def _open(self, lane_id: int, data: bytes, nbytes: int) -> None:
        if lane_id in self.lanes or lane_id in self.returns:
            self.refuse(f"lane {lane_id} opened twice")
            return
        try:
            header, credential, first = parse_lane_open(data)
        except FrameFormatError as exc:
            admitted: Admitted | FrameError = FrameError(code="bad_frame", message=str(exc))
        else:
            admitted = self._admit(header, credential)
        if isinstance(admitted, FrameError):
            self.emit(link_answer(lane_id, run_event(RunEvent(error=admitted)), True))
            return
        self.proven = True
        lane = LaneIn(admitted.session, admitted.header, admitted.length, LaneAnswer(self, lane_id))
        self.lanes[lane_id] = lane
        lane.step(first, nbytes)

    def _open_return(self, lane_id: int, data: bytes) -> None:
        """A head asks for its session's tokens (this node is the route's tail)."""
        if lane_id in self.lanes or lane_id in self.returns:
            self.refuse(f"lane {lane_id} opened twice")
            return
        answer = LaneAnswer(self, lane_id)
        try:
            request, credential, _ = parse_lane_open(data)
        except FrameFormatError as exc:
            attached: Attached | FrameError = FrameError(code="bad_frame", message=str(exc))
        else:
            attached = self._attach_return(request, credential, answer)
        if isinstance(attached, FrameError):
            self.emit(link_answer(lane_id, run_event(RunEvent(error=attached)), True))
            return
        self.proven = True
        if not answer.ended:  # (a session that ended while attaching ended it)
            self.returns[lane_id] = attached

    def _end_return(self, lane_id: int) -> None:
        """The head's run ended: the Return Stream lets go and ends its lane."""
        attached = self.returns.pop(lane_id)
        attached.lost()
        attached.answer.end([run_event(RunEvent(end=True))])

    def emit(self, chunk: bytes) -> None:
        """Queue a lane's event for this turn's write (at once with one lane: nothing to gather)."""
        self._outbox.append(chunk)
        if len(self.lanes) <= 1 and not self._flush_due:
            self._flush()
        elif not self._flush_due:
            self._flush_due = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_due = False
        chunks, self._outbox = self._outbox, []
        if self.over:
            return
        if not self.answer.send(chunks):
            self.lost()  # the sender is gone
        elif self.ending and not (self.lanes or self.returns):
            self.over = True
            self.answer.end([])

    def lane_over(self, lane_id: int) -> None:
        self.lanes.pop(lane_id, None)
        self.returns.pop(lane_id, None)
        if self.ending and not (self.lanes or self.returns) and not self._flush_due:
            self._flush()  # the sender ended the link and this was its last lane: end the answer

    def end(self) -> None:
        """The sender ended the link: its answer ends once every lane has answered."""
        self.ending = True
        for lane in list(self.lanes.values()):
            lane.end()
        for lane_id in list(self.returns):
            self._end_return(lane_id)
        if not self._flush_due:
            self._flush()

    def lost(self) -> None:
        """The connection closed: every lane lets go of its session."""
        self.over = True
        lanes, self.lanes = self.lanes, {}
        for lane in lanes.values():
            lane.lost()
        returns, self.returns = self.returns, {}
        for attached in returns.values():
            attached.lost()

    def refuse(self, message: str) -> None:
        """A message that does not parse: every lane ends with the refusal, then the connection."""
        log.warning("Seam Link refused: %s", message)
        for lane in list(self.lanes.values()):
            lane.refuse(f"bad Seam Link message: {message}")
        for lane_id in list(self.returns):
            self._end_return(lane_id)
        self._flush()
        self.over = True
        self.answer.end([])
        self._close()
