"""The frame plane's endpoints, as the node's wire.server.FrameServer (the only frame server)
calls them through FrameHandlers below.

    POST /v1/frames                          admit_frame / admit_now (header only), then run_frame (body)
    GET  /v1/sessions/<id>/credit?...        credit_reply (long-poll)
    POST /v1/links                           open_link: a Seam Link (nodes/server/seam_link.py); its
                                             LANE_RETURN lanes: open_returns (a tail's tokens, straight
                                             to the head)

admit_frame checks everything a frame header claims before the body is read; run_frame
decodes the body, re-checks (the session may have moved while the body arrived), queues
the frame and answers through a callback: at once with credit, or for a final frame from
where the frame finishes, without waking the request's task first. Replies are (status, JSON);
a Decode Run answers through a RunStream instead: one RunEvent per token, then its end
(tokens held and written together when the run asks for `flush_ms`, nodes.server.run_flush).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from pydantic import ValidationError

from nodes.server.admission import check_credential, check_frame
from nodes.server.return_stream import Attached
from nodes.server.run_flush import HeldTokens
from nodes.server.runtime import NodeRuntime
from nodes.server.session import HopSession
from schemas.frames import (
    CREDIT_POLL_S,
    FRAME_HEADER,
    CreditGrant,
    FrameError,
    FrameFormatError,
    FrameHeader,
    ReturnRequest,
    RunEvent,
    WireResult,
    ack_bytes,
    decode_rows,
    max_step_bytes,
    run_token_bytes,
)
from schemas.route import RouteFailure
from wire.server import Reply, RunStream, error_reply

if TYPE_CHECKING:
    from nodes.server.seam_link import LinkIn

ZSTD_SLACK = 1024  # a zstd body may be a little larger than its raw size


def ack_reply(hs: HopSession, seq: int, result: WireResult | None = None) -> Reply:
    """The FrameAck for frame `seq`: 202 when queued, 200 with the tail's result."""
    return Reply(200 if result else 202, ack_bytes(seq, hs.credit, hs.done, result))


def run_event(event: RunEvent) -> bytes:
    """A RunEvent as one chunk's JSON."""
    return event.model_dump_json(exclude_defaults=True).encode()


@dataclass(frozen=True, slots=True)
class Admitted:
    """A frame whose header passed admission; its body may now be read."""

    session: HopSession
    header: FrameHeader
    length: int  # body bytes on the wire (a lane: the most one step's payload may carry)


def _parse(raw: str | None, length: int | None, lane: bool) -> tuple[FrameHeader, int] | FrameError:
    if raw is None:
        return FrameError(code="bad_frame", message=f"missing {FRAME_HEADER} header")
    try:
        header = FrameHeader.from_header(raw)
    except FrameFormatError as exc:
        return FrameError(code="bad_frame", message=str(exc))
    if lane or header.stream:
        if not (lane and header.stream):
            return FrameError(code="bad_frame", message="a lane's header (stream: true) opens a lane of a Seam Link "
                                                        "(POST /v1/links), and a lane's header has stream: true")
        return header, max_step_bytes(header, ZSTD_SLACK)  # each part: one step's rows
    if length is None or length > header.raw_size + ZSTD_SLACK:
        return FrameError(code="bad_frame", message=f"body length {length} does not fit the header")
    return header, length


def _admit(found: HopSession | FrameError, header: FrameHeader, length: int,
           credential: str | None) -> Admitted | FrameError:
    if isinstance(found, FrameError):
        return found
    if (err := authorize(found, credential)) is not None:
        return err
    if (err := check_frame(found.view(), header)) is not None:
        return err
    return Admitted(found, header, length)


def authorize(hs: HopSession, credential: str | None) -> FrameError | None:
    """Whether `credential` is this hop's for the session (schemas/credentials.py)."""
    return check_credential(hs.credential, hs.route.expires_at, credential, time.time())


async def admit_frame(rt: NodeRuntime, raw: str | None, length: int | None, *,
                      credential: str | None = None) -> Admitted | FrameError:
    """Check a frame's header against its session before its body is read (waiting up to the
    grace period for the session's open directive)."""
    parsed = _parse(raw, length, False)
    if isinstance(parsed, FrameError):
        return parsed
    header, n = parsed
    return _admit(await rt.table.lookup(header.session_id), header, n, credential)


def admit_now(rt: NodeRuntime, raw: str | None, length: int | None, *,
              credential: str | None = None, lane: bool = False) -> Admitted | FrameError | None:
    """admit_frame without waiting: None when the session is not open (yet) on this hop.
    `lane`: the header opens a lane of a Seam Link (each step then at most `length` bytes)."""
    parsed = _parse(raw, length, lane)
    if isinstance(parsed, FrameError):
        return parsed
    header, n = parsed
    found = rt.table.find(header.session_id)
    if isinstance(found, FrameError) and found.code == "unknown_session":
        return None  # its open directive may still be on the way: admit_frame waits for it
    return _admit(found, header, n, credential)


def run_frame(rt: NodeRuntime, admitted: Admitted, body: bytes, wire_bytes: int,
              respond: Callable[[Reply], None], stream: RunStream | None = None, *,
              same_turn: bool = False) -> None:
    """Queue an admitted frame's rows and answer through `respond`, exactly once: at once with
    credit (or a refusal), or, for a final frame, when the tail's token has come back.

    A Decode Run answers through `stream` instead once its first token is out (a failure
    before that is an ordinary 502 through `respond`). `same_turn`: the frame was admitted in
    this same callback, its body already read, so nothing can have changed since admission."""
    header = admitted.header
    try:
        rows = decode_rows(header, body)
    except FrameFormatError as exc:
        respond(error_reply(FrameError(code="bad_frame", message=str(exc))))
        return
    hs = admitted.session
    if not same_turn:  # the body was awaited: another frame or a directive may have changed the session
        found = rt.table.find(header.session_id)
        if found is not hs:
            respond(error_reply(found if isinstance(found, FrameError) else
                                FrameError(code="unknown_session", message="session was replaced")))
            return
        if (err := check_frame(hs.view(), header)) is not None:
            respond(error_reply(err))
            return
    if not header.final:
        hs.accept(header, rows, wire_bytes, len(body))
        respond(ack_reply(hs, header.seq))
        return

    if header.is_run:
        _run(hs, header, rows, wire_bytes, len(body), respond, stream)
        return

    def answer(outcome: WireResult | RouteFailure) -> None:
        if isinstance(outcome, RouteFailure):
            respond(_failed(outcome))
        else:
            respond(ack_reply(hs, header.seq, outcome))

    hs.accept(header, rows, wire_bytes, len(body), reply=answer)


def _failed(failure: RouteFailure) -> Reply:
    return error_reply(FrameError(code="session_failed", message=failure.reason, failure=failure))


def _run(hs: HopSession, header: FrameHeader, rows: np.ndarray, wire_bytes: int, body_bytes: int,
         respond: Callable[[Reply], None], stream: RunStream | None) -> None:
    if stream is None:
        respond(error_reply(FrameError(code="bad_frame", message="this connection cannot carry a Decode Run's stream")))
        return

    held = HeldTokens(header.flush_ms / 1000)

    def emit(result: WireResult) -> bool:
        return stream.send(held.add(run_token_bytes(result)))

    def answer(outcome: WireResult | RouteFailure) -> None:
        if not isinstance(outcome, RouteFailure):
            stream.end([*held.take(), run_event(RunEvent(end=True, credit=hs.credit, done=hs.done))])
        elif stream.started or held.pending:
            stream.end([*held.take(), run_event(RunEvent(failure=outcome))])
        else:
            respond(_failed(outcome))

    hs.accept(header, rows, wire_bytes, body_bytes, reply=answer, emit=emit)


def _session_request(found: HopSession | FrameError, route_id: str | None, epoch: str | None,
                     credential: str | None) -> HopSession | FrameError:
    """The session a request about it (its route and epoch) names, or the refusal: the
    credential first, then the route and epoch."""
    if isinstance(found, FrameError):
        return found
    if (err := authorize(found, credential)) is not None:
        return err
    if route_id != found.route.route_id or epoch != str(found.route.epoch):
        return FrameError(code="route_mismatch", message="route or epoch does not match")
    return found


async def credit_reply(rt: NodeRuntime, session_id: str, query: Mapping[str, str],
                       credential: str | None) -> Reply:
    """Long-poll: answer once the session's credit passes `above` (or after CREDIT_POLL_S)."""
    found = _session_request(await rt.table.lookup(session_id), query.get("route_id"), query.get("epoch"), credential)
    if isinstance(found, FrameError):
        return error_reply(found)
    try:
        above = int(query.get("above", "-1"))
    except ValueError:
        return error_reply(FrameError(code="bad_frame", message="`above` must be an integer"))
    await found.wait_credit_above(above, CREDIT_POLL_S)
    if not found.open:
        gone = await rt.table.lookup(session_id, wait=False)
        if isinstance(gone, FrameError):
            return error_reply(gone)
    return Reply(200, CreditGrant(credit=found.credit, done=found.done).model_dump_json().encode())


def open_returns(rt: NodeRuntime, request: str, credential: str, answer: RunStream) -> Attached | FrameError:
    """Attach the head's Return Stream (a LANE_RETURN: `request` is a ReturnRequest's JSON) to a
    session on its tail (nodes/server/return_stream.py), or the refusal: the tail's own
    credential is required, as for a frame."""
    try:
        req = ReturnRequest.model_validate_json(request)
    except ValidationError as exc:
        return FrameError(code="bad_frame", message=f"bad Return Stream request: {exc.errors()[0]['msg']}")
    found = _session_request(rt.table.find(req.session_id), req.route_id, str(req.epoch), credential)
    if isinstance(found, FrameError):
        return found
    if not found.is_tail:
        return FrameError(code="bad_frame", message="only a route's tail has a Return Stream")
    return found.token_return.attach(answer)


class FrameHandlers:
    """The node's side of wire.server.FrameHandlers: what its frames mean."""

    def __init__(self, rt: NodeRuntime) -> None:
        self.rt = rt

    def admit_now(self, header: str | None, length: int | None, *,
                  credential: str | None = None) -> Admitted | FrameError | None:
        return admit_now(self.rt, header, length, credential=credential)

    def admit(self, header: str | None, length: int | None, *,
              credential: str | None = None) -> Awaitable[Admitted | FrameError]:
        return admit_frame(self.rt, header, length, credential=credential)

    def run(self, admitted: Admitted, body: bytes, wire_bytes: int, respond: Callable[[Reply], None],
            stream: RunStream | None, *, same_turn: bool) -> None:
        run_frame(self.rt, admitted, body, wire_bytes, respond, stream, same_turn=same_turn)

    def credit(self, session_id: str, query: Mapping[str, str], credential: str | None) -> Awaitable[Reply]:
        return credit_reply(self.rt, session_id, query, credential)

    def open_link(self, answer: RunStream, close: Callable[[], None]) -> LinkIn:
        from nodes.server.seam_link import LinkIn  # seam_link imports this module

        return LinkIn(self._admit_lane, functools.partial(open_returns, self.rt), answer, close)

    def _admit_lane(self, header: str, credential: str) -> Admitted | FrameError:
        """A lane's opening header, admitted like a frame's (its session must be open already:
        a run's first step follows the prompt's frames on this hop)."""
        admitted = admit_now(self.rt, header, None, credential=credential, lane=True)
        if admitted is None:
            return FrameError(code="unknown_session", message="a lane opened for a session this hop does not hold")
        return admitted

