"""TokenReturn: a tail's end of a Return Stream, the route driver's direct line to its tokens.

On a route of 3 or more hops a Decode Run's steps travel `direct` (FrameHeader.direct): the head
opens a return lane (LANE_RETURN) on its Seam Link to the tail's node (with the tail's
credential, which the open directive carries sealed for the head), and the tail writes each
step's token there as one RunEvent of the lane instead of answering the step back through every
middle hop. A token then crosses one seam back, not n - 1, and the tokens one iteration of the
tail made for sessions of the same head go back in one write (docs/activation-protocol.md,
"Direct return").

The head's request and the run's first step race (the request crosses one seam, the step every
seam), so a token made before the request arrives waits here, a few at most.
"""

from __future__ import annotations

from collections import deque

from schemas.frames import RunEvent
from schemas.route import RouteFailure
from wire.server import RunStream

PENDING_MAX = 8  # tokens held for a Return Stream not attached yet (a run's steps wait on each token)


class TokenReturn:
    """The Return Stream of one session on its tail (at most one attached at a time)."""

    def __init__(self) -> None:
        self.answer: RunStream | None = None
        self.pending: deque[bytes] = deque(maxlen=PENDING_MAX)
        self.sent = 0  # tokens written to a Return Stream

    def attach(self, answer: RunStream) -> Attached:
        """Attach the head's new Return Stream (it replaces an older one: the head's next run,
        on a connection whose end this node has not seen yet), and write what waited for it."""
        old, self.answer = self.answer, answer
        if old is not None:
            old.end([])
        answer.start()
        if self.pending:
            events, self.pending = list(self.pending), deque(maxlen=PENDING_MAX)
            self._write(events)
        return Attached(self, answer)

    def send(self, event: bytes) -> None:
        """One token's RunEvent: to the attached stream, else held for the next one."""
        if self.answer is None:
            self.pending.append(event)
        else:
            self._write([event])

    def _write(self, events: list[bytes]) -> None:
        answer = self.answer
        assert answer is not None
        if answer.send(events):
            self.sent += len(events)
        else:  # the head's connection is gone: hold them for its next stream
            self.answer = None
            self.pending.extend(events)

    def end(self, failure: RouteFailure | None) -> None:
        """The session ended on this hop: end the stream, with the failure if it broke."""
        answer, self.answer = self.answer, None
        self.pending.clear()
        if answer is not None:
            event = RunEvent(failure=failure) if failure is not None else RunEvent(end=True)
            answer.end([event.model_dump_json(exclude_defaults=True).encode()])


class Attached:
    """One attached Return Stream, as the frame server holds it (its connection may go)."""

    def __init__(self, box: TokenReturn, answer: RunStream) -> None:
        self.box = box
        self.answer = answer

    def lost(self) -> None:
        if self.box.answer is self.answer:
            self.box.answer = None
