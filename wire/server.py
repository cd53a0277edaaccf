"""The server side of the activation transport: a node's listening socket.

Frame-plane requests (POST /v1/frames, GET /v1/sessions/<id>/credit) are parsed by llhttp
(httptools) and served here; a connection whose request is anything else is handed, with the
bytes already read, to the node's aiohttp app (a protocol switch at a request boundary).

A frame crosses each hop twice (the frame in, the tail's token back), so whatever the server
does per request is paid twice per hop; past the head a decode step is not a request at all but
a part of a Seam Link's message. On the 2-core reference VM aiohttp
spent ~0.25 ms receiving a frame before its handler ran and ~0.35 ms building and sending its
small JSON reply; here the header is admitted in the callback that parsed it (before the body
is read: a refused frame's body is skipped), the frame runs in the callback that completed its
body, and its answer is written in one call by whoever decides it (docs/activation-protocol.md,
"The frame server"). What the frames mean is the node's business: a `FrameHandlers` object
admits, runs and answers them.

What it takes: HTTP/1.1 (and 1.0, except a Decode Run: its answer is chunked) with Content-Length bodies, `Expect: 100-continue`,
keep-alive, pipelining (answers in order), and one chunked request: a Seam Link (POST /v1/links,
one chunk per message of decode steps), whose answer streams while its body still arrives. llhttp refuses what a
real parser refuses (bad request lines, duplicate Content-Length, Transfer-Encoding with
Content-Length, bad chunk sizes and terminators); on top of it the plane takes only
`Transfer-Encoding: chunked`, one `x-meshnet-frame` header, and heads up to MAX_HEAD_BYTES.
A refusal answers 4xx and closes the connection after the answers owed before it; nothing
after the refused bytes is ever parsed, so a smuggled request never runs.

Connections are bounded (`ConnectionBounds`, from the node's options): a new connection must
begin its first request within `first_request_s` (a silent socket is closed after 2 s, so
idle sockets cannot pile up), a request head must arrive whole within `head_timeout_s` of its
first byte, a declared body must keep arriving (no byte of it for `body_timeout_s`, or slower
than `body_min_rate` bytes/s once `body_timeout_s` passed: 408 and the connection closes; the
frame never runs; wire/body_deadline.py), a keep-alive connection idle for `idle_timeout_s` between
requests is closed, and beyond `max_connections` in all or `max_connections_per_peer` from one
address a new connection gets 503 and is closed. A slowloris costs the node one socket for a bounded time
and never a session slot. A Seam Link's body has no deadline once a lane on it has been admitted
(its chunks come one per decode iteration; the gateway's stall watchdog bounds a route that
stops); until then it carries no credential, and a link that has admitted none within
`first_request_s` of its head is closed (else idle links, which anyone may open, held every
connection slot for good).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Protocol
from urllib.parse import parse_qsl, unquote

import httptools

from schemas.credentials import CREDENTIAL_HEADER
from schemas.frames import (
    FRAME_HEADER,
    FRAMES_PATH,
    LINKS_PATH,
    MAX_LINK_MESSAGE,
    RUN_CONTENT_TYPE,
    SESSIONS_PATH,
    FrameError,
    FrameHeader,
)
from wire.body_deadline import (
    DEFAULT_BODY_MIN_RATE,
    DEFAULT_BODY_TIMEOUT,
    body_deadline,
    body_late_message,
)
from wire.chunks import LAST_CHUNK, chunk_wire_bytes, encode_chunks

log = logging.getLogger("meshnet.wire.server")

MAX_HEAD_BYTES = 16 * 1024  # request line + headers
MAX_BUFFER = 8 * 1024 * 1024  # bytes held for requests not yet admitted before reading pauses
CREDIT_SUFFIX = "/credit"
SINGLE_HEADERS = frozenset({"content-length", "transfer-encoding", "host", FRAME_HEADER, CREDENTIAL_HEADER})
SWEEP_S = 0.5  # how often the server looks for connections past their deadline


@dataclass(frozen=True, slots=True)
class Reply:
    """One JSON answer of the frame plane."""

    status: int
    body: bytes


def error_reply(err: FrameError) -> Reply:
    """A FrameError as its HTTP status and JSON body."""
    return Reply(err.status, err.model_dump_json(exclude_none=True).encode())


def http_error(status: int, message: str) -> Reply:
    """A FrameError body for an HTTP-level refusal (its status is the HTTP one, not the code's)."""
    err = FrameError(code="engine_error" if status >= 500 else "bad_frame", message=message)
    return Reply(status, error_reply(err).body)


def render(reply: Reply, *, keep_alive: bool) -> bytes:
    """The HTTP/1.1 response bytes for a frame-plane reply."""
    phrase = HTTPStatus(reply.status).phrase
    conn = "" if keep_alive else "Connection: close\r\n"
    return (f"HTTP/1.1 {reply.status} {phrase}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(reply.body)}\r\n{conn}\r\n").encode() + reply.body


def session_of(path: str, suffix: str) -> str | None:
    """The session id of a `/v1/sessions/<id><suffix>` path (a credit long-poll's, a Return
    Stream's), else None."""
    prefix = SESSIONS_PATH + "/"
    if not (path.startswith(prefix) and path.endswith(suffix)):
        return None
    sid = unquote(path[len(prefix):-len(suffix)])
    return sid if sid and "/" not in sid else None


def frame_plane_get(path: str) -> bool:
    """Whether a GET is the frame plane's: a credit long-poll."""
    return session_of(path, CREDIT_SUFFIX) is not None


@dataclass(frozen=True, slots=True)
class ConnectionBounds:
    """How long a client may take, and how many connections it may hold."""

    first_request_s: float = 2.0
    head_timeout_s: float = 10.0
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT  # a body's most silence, and its grace before the rate floor
    body_min_rate: float = DEFAULT_BODY_MIN_RATE  # bytes/s a body must keep up after its grace
    idle_timeout_s: float = 300.0
    max_connections: int = 512
    max_connections_per_peer: int = 256


def overdue(waiting_for: str, since: float, now: float, bounds: ConnectionBounds, *,
            received: int = 0, last: float | None = None) -> str | None:
    """Why a connection waiting since `since` for `waiting_for` ("new": its first request,
    "head": bytes of a head are in, "body": a declared body, "idle": nothing between requests,
    "lane": a Seam Link's first admitted lane, "": the node is answering or a Seam Link runs)
    has overrun its wait, or None (pure). A body is judged by its progress, `received` bytes
    of it so far, the last of them at `last` (wire/body_deadline.py)."""
    if waiting_for == "body":
        due, why = body_deadline(since, since if last is None else last, received,
                                 bounds.body_timeout_s, bounds.body_min_rate)
        return body_late_message(why, bounds.body_timeout_s, bounds.body_min_rate) if now >= due else None
    limit = {"new": bounds.first_request_s, "head": bounds.head_timeout_s,
             "idle": bounds.idle_timeout_s, "lane": bounds.first_request_s}.get(waiting_for)
    if limit is None or now - since < limit:
        return None
    return f"request {waiting_for} not received within {limit:g} s"


# --- what the node plugs in -----------------------------------------------------------------


class AdmittedFrame(Protocol):
    """A frame whose header passed admission (opaque to the transport but for these two)."""

    @property
    def header(self) -> FrameHeader: ...

    @property
    def length(self) -> int:
        """Body bytes on the wire (a lane: the most one step's payload may carry)."""
        ...


class RunStream(Protocol):
    """Where a Decode Run's answer goes: a chunked HTTP response, one RunEvent per chunk."""

    @property
    def started(self) -> bool:
        """Whether the answer's head (200, chunked) has been written."""
        ...

    def send(self, events: Sequence[bytes]) -> bool:
        """Write `events` in one go (the answer's head first); False once the caller has gone.
        No events: only whether the caller is still there."""
        ...

    def end(self, events: Sequence[bytes]) -> None:
        """Write `events`, the last one ending the run, and end the answer."""
        ...

    def start(self) -> bool:
        """Write the answer's head now, before any event; False once the caller has gone."""
        ...


class LinkSink(Protocol):
    """The receiving end of one Seam Link (nodes/server/seam_link.py)."""

    max_chunk: int
    over: bool
    proven: bool  # a lane (or Return Stream) on it has been admitted: a credential holder's link

    def message(self, payload: bytes, wire_bytes: int) -> None: ...

    def end(self) -> None: ...

    def refuse(self, message: str) -> None: ...

    def lost(self) -> None: ...


class FrameHandlers(Protocol):
    """What the frames mean: the node's admission, execution and credit."""

    def admit_now(self, header: str | None, length: int | None, *,
                  credential: str | None = None) -> AdmittedFrame | FrameError | None:
        """Admit a frame's header (and the sender's credential) without waiting; None when
        its session is not open (yet)."""
        ...

    def admit(self, header: str | None, length: int | None, *,
              credential: str | None = None) -> Awaitable[AdmittedFrame | FrameError]:
        """Admit a frame's header, waiting for its session to open."""
        ...

    def run(self, admitted: AdmittedFrame, body: bytes, wire_bytes: int, respond: Callable[[Reply], None],
            stream: RunStream | None, *, same_turn: bool) -> None:
        """Run an admitted frame; answer exactly once through `respond` (or `stream`)."""
        ...

    def credit(self, session_id: str, query: Mapping[str, str], credential: str | None) -> Awaitable[Reply]:
        """A credit long-poll's answer."""
        ...

    def open_link(self, answer: RunStream, close: Callable[[], None]) -> LinkSink:
        """Start a Seam Link whose messages will be fed chunk by chunk (`close` drops the connection)."""
        ...


# --- one connection -------------------------------------------------------------------------


class _BadRequest(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class _HandOver(Exception):
    """The request is the aiohttp app's: stop parsing, move the connection."""


@dataclass(slots=True, eq=False)
class _Request:
    """One frame-plane request, from its head to its answer."""

    method: str
    path: str
    query: str
    headers: dict[str, str]
    keep_alive: bool
    http11: bool
    head_bytes: int
    length: int | None  # Content-Length; None for a chunked body (or a POST without one)
    chunked: bool
    body: bytearray = field(default_factory=bytearray)
    complete: bool = False  # the whole body has been parsed
    started: bool = False  # admission (or the credit poll) has begun
    admitted: AdmittedFrame | FrameError | None = None
    admitted_turn: int = -1  # the data callback that admitted it synchronously
    running: bool = False  # handed to the node, which answers it
    answered: bool = False
    discard: bool = False  # refused before its body: the body is skipped
    steps: list[bytes] = field(default_factory=list)  # a Seam Link's messages before it opened


class ChunkedAnswer:
    """A streamed answer on a FrameConnection: 200 with chunked RunEvents (RunStream).

    Each send is one write of one chunk per event: the response head goes out with the first,
    the last chunk with the final event; `done` runs once the answer is complete."""

    def __init__(self, conn: FrameConnection, keep_alive: bool, done: Callable[[], None]) -> None:
        self.conn = conn
        self.keep_alive = keep_alive
        self.done = done
        self.started = False
        self.ended = False

    def _head(self) -> bytes:
        if self.started:
            return b""
        self.started = True
        conn = "" if self.keep_alive else "Connection: close\r\n"
        return (f"HTTP/1.1 200 OK\r\nContent-Type: {RUN_CONTENT_TYPE}\r\nTransfer-Encoding: chunked\r\n"
                f"Cache-Control: no-store\r\n{conn}\r\n").encode()

    def send(self, events: Sequence[bytes]) -> bool:
        t = self.conn.transport
        if self.ended or t is None or t.is_closing():
            return False
        if events:
            t.write(self._head() + encode_chunks(events))
        return True

    def start(self) -> bool:
        """Write the response head now, before any event (a Seam Link's answer)."""
        t = self.conn.transport
        if self.ended or t is None or t.is_closing():
            return False
        t.write(self._head())
        return True

    def end(self, events: Sequence[bytes]) -> None:
        if self.ended:
            return
        self.ended = True
        t = self.conn.transport
        if t is not None and not t.is_closing():
            t.write(self._head() + encode_chunks(events) + LAST_CHUNK)
            if not self.keep_alive:
                t.close()
        self.done()


class FrameConnection(asyncio.Protocol):
    """One client connection: llhttp parses its requests as they arrive; they are served one
    at a time, in order (a pipelined request waits, body and all, for the answers before it)."""

    def __init__(self, server: FrameServer) -> None:
        self.server = server
        self.handlers = server.handlers
        self.transport: asyncio.Transport | None = None
        self._parser = httptools.HttpRequestParser(self)
        self._queue: deque[_Request] = deque()  # parsed heads, in order; the first is being served
        self._cur: _Request | None = None  # the request whose head or body is being parsed
        self._parsing = False  # between a message's begin and its end
        self._url = bytearray()
        self._headers: dict[str, str] = {}
        self._head_bytes = 0
        self._headers_done = False
        self._raw: list[bytes] | None = None  # the current request's bytes, while it may go to the app
        self._fresh = False  # this data callback began between two requests
        self._chunk = b""  # this data callback's bytes
        self._turn = 0  # counts data callbacks
        self._link: LinkSink | None = None  # the open Seam Link (the first request)
        self._step_buf = bytearray()
        self._task: asyncio.Task[None] | None = None  # an admission or credit poll in progress
        self._fatal: tuple[int, str] | None = None  # a refusal owed once the answers before it are out
        self._handover: list[bytes] | None = None  # bytes for the app, once the answers before them are out
        self._dead = False  # the parser stopped (a refusal or a hand-over): nothing more is parsed
        self._paused = False
        self.closed = False
        self._since = 0.0  # when the current wait (see `waiting_for`) began
        self._waiting = "new"
        self._got = 0  # bytes received during the current wait (a body's progress)
        self._last = 0.0  # when the last of them came
        self.peer = ""  # the client's address (ConnectionBounds.max_connections_per_peer)
        self.counted = False  # counted in FrameServer.per_peer (until it closes, here or in the app)

    # --- deadlines ---------------------------------------------------------------------------

    def waiting_for(self) -> str:
        """What this connection waits for from its client now (see `overdue`)."""
        if self._link is not None:
            return "" if self._link.proven else "lane"  # a Seam Link runs, or has yet to show a credential
        front = self._queue[0] if self._queue else None
        if front is not None and (front.running or (front.complete and not front.answered)):
            return ""  # the node is answering
        if self._parsing:
            return "body" if self._headers_done else "head"
        if front is not None and not front.complete:
            return "body"
        return "idle" if self._turn else "new"

    def _mark(self) -> None:
        """Start the clock of a new wait when what the connection waits for changed."""
        now = self.waiting_for()
        if now != self._waiting:
            self._waiting = now
            self._since = self._last = asyncio.get_running_loop().time()
            self._got = 0

    def check_deadline(self, now: float, bounds: ConnectionBounds) -> None:
        """Close the connection if its client overran its current wait."""
        self._mark()
        why = overdue(self._waiting, self._since, now, bounds, received=self._got, last=self._last)
        if why is None or self.closed:
            return
        what = self._waiting
        self._dead = True
        if self._task is not None:
            self._task.cancel()
        front = self._queue[0] if self._queue else None
        if what in ("new", "idle", "lane") or (front is not None and front.answered):  # nothing is waiting for an answer
            self._drop()
        else:
            self._respond(http_error(408, why), keep_alive=False)
        self._queue.clear()

    # --- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self._since = asyncio.get_running_loop().time()
        peername = transport.get_extra_info("peername")
        self.peer = str(peername[0]) if isinstance(peername, tuple) and peername else ""
        refusal = self.server.admit(self)
        if refusal is not None:
            self._dead = True
            self._respond(http_error(503, refusal), keep_alive=False)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._dead = True
        self.server.forget(self)
        if self._task is not None:
            self._task.cancel()
        link, self._link = self._link, None
        if link is not None:
            link.lost()
        # a frame already handed to its session keeps running: the session owns it, not this connection

    def data_received(self, data: bytes) -> None:
        if self._handover is not None:
            self._handover.append(data)
            self._pause_if(sum(map(len, self._handover)))
            return
        if self._dead:
            return
        was = self._waiting
        self._turn += 1
        self._chunk = data
        self._fresh = not self._parsing
        if self._parsing and self._raw is not None:
            self._raw.append(data)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            cause = exc.__context__
            if isinstance(cause, _HandOver):
                self._handover = self._raw or []
                self._stop_parsing()
                self._advance()
            elif isinstance(cause, _BadRequest):
                self._refuse(cause.status, str(cause))
            else:
                log.error("frame request failed", exc_info=cause or exc)
                self._refuse(500, f"internal error: {type(cause or exc).__name__}")
        except httptools.HttpParserError as exc:
            self._refuse(400, f"malformed request: {exc}")
        self._pause_if(self._held())
        self._mark()
        if was == "body" and self._waiting == "body":  # the body it waits for moves on
            self._got += len(data)
            self._last = asyncio.get_running_loop().time()

    # --- llhttp callbacks --------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._parsing = True
        self._headers_done = False
        self._url.clear()
        self._headers = {}
        self._head_bytes = 0
        self._cur = None
        # where this request began is known only if it began a data callback: then its bytes
        # are that callback's data and what follows
        self._raw = [self._chunk] if self._fresh else None
        self._fresh = False

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._count(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + 4)
        key = name.decode("latin-1").lower()
        if key in SINGLE_HEADERS and key in self._headers:  # two lengths: which one frames the body?
            raise _BadRequest(400, f"more than one {name.decode('latin-1')} header")
        self._headers[key] = value.decode("latin-1").strip()

    def _count(self, n: int) -> None:
        self._head_bytes += n
        if self._head_bytes > MAX_HEAD_BYTES:
            raise _BadRequest(431, "request head too large")

    def on_headers_complete(self) -> None:
        self._headers_done = True
        target = self._url.decode("latin-1")
        path, _, query = target.partition("?")
        method = self._parser.get_method().decode("latin-1")
        if not (path in (FRAMES_PATH, LINKS_PATH) or (method == "GET" and frame_plane_get(path))):
            if self._raw is None:
                raise _BadRequest(400, "a request for the node's app may not be pipelined in one packet "
                                       "behind frame-plane requests; send it on its own connection")
            raise _HandOver
        self._raw = None
        headers = self._headers
        te = headers.get("transfer-encoding")
        if te is not None and te.lower() != "chunked":
            raise _BadRequest(400, f"unsupported Transfer-Encoding {te[:40]!r} (only chunked)")
        raw_length = headers.get("content-length")
        length = int(raw_length) if raw_length is not None else (None if method == "POST" else 0)
        req = _Request(method, path, query, headers, self._parser.should_keep_alive(),
                       self._parser.get_http_version() == "1.1",
                       len(method) + len(target) + 13 + self._head_bytes + 2, length, te is not None)
        self._cur = req
        self._queue.append(req)
        if len(self._queue) == 1:
            self._start(req)

    def on_body(self, body: bytes) -> None:
        req = self._cur
        if req is None or req.discard:
            return
        if req.chunked:
            self._step_buf += body
            link = self._link
            limit = link.max_chunk if link is not None else MAX_LINK_MESSAGE
            if len(self._step_buf) > limit:
                raise _BadRequest(400, f"a Seam Link message over {limit} bytes")
        else:
            req.body += body

    def on_chunk_complete(self) -> None:
        req = self._cur
        if req is None or not self._step_buf:
            return  # the last (empty) chunk: the message's end follows
        payload = bytes(self._step_buf)
        self._step_buf.clear()
        if req.discard:
            return
        link = self._link
        if link is None:
            req.steps.append(payload)  # the link has not started yet (a request before it is served)
        elif not link.over:
            link.message(payload, chunk_wire_bytes(payload))

    def on_message_complete(self) -> None:
        self._parsing = False
        req, self._cur = self._cur, None
        if req is None:
            return
        req.complete = True
        if self._queue and self._queue[0] is req:
            self._proceed(req)

    # --- serving the first request -----------------------------------------------------------

    def _start(self, req: _Request) -> None:
        """The request is now the first: admit it (before its body is read)."""
        req.started = True
        if req.path == LINKS_PATH:
            if req.method != "POST" or not req.chunked:
                req.discard = True
                self._respond_to(req, http_error(400, "a Seam Link is a POST with a chunked body"), keep_alive=False)
            else:
                self._open_link(req)
            return
        if req.path != FRAMES_PATH:
            if req.complete:
                self._proceed(req)
            return  # a credit poll starts once its (empty) body is in
        if req.method != "POST":
            req.admitted = FrameError(code="bad_frame", message="frames are POSTed")
            self._respond_to(req, http_error(405, "frames are POSTed"))
            return
        if req.chunked:
            req.admitted = FrameError(code="bad_frame", message="a frame has a Content-Length body; a Decode Run's "
                                                                "steps go on a Seam Link (POST /v1/links)")
            self._proceed(req)
            return
        admitted = self.handlers.admit_now(req.headers.get(FRAME_HEADER), req.length,
                                           credential=req.headers.get(CREDENTIAL_HEADER))
        if admitted is None:  # the session may still be opening: wait for its directive
            self._task = asyncio.get_running_loop().create_task(self._admit_later(req))
            return
        req.admitted, req.admitted_turn = admitted, self._turn
        self._proceed(req)

    async def _admit_later(self, req: _Request) -> None:
        try:
            req.admitted = await self.handlers.admit(req.headers.get(FRAME_HEADER), req.length,
                                                     credential=req.headers.get(CREDENTIAL_HEADER))
        finally:
            self._task = None
        if not self.closed and self._queue and self._queue[0] is req:
            self._proceed(req)
            self._resume()
            self._mark()

    def _proceed(self, req: _Request) -> None:
        """Take the first request as far as what has arrived allows."""
        if req.answered:
            self._finish(req)
            return
        if req.path == LINKS_PATH:
            self._open_link(req)
            return
        if req.path != FRAMES_PATH:
            if req.complete and not req.running:
                self._credit(req)
            return
        admitted = req.admitted
        if admitted is None:
            return  # admission is still waiting
        if isinstance(admitted, FrameError):
            req.discard = True
            self._step_buf.clear()
            # a body of unknown length, or one a 100-continue client may now never send: close
            keep = req.keep_alive and not req.chunked and (req.complete or "expect" not in req.headers)
            self._respond_to(req, error_reply(admitted), keep_alive=keep)
            return
        if req.running:
            return
        if not req.complete:
            if req.headers.get("expect", "").lower() == "100-continue" and self.transport is not None:
                req.headers.pop("expect")
                self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            return
        req.running = True
        body = bytes(req.body)
        req.body.clear()
        stream = (ChunkedAnswer(self, req.keep_alive, lambda: self._answered(req))
                  if admitted.header.is_run and req.http11 else None)
        self.handlers.run(admitted, body, req.head_bytes + len(body),
                          lambda reply: self._respond_to(req, reply), stream,
                          same_turn=req.admitted_turn == self._turn)

    def _credit(self, req: _Request) -> None:
        sid = session_of(req.path, CREDIT_SUFFIX)
        assert sid is not None
        req.running = True

        async def poll() -> None:
            try:
                reply = await self.handlers.credit(sid, dict(parse_qsl(req.query)), req.headers.get(CREDENTIAL_HEADER))
            finally:
                self._task = None
            self._respond_to(req, reply)

        self._task = asyncio.get_running_loop().create_task(poll())

    def _open_link(self, req: _Request) -> None:
        if self._link is None and not req.running and not req.discard:
            req.running = True
            answer = ChunkedAnswer(self, req.keep_alive, lambda: self._answered(req))
            link = self._link = self.handlers.open_link(answer, self._drop)
            for payload in req.steps:
                if not link.over:
                    link.message(payload, chunk_wire_bytes(payload))
            req.steps.clear()
        if req.complete and self._link is not None:
            link, self._link = self._link, None
            if not link.over:
                link.end()  # its answer's end completes the request

    def _respond_to(self, req: _Request, reply: Reply, *, keep_alive: bool | None = None) -> None:
        """Write the answer of `req` (the first request) and go on."""
        keep = req.keep_alive if keep_alive is None else keep_alive
        self._respond(reply, keep)
        if not keep:
            self._dead = True
        self._answered(req)

    def _answered(self, req: _Request) -> None:
        req.answered = True
        self._finish(req)

    def _finish(self, req: _Request) -> None:
        """A request that is answered and whole leaves the queue; the next one starts."""
        if not (req.answered and req.complete):
            return
        if self._queue and self._queue[0] is req:
            self._queue.popleft()
        asyncio.get_running_loop().call_soon(self._advance)  # not recursively: pipelined answers

    def _advance(self) -> None:
        """Serve the next parsed request; or, once all answers are out, the refusal or the
        hand-over that stopped parsing."""
        if self.closed or self.transport is None or self.transport.is_closing():
            return
        if self._queue:
            front = self._queue[0]
            if not front.started:
                self._start(front)
            self._resume()
            self._mark()
            return
        if self._fatal is not None:
            status, message = self._fatal
            self._fatal = None
            self._respond(http_error(status, message), keep_alive=False)
        elif self._handover is not None:
            self._hand_over()
        else:
            self._resume()
            self._mark()

    # --- refusals ----------------------------------------------------------------------------

    def _refuse(self, status: int, message: str) -> None:
        """Bytes llhttp or the plane refuses: nothing after them is parsed; the client gets
        the refusal after the answers it is owed, and the connection closes."""
        cur = self._cur
        self._stop_parsing()
        if cur is not None and self._queue and self._queue[0] is cur:  # the request being served
            if self._link is not None:
                link, self._link = self._link, None
                link.refuse(f"bad chunk: {message}")  # ends its lanes
                self._drop()
                return
            if self._task is not None:
                self._task.cancel()
            if not cur.running and not cur.answered:
                self._queue.clear()
                self._respond(http_error(status, message), keep_alive=False)
                return
        elif cur is not None and cur in self._queue:
            self._queue.remove(cur)
        self._fatal = (status, message)
        if not self._queue:
            self._advance()

    def _stop_parsing(self) -> None:
        self._dead = True
        self._parsing = False
        self._cur = None
        self._raw = None

    def _drop(self) -> None:
        self._dead = True
        if self.transport is not None:
            self.transport.close()

    def _respond(self, reply: Reply, keep_alive: bool) -> None:
        t = self.transport
        if t is None or t.is_closing():
            return
        t.write(render(reply, keep_alive=keep_alive))
        if not keep_alive:
            t.close()

    # --- flow control ------------------------------------------------------------------------

    def _held(self) -> int:
        """Body bytes held for requests not admitted yet (pipelined, or awaiting their session)."""
        held = len(self._step_buf)
        for req in self._queue:
            if not (req.running or (req.admitted is not None and req is self._queue[0])):
                held += len(req.body) + sum(map(len, req.steps))
        return held

    def _pause_if(self, held: int) -> None:
        if held > MAX_BUFFER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def _resume(self) -> None:
        if self._paused and self.transport is not None and self._held() <= MAX_BUFFER:
            self._paused = False
            self.transport.resume_reading()

    def _hand_over(self) -> None:
        """Give this connection, and the bytes of its request for the app, to the aiohttp app."""
        t = self.transport
        assert t is not None and self._handover is not None
        self.server.connections.discard(self)  # no longer swept here, but still counted for its address
        self.transport = None
        proto = _StillCounted(self.server.fallback(), lambda: self.server.forget(self))
        t.set_protocol(proto)
        proto.connection_made(t)
        data, self._handover = b"".join(self._handover), None
        if self._paused:
            self._paused = False
            t.resume_reading()
        if data:
            proto.data_received(data)

    @property
    def task(self) -> asyncio.Task[None] | None:
        """The admission or credit poll in progress, if any."""
        return self._task

    def abort(self) -> None:
        """Close the connection now and stop its request (node shutdown)."""
        if self._task is not None:
            self._task.cancel()
        if self.transport is not None:
            self.transport.close()


class _StillCounted(asyncio.Protocol):
    """The app's protocol for a connection handed to it, telling the frame server when the
    connection closes (so its address's count stays right)."""

    def __init__(self, inner: asyncio.Protocol, on_lost: Callable[[], None]) -> None:
        self.inner = inner
        self.on_lost = on_lost

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self.on_lost()
        self.inner.connection_lost(exc)


class FrameServer:
    """The node's listener: the frame plane here, everything else through `fallback`."""

    def __init__(self, handlers: FrameHandlers, fallback: Callable[[], asyncio.Protocol],
                 bounds: ConnectionBounds | None = None) -> None:
        self.handlers = handlers
        self.fallback = fallback  # a protocol factory, e.g. aiohttp's web.Server
        self.bounds = bounds or ConnectionBounds()
        self.connections: set[FrameConnection] = set()
        self.per_peer: dict[str, int] = {}  # open connections by client address
        self._server: asyncio.Server | None = None
        self._sweeper: asyncio.Task[None] | None = None

    def admit(self, conn: FrameConnection) -> str | None:
        """Count a new connection in, or say why it is refused (too many in all, or from its address)."""
        b = self.bounds
        if len(self.connections) >= b.max_connections:
            return f"too many connections (at most {b.max_connections})"
        if self.per_peer.get(conn.peer, 0) >= b.max_connections_per_peer:
            return f"too many connections from {conn.peer} (at most {b.max_connections_per_peer})"
        self.connections.add(conn)
        self.per_peer[conn.peer] = self.per_peer.get(conn.peer, 0) + 1
        conn.counted = True
        return None

    def forget(self, conn: FrameConnection) -> None:
        """A connection closed (or one handed to the app did): its address may open another."""
        if not conn.counted:
            return
        conn.counted = False
        self.connections.discard(conn)
        left = self.per_peer.get(conn.peer, 1) - 1
        if left > 0:
            self.per_peer[conn.peer] = left
        else:
            self.per_peer.pop(conn.peer, None)

    async def start(self, sock: object) -> None:
        """Serve on an already bound, listening socket."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: FrameConnection(self), sock=sock)  # type: ignore[arg-type]
        self._sweeper = loop.create_task(self._sweep(), name="frame-deadlines")

    async def _sweep(self) -> None:
        """Close connections whose client overran a deadline (ConnectionBounds)."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(SWEEP_S)
            now = loop.time()
            for conn in list(self.connections):
                try:
                    conn.check_deadline(now, self.bounds)
                except Exception:  # one connection's trouble never stops the sweep
                    log.exception("deadline check failed")

    async def close(self, grace_s: float = 0.5) -> None:
        """Stop listening, let replies already decided go out, close every connection."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        if self._server is not None:
            self._server.close()
        busy = [c.task for c in self.connections if c.task is not None]
        if busy:
            await asyncio.wait(busy, timeout=grace_s)
        for conn in list(self.connections):
            conn.abort()
        self.connections.clear()
        self.per_peer.clear()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
