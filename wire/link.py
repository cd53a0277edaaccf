"""FrameLink: one session's frames to one hop, in order, obeying that hop's credit.

The gateway's route client sends to a route's head through one, and every hop's forwarder
to the next hop (planes never import each other: both import wire/). A frame is one POST
/v1/frames; a prompt's chunks before its last go back to back without waiting for their acks
(`post`, HTTP/1.1 pipelining: a far hop gets as many per round trip as its credit allows); a
Decode Run's answer comes back chunked (wire.client); past the head a run's steps
go as one lane of the Seam Link to the next node (wire.seam_link), shared by every session.
Failures are typed: FrameRejectedError (the hop refused, with its FrameError) and
HopUnreachableError (the connection failed or the answer was garbled).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from pydantic import ValidationError

from schemas.credentials import CREDENTIAL_HEADER
from schemas.frames import (
    FRAME_HEADER,
    FRAMES_PATH,
    SESSIONS_PATH,
    STREAM_END_S,
    Compression,
    CreditGrant,
    ErrorCode,
    FrameAck,
    FrameError,
    FrameFormatError,
    FrameHeader,
    FrameRejectedError,
    HopUnreachableError,
    ReturnRequest,
    RunEvent,
    WireResult,
    has_credit,
    parse_ack,
    parse_ack_wire,
    parse_run_event,
    parse_step_answer,
)
from schemas.route import Phase, RouteFailure
from wire.client import (
    ChunkStream,
    FrameTransportError,
    H1Connection,
    answer_of,
    failed_answer,
    first_ready,
    forget_answer,
)
from wire.seam_link import Lane, SeamLink


@dataclass(slots=True)
class LinkStats:
    """What a FrameLink has sent: frames, body bytes, and the most frames awaiting credit."""

    frames: int = 0
    body_bytes: int = 0
    credit_waits: int = 0


class FrameLink:
    """Sends one session's frames to one hop in order, obeying that hop's credit."""

    def __init__(
        self,
        base_url: str,
        *,
        hop_index: int,
        node_id: str,
        session_id: str,
        route_id: str,
        epoch: int,
        credential: str = "",
        seam: SeamLink | None = None,
        window: int = 1,
    ) -> None:
        self.conn = H1Connection(base_url)
        self.seam = seam  # the Seam Link to this hop's node: a Decode Run's steps go on it (stream_step)
        self._credential = credential
        # what the hop checks before anything else (schemas/credentials.py)
        self._auth = {CREDENTIAL_HEADER: credential} if credential else {}
        self.hop_index = hop_index
        self.node_id = node_id
        self.session_id = session_id
        self.route_id = route_id
        self.epoch = epoch
        # the hop's announced window (Hop.window): a new session admits frames 0 .. window - 1
        # before any ack, so a prompt's first chunks need not wait a round trip for the first
        # ack's grant; later grants come with each ack
        self.credit = window
        self.accepted: list[Compression] = ["none"]
        self.stats = LinkStats()
        self._credit_path = f"{SESSIONS_PATH}/{session_id}/credit?route_id={route_id}&epoch={epoch}&above="
        self._run_stream: ChunkStream | None = None  # the Decode Run being read
        self._lane: Lane | None = None  # the open lane (this run's steps on the Seam Link)
        self._ending: ChunkStream | None = None  # the answers of a lane whose end has not been read yet
        self._ret: _ReturnFrom | None = None  # where direct steps' tokens come from (returns_from)
        # posted frames whose acks have not been read, oldest first, each with what runs on its ack
        self._acks: deque[tuple[asyncio.Future[tuple[int, bytes | ChunkStream]], Callable[[], None] | None]] = deque()

    def returns_from(self, seam: SeamLink, *, hop_index: int, node_id: str, credential: str) -> None:
        """Take the tokens of `direct` steps straight from the route's tail (its Return Stream: a
        return lane on `seam`, the Seam Link to the tail's node, opened with each run's first
        step), not from this seam's answers: a token then crosses one seam back, not every
        middle hop, and the tokens the tail makes in one iteration come back in one message."""
        request = ReturnRequest(session_id=self.session_id, route_id=self.route_id, epoch=self.epoch)
        self._ret = _ReturnFrom(seam, hop_index, node_id, credential, request.model_dump_json())

    async def _request(self, method: str, path_qs: str, headers: dict[str, str], body: bytes = b"") -> tuple[int, bytes]:
        await self._settle()
        await self.drain()
        try:
            return await self.conn.request(method, path_qs, headers, body)
        except FrameTransportError as exc:
            raise HopUnreachableError(self.hop_index, self.node_id, str(exc)) from exc

    async def _post_frame(self, seq: int, header: str, body: bytes, *,
                          stream: bool = False) -> tuple[int, bytes | ChunkStream]:
        """Wait for credit and the acks of frames posted before, then POST one frame (its answer
        streamed if `stream`)."""
        await self._settle()
        if not has_credit(seq, self.credit):
            await self.wait_credit(seq)
        await self.drain()
        headers = {FRAME_HEADER: header, **self._auth, "Content-Type": "application/octet-stream"}
        try:
            if stream:
                answer: tuple[int, bytes | ChunkStream] = await self.conn.stream("POST", FRAMES_PATH, headers, body)
            else:
                answer = await self.conn.request("POST", FRAMES_PATH, headers, body)
        except FrameTransportError as exc:
            raise HopUnreachableError(self.hop_index, self.node_id, str(exc)) from exc
        self._check_lost(*answer)
        self.stats.frames += 1
        self.stats.body_bytes += len(body)
        return answer

    async def post(self, seq: int, header: str, body: bytes, on_ack: Callable[[], None] | None = None) -> None:
        """Send a prompt chunk that is not its last (a rendered header) without waiting for its
        ack: once the hop's credit allows it, the frame goes out behind those still unanswered,
        so a hop a round trip away receives up to its credit window per round trip, not one
        frame. `on_ack` runs when the hop's ack is read. A refusal (or a lost connection) raises
        its typed error from a later call: the next post, drain, send or credit wait."""
        await self._settle()
        self._reap()
        if not has_credit(seq, self.credit):
            await self.wait_credit(seq)
        headers = {FRAME_HEADER: header, **self._auth, "Content-Type": "application/octet-stream"}
        try:
            fut = await self.conn.submit("POST", FRAMES_PATH, headers, body)
        except FrameTransportError as exc:
            raise HopUnreachableError(self.hop_index, self.node_id, str(exc)) from exc
        self._acks.append((fut, on_ack))
        self.stats.frames += 1
        self.stats.body_bytes += len(body)

    async def drain(self) -> None:
        """Read the acks of every posted frame (raises the first refusal's typed error)."""
        while self._acks:
            await self._read_ack()

    def _reap(self) -> None:
        """Read the acks that have already come, without waiting (raises a refusal)."""
        while self._acks and self._acks[0][0].done():
            fut, on_ack = self._acks[0]
            failed = failed_answer(fut)
            if failed is not None:
                self._drop_posted()
                raise HopUnreachableError(self.hop_index, self.node_id, f"before a frame's ack: {failed}")
            self._acks.popleft()
            self._took(fut.result(), on_ack)

    async def _read_ack(self) -> None:
        fut, on_ack = self._acks[0]
        try:
            answer = await answer_of(fut)
        except FrameTransportError as exc:
            self._drop_posted()
            raise HopUnreachableError(self.hop_index, self.node_id, str(exc)) from exc
        if not self._acks or self._acks[0][0] is not fut:  # the link was closed meanwhile
            raise HopUnreachableError(self.hop_index, self.node_id, "the link was closed")
        self._acks.popleft()
        self._took(answer, on_ack)

    def _took(self, answer: tuple[int, bytes | ChunkStream], on_ack: Callable[[], None] | None) -> None:
        """A posted frame's ack: its credit and compressions, else the hop's refusal."""
        status, raw = answer
        if not isinstance(raw, bytes) or status >= 300:
            self._drop_posted()
            self._check_lost(status, raw)
            raise FrameRejectedError(status, parse_error(status, raw if isinstance(raw, bytes) else b""))
        try:
            ack = parse_ack(raw)
        except FrameFormatError as exc:
            self._drop_posted()
            raise HopUnreachableError(self.hop_index, self.node_id, str(exc)) from exc
        self.credit = max(self.credit, ack.credit)
        self.accepted = list(ack.compression)
        if on_ack is not None:
            on_ack()

    def _check_lost(self, status: int, raw: bytes | ChunkStream) -> None:
        """A 408 answer to a frame: the hop gave up waiting for bytes that were sent, so the
        link lost them (HopUnreachableError: the route restarts), not a refusal of the frame."""
        if status == 408 and isinstance(raw, bytes):
            raise HopUnreachableError(self.hop_index, self.node_id, f"HTTP 408: {parse_error(status, raw).message}")

    def _forget_acks(self) -> None:
        acks, self._acks = self._acks, deque()
        for fut, _ in acks:
            forget_answer(fut)

    def _drop_posted(self) -> None:
        """After a posted frame failed: forget the other acks and drop the connection, whose
        answers still on their way would otherwise be read as the next request's."""
        self._forget_acks()
        self.conn.close()

    async def wait_credit(self, seq: int) -> None:
        """Block until the hop grants credit for frame `seq`: from the acks of frames posted
        before it, then by long-polling the hop's credit."""
        if not has_credit(seq, self.credit):
            self.stats.credit_waits += 1
        while self._acks and not has_credit(seq, self.credit):
            await self._read_ack()
        while not has_credit(seq, self.credit):
            status, raw = await self._request("GET", f"{self._credit_path}{self.credit}", self._auth)
            if status != 200:
                raise FrameRejectedError(status, parse_error(status, raw))
            self.credit = max(self.credit, CreditGrant.model_validate_json(raw).credit)

    async def send(self, header: FrameHeader, body: bytes) -> FrameAck:
        """Wait for credit, POST the frame and return the hop's ack (raises typed errors)."""
        return await self.send_rendered(header.seq, header.to_header(), body)

    async def send_rendered(self, seq: int, header: str, body: bytes) -> FrameAck:
        """send() for a header already rendered (FrameHeader.to_header, StepHeaders.render)."""
        status, raw = await self._post_frame(seq, header, body)
        assert isinstance(raw, bytes)  # request() collects any stream
        if status >= 300:
            raise FrameRejectedError(status, parse_error(status, raw))
        try:
            ack = parse_ack(raw)
        except FrameFormatError as exc:
            raise HopUnreachableError(self.hop_index, self.node_id, str(exc)) from exc
        self.credit = max(self.credit, ack.credit)
        self.accepted = list(ack.compression)
        return ack

    async def send_step(self, seq: int, header: str, body: bytes) -> WireResult:
        """send_rendered() for a prompt's last chunk, passed on by a hop: the tail's result as
        its JSON object (parse_ack_wire), as the hop's own answer carries it on."""
        status, raw = await self._post_frame(seq, header, body)
        assert isinstance(raw, bytes)
        if status >= 300:
            raise FrameRejectedError(status, parse_error(status, raw))
        try:
            credit, result, accepted = parse_ack_wire(raw)
            if result is None:
                raise FrameFormatError("a final frame's ack has no result")
        except FrameFormatError as exc:
            raise HopUnreachableError(self.hop_index, self.node_id, str(exc)) from exc
        self.credit = max(self.credit, credit)
        self.accepted = accepted
        return result

    async def stream_step(self, seq: int, header: Callable[[], str], body: bytes,
                          after_send: Callable[[], None] | None = None, *, direct: bool = False,
                          position: int = 0) -> WireResult | None:
        """One decode step of a Decode Run as one part of the Seam Link to this hop's node; the
        tail's result as its JSON object (stream_send, then stream_answer)."""
        await self.stream_send(seq, header, body, after_send, direct=direct)
        return await self.stream_answer(seq, direct=direct, position=position)

    async def stream_send(self, seq: int, header: Callable[[], str], body: bytes,
                          after_send: Callable[[], None] | None = None, *, direct: bool = False) -> None:
        """Send one decode step of a Decode Run as one part of the Seam Link to this hop's node.
        The first step opens the run's lane (`header()` is that step's FrameHeader, with
        `stream` set; it waits for credit like a frame); each later step is one more part and its
        answer one more event of the lane (stream_answer reads them in order). end_stream ends
        the lane. `after_send` runs once the step is queued for this turn's message (work that
        can overlap the next hop's). Raises typed errors, like send_step; after one the lane is
        gone (the next step opens a new one)."""
        assert self.seam is not None, "a Decode Run's steps go on a Seam Link"
        lane = self._lane
        ret = self._ret if direct else None
        if lane is None and ret is not None and ret.lane is None:
            # the request for the tail's tokens goes out before the first step's rows
            ret.lane = ret.seam.return_lane(ret.request, ret.credential)
        if lane is None:
            await self._settle()
            if not has_credit(seq, self.credit):
                await self.wait_credit(seq)
            self._lane = lane = self.seam.lane(header(), self._credential, body)
        elif not lane.send(body):
            self._lane = None
            lane.answers.abandon()
            if lane.answers.ready:
                await self._step_answer(lane, seq)  # the lane's refusal or failure: raises
            raise HopUnreachableError(self.hop_index, self.node_id, "the Seam Link's lane is closed")
        self.stats.frames += 1
        self.stats.body_bytes += len(body)
        if after_send is not None:
            after_send()

    async def stream_answer(self, seq: int, *, direct: bool = False, position: int = 0) -> WireResult | None:
        """The answer to the oldest step stream_send sent and no call here read yet: the tail's
        result as its JSON object. A `direct` step (the header says so) is answered by the
        tail's Return Stream on the link that has one (returns_from: the head), the step at
        `position` by the token after `position`; on any other link by nothing (None at once; a
        failure or refusal the lane's answers already carry is raised)."""
        lane = self._lane
        if lane is None:
            raise HopUnreachableError(self.hop_index, self.node_id, "no lane is open")
        ret = self._ret if direct else None
        if ret is not None:
            return await self._returned(lane, ret, seq, position)
        if direct:
            if lane.answers.ready:
                await self._step_answer(lane, seq)  # the lane ended early: raises
            return None
        return await self._step_answer(lane, seq)

    async def _step_answer(self, lane: Lane, seq: int) -> WireResult:
        """The lane's next answer: a token, else the typed error."""
        steps = lane.answers
        try:
            answer_raw = await steps.__anext__()
            outcome = parse_step_answer(answer_raw)
        except BaseException as exc:  # cancelled, cut short or garbled: the lane cannot go on
            self._lane = None
            steps.abandon()
            if isinstance(exc, StopAsyncIteration):
                raise HopUnreachableError(self.hop_index, self.node_id, "the lane ended early") from None
            if isinstance(exc, (FrameTransportError, FrameFormatError)):
                raise HopUnreachableError(self.hop_index, self.node_id, str(exc)) from exc
            raise
        if isinstance(outcome, dict):
            self.credit = max(self.credit, seq + 2)  # done > seq and the window is at least 1
            return outcome
        self._lane = None
        steps.abandon()  # the hop ends the lane after a refusal or failure
        if outcome.error is not None:
            raise FrameRejectedError(outcome.error.status, outcome.error)
        if outcome.failure is not None:
            err = FrameError(code="session_failed", message=outcome.failure.reason, failure=outcome.failure)
            raise FrameRejectedError(err.status, err)
        raise HopUnreachableError(self.hop_index, self.node_id, "the lane ended before its step's answer")

    async def _returned(self, lane: Lane, ret: _ReturnFrom, seq: int, position: int) -> WireResult:
        """The token of the direct step at `position` from the tail's Return Stream, or the
        typed error of whichever fails first (this seam's lane, or the tail's stream)."""
        steps = lane.answers
        try:
            assert ret.lane is not None
            stream = ret.lane.answers
            while True:
                if await first_ready(stream, steps) is steps:
                    await self._step_answer(lane, seq)  # only an end or a failure comes here: raises
                    raise HopUnreachableError(self.hop_index, self.node_id, "a direct step was answered on its seam")
                try:
                    outcome = parse_step_answer(await stream.__anext__())
                except StopAsyncIteration:
                    raise ret.lost("the Return Stream ended") from None
                except (FrameTransportError, FrameFormatError) as exc:
                    raise ret.lost(str(exc)) from exc
                if isinstance(outcome, dict):
                    if outcome["position"] <= position:
                        continue  # a token of an earlier run the caller left early
                    self.credit = max(self.credit, seq + 2)  # done > seq and the window is at least 1
                    return outcome
                if outcome.failure is not None:
                    err = FrameError(code="session_failed", message=outcome.failure.reason, failure=outcome.failure)
                    raise FrameRejectedError(err.status, err)
                if outcome.error is not None:
                    raise ret.lost(f"the Return Stream was refused: {outcome.error.code}: {outcome.error.message}")
                raise ret.lost("the Return Stream ended before the step's token")
        except BaseException:
            self._lane = None
            steps.abandon()
            ret.close()
            raise

    def end_stream(self, lost_hop: int | None = None) -> None:
        """End the open lane, if any, without waiting: its last answer (the hop's end, with its
        credit) is read before this link's next request or lane. A Return Stream closes.
        `lost_hop`: the lane ends because its feed was lost after that hop (Lane.end)."""
        if self._ret is not None:
            self._ret.close()
        lane, self._lane = self._lane, None
        if lane is not None:
            lane.end(lost_hop)
            self._ending = lane.answers

    async def _settle(self) -> None:
        """Read the end of a lane ended earlier (the hop's credit comes with it); a hop that
        does not end it within STREAM_END_S loses the lane."""
        steps, self._ending = self._ending, None
        if steps is None:
            return
        try:
            async with asyncio.timeout(STREAM_END_S):
                async for raw in steps:
                    event = parse_step_answer(raw)
                    if isinstance(event, RunEvent) and event.credit is not None:
                        self.credit = max(self.credit, event.credit)
        except (TimeoutError, FrameTransportError, FrameFormatError):
            steps.abandon()

    async def run(self, header: FrameHeader, body: bytes) -> AsyncIterator[RunEvent]:
        """POST a Decode Run frame and yield the head's RunEvents as they arrive, the last one
        with `end` or `failure` (raises typed errors; leaving early closes the connection)."""
        status, answer = await self._post_frame(header.seq, header.to_header(), body, stream=True)
        if not isinstance(answer, ChunkStream):
            if status >= 300:
                raise FrameRejectedError(status, parse_error(status, answer))
            raise FrameRejectedError(502, FrameError(code="bad_frame", message="a Decode Run got no stream"))
        last: RunEvent | None = None
        self._run_stream = answer
        try:
            async for chunk in answer:
                event = parse_run_event(chunk)
                if event.credit is not None:
                    self.credit = max(self.credit, event.credit)
                if event.end or event.failure is not None:
                    last = event  # read the stream's end first, so the connection stays usable
                    continue
                yield event
        except (FrameTransportError, FrameFormatError) as exc:
            raise HopUnreachableError(self.hop_index, self.node_id, str(exc)) from exc
        finally:
            self._run_stream = None
            answer.abandon()  # no-op after the last chunk
        if last is None:
            raise HopUnreachableError(self.hop_index, self.node_id, "the Decode Run's stream ended without its last event")
        yield last

    @property
    def run_buffered(self) -> int:
        """RunEvents of the Decode Run in progress that arrived and were not read yet."""
        return 0 if self._run_stream is None else self._run_stream.buffered

    def close(self) -> None:
        """Close the link's connection (and end its lane, if one is open)."""
        self._forget_acks()
        lane, self._lane, self._ending = self._lane, None, None
        if lane is not None:
            lane.answers.abandon()
        self.conn.close()
        if self._ret is not None:
            self._ret.close()


@dataclass(slots=True)
class _ReturnFrom:
    """The tail's Return Stream as a head's link reads it: a return lane on the Seam Link to the
    tail's node, opened per Decode Run."""

    seam: SeamLink
    hop_index: int
    node_id: str
    credential: str
    request: str  # a ReturnRequest's JSON
    lane: Lane | None = None  # its answers: one RunEvent per token

    def lost(self, reason: str) -> HopUnreachableError:
        """The typed error for a Return Stream that broke: it names the tail."""
        return HopUnreachableError(self.hop_index, self.node_id, f"Return Stream: {reason}")

    def close(self) -> None:
        """End the Return Stream (the tail lets go of it)."""
        lane, self.lane = self.lane, None
        if lane is not None:
            lane.answers.abandon()


def parse_error(status: int, raw: bytes) -> FrameError:
    try:
        return FrameError.model_validate_json(raw)
    except ValidationError:
        text = raw[:200].decode("utf-8", "replace")
        code: ErrorCode = "session_failed" if status >= 500 else "bad_frame"
        return FrameError(code=code, message=f"HTTP {status}: {text}")


def failure_from_rejection(
    exc: FrameRejectedError, *, session_id: str, route_id: str, phase: Phase, hop_index: int, node_id: str
) -> RouteFailure:
    """The RouteFailure a rejection means: the hop's own failure if it sent one, else one naming it."""
    if exc.error.failure is not None:
        return exc.error.failure
    return RouteFailure(
        session_id=session_id,
        route_id=route_id,
        phase=phase,
        hop_index=hop_index,
        node_id=node_id,
        reason=f"{exc.error.code}: {exc.error.message}",
        code=exc.error.code,
    )


def failure_from_unreachable(
    exc: HopUnreachableError, *, session_id: str, route_id: str, phase: Phase
) -> RouteFailure:
    """The RouteFailure for a hop that could not be reached or dropped the connection."""
    return RouteFailure(
        session_id=session_id,
        route_id=route_id,
        phase=phase,
        hop_index=exc.hop_index,
        node_id=exc.node_id,
        reason=f"hop unreachable: {exc.reason}",
        code="hop_lost",
    )
