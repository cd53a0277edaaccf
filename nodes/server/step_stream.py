"""StepStreamIn: the receiving end of a Step Stream, a Decode Run's steps across one seam.

Past the head, a Decode Run's decode steps cross each seam as one HTTP request whose chunked
body stays open for the whole run (docs/activation-protocol.md, "Step Streams"): its
FrameHeader (with `stream`) is parsed and admitted once, for the first step; every chunk is
one step's rows, each step's seq and position one more than the last; each step is answered
by one chunk of a chunked 200 answer, `{"result": ...}` with the tail's token; or, for a
`direct` stream (a route of 3 or more hops), by nothing: the tail writes the token to the head's
Return Stream (nodes/server/return_stream.py), and the stream's answer carries only its end or
a failure. On a speculative stream (`draft` > 0) each chunk says its step's position (which
may go back to where the last verify step's kept tokens end) and carries its drafted ids
(schemas.frames.step_chunk). The sender
ends its body when the run ends, and the hop then ends its answer with
`{"end": true, "credit", "done"}`, leaving the connection ready for the next request.

A step that cannot run ends the answer with `{"error": FrameError}`, a broken route with
`{"failure": RouteFailure}`, and the hop closes the connection (the rest of the body is
never read). While a stream is open it holds the session: any other frame is refused
(`session_busy`), as during a Decode Run on the head.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from nodes.server.admission import rewinds
from nodes.server.frame_plane import run_event
from nodes.server.session import HopSession
from schemas.frames import (
    FrameError,
    FrameFormatError,
    FrameHeader,
    RunEvent,
    WireResult,
    decode_rows,
    parse_step_chunk,
    run_token_bytes,
)
from schemas.route import RouteFailure
from wire.server import RunStream

log = logging.getLogger("meshnet.node.steps")


class StepStreamIn:
    """One Step Stream on this hop: takes each step's chunk, runs it through the session, and
    writes its answer; the owner (the connection) feeds chunks and reports the body's end or
    the connection's loss."""

    def __init__(self, hs: HopSession, header: FrameHeader, max_chunk: int, answer: RunStream,
                 close: Callable[[], None]) -> None:
        self.hs = hs
        self.header = header
        self.max_chunk = max_chunk  # the most bytes one step's chunk may carry
        self.answer = answer
        self._close = close  # drops the connection after a refusal (the rest of the body is unknown)
        self.seq = header.seq
        self.position = header.position
        self.in_flight = 0
        # A direct step's answer (the tail's token) reaches the sender by another path, and can
        # outrun this hop's own bookkeeping of the step it forwarded: the next step may then
        # arrive first, and queues behind it in the session.
        self.window = 2 if header.direct else 1
        self.ending = False  # the sender ended its body
        self.over = False  # the stream no longer holds the session
        hs.begin_stream()
        if header.direct:
            answer.start()  # no step is answered here: the sender's request returns on the head alone

    def step(self, payload: bytes, wire_bytes: int) -> None:
        """One chunk: one decode step's rows."""
        if self.over:
            return
        hs = self.hs
        if not hs.open:
            failure = hs.failure
            self._stop(RunEvent(failure=failure) if failure is not None else RunEvent(error=FrameError(
                code="session_closed", message=f"session {hs.life.status}: {hs.life.reason}")))
            return
        if self.in_flight >= self.window:
            self.refuse("a Step Stream carries one step at a time: send the next after the answer")
            return
        try:
            if self.header.draft:  # a speculative stream: each step says where it starts, and its drafts
                position, drafts, rows = parse_step_chunk(self.header, payload)
            else:
                position, drafts, rows = self.position, [], decode_rows(self.header, payload)
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
                  drafts=drafts or None)

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
        """The sender ended its body: end the answer once every step is answered."""
        self.ending = True
        if not self.in_flight and not self.over:
            self._finish()

    def lost(self) -> None:
        """The connection closed: the stream lets go of the session."""
        self._release()

    def _finish(self) -> None:
        self._release()
        hs = self.hs
        self.answer.end([run_event(RunEvent(end=True, credit=hs.credit, done=hs.done))])

    def refuse(self, message: str, *, code: str = "bad_frame") -> None:
        """End the stream with a refusal (a step that cannot run, or a malformed chunk)."""
        log.warning("session %s: Step Stream refused a step: %s", self.hs.session_id, message)
        self._stop(RunEvent(error=FrameError(code=code, message=message)))  # type: ignore[arg-type]

    def _stop(self, event: RunEvent) -> None:
        self._release()
        self.answer.end([run_event(event)])  # once: a later end is a no-op
        self._close()

    def _release(self) -> None:
        if self.over:
            return
        self.over = True
        self.hs.end_stream()
        self.hs.end_stream_out()  # a middle hop's own Step Stream to the next hop ends with this one
