"""How many steps a lane of a Seam Link lets the sender have in flight on one hop.

A plain lane answers each step, so the sender waits: a second step before the answer is
refused (the lane ends; the link and its other lanes go on). A speculative lane takes as many
verify steps as a head may pipeline. A `direct` lane (3+ hops) answers
nothing per step: the tail's token reaches the head by the Return Stream and may outrun this
hop's bookkeeping of the step it forwarded, so the head's next step can arrive first (seen on a
loaded machine). It must queue, not fail the route; a third is still refused.

The session is a stand-in: these tests are about the lane's admission, not the model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import orjson

from nodes.server.seam_link import LaneIn
from schemas.frames import (
    SPEC_DEPTH,
    FrameHeader,
    HopMark,
    WireResult,
    encode_rows,
    step_chunk,
    upstream_chunk,
)


@dataclass
class Answer:
    events: list[bytes] = field(default_factory=list)
    ended: bool = False
    started: bool = False

    def send(self, events: Sequence[bytes]) -> bool:
        self.events.extend(events)
        return True

    def end(self, events: Sequence[bytes]) -> None:
        if not self.ended:
            self.events.extend(events)
            self.ended = True

    def start(self) -> bool:
        self.started = True
        return True


@dataclass
class Session:
    """What LaneIn reads and calls on a HopSession."""
    session_id: str = "s"
    open: bool = True
    failure: None = None
    next_seq: int = 4
    next_position: int = 20
    credit: int = 8
    done: int = 0
    cfg: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(n_ctx=512))
    replies: list[Callable[[WireResult | None], None]] = field(default_factory=list)
    streams: int = 0
    upstream: list[list[HopMark] | None] = field(default_factory=list)
    returned: list[bytes] = field(default_factory=list)

    @property
    def token_return(self) -> SimpleNamespace:
        return SimpleNamespace(send=self.returned.append)

    def begin_stream(self) -> None:
        self.streams += 1

    def end_stream(self) -> None:
        self.streams -= 1

    def end_stream_out(self) -> None:
        pass

    def accept(self, header: FrameHeader, rows: np.ndarray, wire_bytes: int, body_bytes: int, *,
               reply: Callable[[WireResult | None], None], seq: int, position: int,
               drafts: list[int] | None = None, guess: int = -1, upstream: list[HopMark] | None = None) -> None:
        assert (seq, position) == (self.next_seq, self.next_position)
        self.upstream.append(upstream)
        self.next_seq += 1
        self.next_position += 1
        self.replies.append(reply)


def lane(direct: bool, draft: int = 0, hop: int = 1) -> tuple[LaneIn, Session, Answer]:
    hs, answer = Session(), Answer()
    h = FrameHeader(session_id="s", route_id="r", epoch=0, hop=hop, seq=4, phase="decode", position=20,
                    n_rows=1, dtype="f32", width=4, final=True, stream=True, direct=direct, draft=draft)
    return LaneIn(hs, h, 1 << 16, answer), hs, answer  # type: ignore[arg-type]


ROW = encode_rows(np.zeros((1, 4), np.float32), "f32")
DIRECT_ROW = upstream_chunk([], ROW)  # a direct lane's step from the head: no middle hop's timing yet


def refusal(answer: Answer) -> str:
    assert answer.ended
    return orjson.loads(answer.events[-1])["error"]["message"]


def test_a_plain_lane_refuses_a_step_before_the_last_ones_answer() -> None:
    s, hs, answer = lane(direct=False)
    s.step(ROW, len(ROW))
    s.step(ROW, len(ROW))
    assert len(hs.replies) == 1
    assert "at most one step in flight" in refusal(answer)
    assert hs.streams == 0  # the refusal let go of the session
    s.step(ROW, len(ROW))  # a part for an ended lane runs nothing
    assert len(hs.replies) == 1


def test_a_direct_lane_queues_a_step_that_outran_the_last_ones_bookkeeping() -> None:
    s, hs, answer = lane(direct=True)
    s.step(DIRECT_ROW, len(DIRECT_ROW))
    s.step(DIRECT_ROW, len(DIRECT_ROW))  # the tail answered step 1 to the head before this hop finished with it
    assert len(hs.replies) == 2 and not answer.ended
    for reply in hs.replies:
        reply(None)  # a middle hop's direct step: nothing goes back on this lane
    s.step(DIRECT_ROW, len(DIRECT_ROW))
    assert len(hs.replies) == 3 and not answer.ended
    assert answer.events == []
    s.end()
    hs.replies[-1](None)
    assert answer.ended and orjson.loads(answer.events[-1])["end"] is True
    assert hs.streams == 0


def test_a_direct_lane_still_refuses_a_third_step_in_flight() -> None:
    s, hs, answer = lane(direct=True)
    for _ in range(3):
        s.step(DIRECT_ROW, len(DIRECT_ROW))
    assert len(hs.replies) == 2
    assert "at most 2 steps in flight" in refusal(answer)


def test_a_speculative_lane_takes_pipelined_verify_steps_up_to_its_depth() -> None:
    """A head pipelines up to SPEC_DEPTH verify steps of one run (one more on a direct lane)."""
    for direct in (False, True):
        s, hs, answer = lane(direct=direct, draft=4)
        window = SPEC_DEPTH + direct
        wrap = (lambda b: upstream_chunk([], b)) if direct else (lambda b: b)
        for i in range(window):
            s.step(wrap(step_chunk(20 + i, [], ROW, guess=-1 if i == 0 else 7)), len(ROW))
        assert len(hs.replies) == window and not answer.ended
        s.step(wrap(step_chunk(20 + window, [], ROW, guess=7)), len(ROW))
        assert len(hs.replies) == window
        assert f"at most {window} steps in flight" in refusal(answer)


def test_a_direct_lanes_step_carries_the_middle_hops_timings_to_the_tail() -> None:
    """Past a middle hop a direct step names that hop's timing (the tail's answer skips it); a
    step without it is refused, ending only its own lane."""
    s, hs, answer = lane(direct=True, hop=2)
    part = upstream_chunk([(1, 6.5, 7.0)], ROW)
    s.step(part, len(part))
    assert hs.upstream == [[(1, 6.5, 7.0)]] and not answer.ended
    hs.replies[-1](None)
    s.step(DIRECT_ROW, len(DIRECT_ROW))  # no timing for hop 1
    assert "starts with 1 hop timings" in refusal(answer)
    assert len(hs.replies) == 1
