"""SeamLink: the sending end of one Seam Link, the one connection that carries every session's
decode steps from this node to one next-hop node (docs/activation-protocol.md, "Seam Links").

    HopSession._forward ─ FrameLink.stream_step ─ Lane.send ─ SeamLink outbox
      ─ (once per event-loop turn) one chunk of POST /v1/links: the parts of every lane

A hop's scheduler finishes one iteration's Works together, and each session then hands its rows
on in the same turn of the event loop; the link gathers what they send in that turn and writes
it as one message, so the next hop receives one iteration's rows at once and runs them as one
batch. The answer is one chunked stream too: each chunk one lane's event (a token, or a lane's
end, refusal or failure), delivered straight to that lane's ChunkStream.

A lane is one session's Decode Run on the link: it opens with the run's header and the hop's
credential (the frame credential stays per session, epoch and hop), carries one step per part
and ends with an end part, which the receiving hop answers with the lane's last event. If the
connection breaks, every lane on it gets the error (its session then reports the next hop lost,
as for any frame); the next lane opens a new connection.
"""

from __future__ import annotations

import asyncio
import logging
import time

from schemas.frames import (
    LANE_END,
    LANE_LOST,
    LANE_RETURN,
    LANE_STEP,
    LINKS_PATH,
    MAX_LINK_MESSAGE,
    FrameFormatError,
    lane_open,
    link_part,
    parse_link_answer,
)
from wire.client import ChunkStream, FrameTransportError, H1Connection

log = logging.getLogger("meshnet.wire.link")

SILENT_S = 2.0  # a link that said nothing for this long after its last lane's last part is suspect


class Lane:
    """One session's Decode Run on a SeamLink: its steps go out as parts of the link's
    messages; its answers arrive on `answers`."""

    def __init__(self, link: SeamLink, lane_id: int, *, returns: bool = False) -> None:
        self.link = link
        self.id = lane_id
        self.answers = ChunkStream(self._abandoned)
        self.ended = False  # this side sent the lane's end
        self.sent_at = time.monotonic()  # when it last sent a part (its open, then each step)
        self.returns = returns  # a Return Stream: its answers (tokens) are due without a part of its own

    def send(self, payload: bytes) -> bool:
        """One more step; False if the lane is gone (its link broke, or its last answer came)."""
        if self.answers.ended or self.id not in self.link.lanes:
            return False
        self.link.put(link_part(self.id, LANE_STEP, payload))
        self.sent_at = time.monotonic()
        return True

    def end(self, lost_hop: int | None = None) -> None:
        """No more steps: the receiving hop answers with the lane's last event. `lost_hop`: the
        lane's feed was lost, the link after that hop having broken mid-run (LANE_LOST)."""
        if not self.ended:
            self.ended = True
            if self.id in self.link.lanes:
                data = b"" if lost_hop is None else LANE_LOST.pack(lost_hop)
                self.link.put(link_part(self.id, LANE_END, data))

    def _abandoned(self) -> None:
        """The sender stopped reading the lane's answers: the hop lets go of it."""
        self.end()
        self.link.lanes.pop(self.id, None)
        self.link.let_go(self)


class SeamLink:
    """The Seam Link to one node: one connection, opened with the first lane, kept for the
    next ones."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.conn = H1Connection(base_url)
        self.lanes: dict[int, Lane] = {}
        self._next_lane = 0
        self._outbox: list[bytes] = []
        self._flush_due = False
        self._state = "closed"  # "opening", "open"
        self.messages = 0  # messages written (a message carries every part of one turn)
        self.parts = 0
        self.heard_at = 0.0  # when the answer last brought a chunk (monotonic)
        self._generation = 0  # connections made so far: a late event of an earlier one is ignored

    def lane(self, header: str, credential: str, first_step: bytes) -> Lane:
        """Open a lane for a Decode Run whose first step this is."""
        lane = self._new_lane()
        self.put(lane_open(lane.id, header, credential, first_step))
        return lane

    def return_lane(self, request: str, credential: str) -> Lane:
        """Open a lane on which this link's node, a route's tail, sends one session's tokens
        (`request`: a ReturnRequest's JSON; `credential`: the tail's)."""
        lane = self._new_lane(returns=True)
        self.put(lane_open(lane.id, request, credential, b"", LANE_RETURN))
        return lane

    def _new_lane(self, *, returns: bool = False) -> Lane:
        self._next_lane = (self._next_lane + 1) & 0xFFFFFFFF
        lane = self.lanes[self._next_lane] = Lane(self, self._next_lane, returns=returns)
        return lane

    def put(self, part: bytes) -> None:
        """Queue a part for this turn's message (written at once when the link carries one lane:
        there is nothing to gather, and a trip through the event loop costs the step time)."""
        self._outbox.append(part)
        if self._state == "open" and len(self.lanes) <= 1:
            self._flush()
        elif not self._flush_due:
            self._flush_due = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_due = False
        if not self._outbox or self._state == "opening":
            return  # the opening request carries what is queued, or takes it once open
        if self._state == "closed":
            self._state = "opening"
            asyncio.get_running_loop().create_task(self._open())
            return
        for message, n in _messages(self._outbox):
            if not self.conn.send_chunk(message):
                self._broken(FrameTransportError("the Seam Link's connection is closed"))
                return
            self.messages += 1
            self.parts += n
        self._outbox.clear()

    async def _open(self) -> None:
        """Connect and send the link's request with the first message; later messages follow
        at once, without waiting for the answer's head."""
        first = _messages(self._outbox)[0]
        del self._outbox[:first[1]]
        generation = self._generation  # a connection let go later must not break its successor

        def answered_here(item: bytes | BaseException | None) -> None:
            if generation == self._generation:
                self._answered(item)

        try:
            answered = await self.conn.open_stream(LINKS_PATH, {"Content-Type": "application/octet-stream"},
                                                   first[0], answered_here)
        except FrameTransportError as exc:
            self._broken(exc)
            return
        except BaseException as exc:  # cancelled with the loop: the lanes must not wait forever
            self._broken(FrameTransportError(type(exc).__name__))
            raise
        self.messages += 1
        self.parts += first[1]
        self._state = "open"
        self._flush()
        try:
            status, answer = await answered
        except Exception as exc:  # the connection went before the answer's head
            if generation == self._generation:
                self._broken(exc)
            return
        if not isinstance(answer, ChunkStream) and generation == self._generation:
            self._broken(FrameTransportError(f"the Seam Link was refused: HTTP {status}: {answer[:200]!r}"))

    def _answered(self, item: bytes | BaseException | None) -> None:
        """One chunk of the link's answer (or its end, or the connection's error)."""
        if not isinstance(item, bytes):
            self._broken(item if item is not None else FrameTransportError("the Seam Link's answer ended"))
            return
        self.heard_at = time.monotonic()
        try:
            lane_id, last, event = parse_link_answer(item)
        except FrameFormatError as exc:
            self._broken(exc)
            return
        lane = self.lanes.get(lane_id)
        if lane is None:
            return  # a lane the sender let go of
        lane.answers._put(event)
        if last:
            del self.lanes[lane_id]
            lane.answers._put(None)

    def let_go(self, lane: Lane) -> None:
        """`lane` was abandoned. If it was the last, and the connection has said nothing since the
        lane last sent for SILENT_S (a Return Stream: nothing since it opened or last brought a
        token, the tokens being due all along), the connection may be dead without knowing it:
        close it, so the next lane connects anew. Before, a Return Stream's link that went
        silent mid-run was kept, having brought tokens after the lane's open: the restart's
        route took its tokens from the same dead connection and stalled again."""
        since = max(lane.sent_at, self.heard_at) if lane.returns else lane.sent_at
        if (not self.lanes and self._state == "open" and (lane.returns or self.heard_at < since)
                and time.monotonic() - since >= SILENT_S):
            log.info("Seam Link to %s silent for %.1f s after its last lane: connecting anew for the next",
                     self.base_url, time.monotonic() - since)
            self._broken(FrameTransportError("the Seam Link went silent"))

    def _broken(self, exc: BaseException) -> None:
        """The connection is gone: every lane on it fails; the next lane opens a new one."""
        self._state = "closed"
        self._generation += 1
        self._outbox.clear()
        self.conn.close()
        lanes, self.lanes = self.lanes, {}
        for lane in lanes.values():
            lane.answers._put(exc)

    def close(self) -> None:
        if self._state == "open":
            self.conn.end_body()
        self._broken(FrameTransportError("the Seam Link was closed"))


def _messages(parts: list[bytes]) -> list[tuple[bytes, int]]:
    """`parts` joined into messages of at most MAX_LINK_MESSAGE bytes (a part never splits), with
    each message's part count (pure)."""
    out: list[tuple[bytes, int]] = []
    start, size = 0, 0
    for i, part in enumerate(parts):
        if size and size + len(part) > MAX_LINK_MESSAGE:
            out.append((b"".join(parts[start:i]), i - start))
            start, size = i, 0
        size += len(part)
    if start < len(parts):
        out.append((b"".join(parts[start:]), len(parts) - start))
    return out


class SeamLinks:
    """A node's Seam Links, one per next-hop node (by its activation URL)."""

    def __init__(self) -> None:
        self._links: dict[str, SeamLink] = {}

    def to(self, base_url: str) -> SeamLink:
        link = self._links.get(base_url)
        if link is None:
            link = self._links[base_url] = SeamLink(base_url)
        return link

    def stats(self) -> dict[str, dict[str, int]]:
        return {url: {"lanes": len(k.lanes), "messages": k.messages, "parts": k.parts}
                for url, k in self._links.items()}

    def close(self) -> None:
        for link in self._links.values():
            link.close()
        self._links.clear()
