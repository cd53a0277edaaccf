"""FrameServer: the node's listening socket. Frame-plane requests take a lean HTTP/1.1 path;
every other request is handed, with its connection, to the node's aiohttp app.

A decode step crosses each hop twice (the frame in, the tail's token back), so whatever the
HTTP server does per request is paid twice per hop per token. On the 2-core reference VM
aiohttp spent ~0.25 ms receiving a frame before the handler ran and ~0.35 ms building and
sending its small JSON reply; this path parses the request head itself, runs the
transport-independent handlers of nodes/server/frame_plane.py and writes the reply in one
call (docs/activation-protocol.md, "The frame server").

Connections are bounded (`ConnectionBounds`, from the node's options): a request head must
arrive whole within `head_timeout_s` of its first byte, a declared body within
`body_timeout_s` of its head (else 408 and the connection closes; the frame never runs),
a keep-alive connection idle for `idle_timeout_s` is closed, and beyond `max_connections`
a new connection gets 503 and is closed. A slowloris costs the node one socket for a bounded
time and never a session slot. A Step Stream's body has no deadline (its chunks come one per
decode step; the gateway's stall watchdog bounds a route that stops).

What it accepts: HTTP/1.1 (or 1.0) requests with a Content-Length body, `Expect: 100-continue`,
keep-alive, and one chunked request: a Step Stream (a FrameHeader with `stream`, one chunk per
decode step, nodes/server/step_stream.py), whose answer streams while its body is still
arriving. A connection stays on this path while it carries POST /v1/frames and
GET /v1/sessions/<id>/credit; its first other request moves the whole connection to aiohttp
(a protocol switch at a request boundary, with the bytes already read).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from urllib.parse import parse_qsl, unquote

from nodes.server.frame_plane import (
    Admitted,
    Reply,
    RunStream,
    admit_frame,
    admit_now,
    credit_reply,
    error_reply,
    run_frame,
)
from nodes.server.runtime import NodeRuntime
from nodes.server.step_stream import StepStreamIn
from schemas.frames import (
    FRAME_HEADER,
    FRAMES_PATH,
    LAST_CHUNK,
    RUN_CONTENT_TYPE,
    SESSIONS_PATH,
    FrameError,
    encode_chunks,
    take_chunk,
)

log = logging.getLogger("meshnet.node.frames")

MAX_HEAD_BYTES = 16 * 1024  # request line + headers
MAX_BUFFER = 8 * 1024 * 1024  # bytes read ahead of the handler before reading pauses
CREDIT_SUFFIX = "/credit"
SINGLE_HEADERS = frozenset({"content-length", "transfer-encoding", "host", FRAME_HEADER.lower()})
SWEEP_S = 0.5  # how often the server looks for connections past their deadline


@dataclass(frozen=True, slots=True)
class ConnectionBounds:
    """How long a client may take, and how many connections it may hold."""

    head_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    idle_timeout_s: float = 300.0
    max_connections: int = 512


def overdue(waiting_for: str, since: float, now: float, bounds: ConnectionBounds) -> str | None:
    """What a connection waiting since `since` for `waiting_for` ("head": bytes of a head are
    in, "body": a declared body, "idle": nothing between requests, "" : the node is answering
    or a Step Stream runs) has overrun, or None (pure)."""
    limit = {"head": bounds.head_timeout_s, "body": bounds.body_timeout_s,
             "idle": bounds.idle_timeout_s}.get(waiting_for)
    if limit is None or now - since < limit:
        return None
    return waiting_for


@dataclass(frozen=True, slots=True)
class RequestHead:
    """A parsed HTTP/1.x request head."""

    method: str
    path: str
    query: str
    headers: dict[str, str]  # lower-case names
    size: int  # bytes of the head on the wire, blank line included
    keep_alive: bool
    version: str = "HTTP/1.1"

    @property
    def content_length(self) -> int | None:
        raw = self.headers.get("content-length")
        if raw is None:
            return None if self.method == "POST" else 0
        return int(raw) if raw.isascii() and raw.isdigit() and len(raw) <= 15 else -1


class BadRequest(Exception):
    """A request head that cannot be parsed; the connection answers and closes."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def parse_head(raw: bytes) -> RequestHead:
    """Parse `raw` (the head up to and including the blank line); raise BadRequest."""
    try:
        text = raw.decode("latin-1")
        line, *lines = text[:-4].split("\r\n")
        method, target, version = line.split(" ")
    except ValueError:
        raise BadRequest(400, "malformed request line") from None
    if not version.startswith("HTTP/1."):
        raise BadRequest(505, f"unsupported protocol {version!r}")
    headers: dict[str, str] = {}
    for h in lines:
        name, sep, value = h.partition(":")
        if not sep or not name or name != name.strip():
            raise BadRequest(400, "malformed header line")
        key = name.lower()
        if key in headers and key in SINGLE_HEADERS:  # two lengths: which one frames the body?
            raise BadRequest(400, f"more than one {name} header")
        headers[key] = value.strip()
    te = headers.get("transfer-encoding")
    if te is not None:
        if te.lower() != "chunked":
            raise BadRequest(400, f"unsupported Transfer-Encoding {te[:40]!r} (only chunked)")
        if "content-length" in headers:
            raise BadRequest(400, "Transfer-Encoding together with Content-Length")
    path, _, query = target.partition("?")
    conn = headers.get("connection", "").lower()
    keep = conn != "close" if version == "HTTP/1.1" else conn == "keep-alive"
    return RequestHead(method, path, query, headers, len(raw), keep, version)


def credit_session(path: str) -> str | None:
    """The session id of a credit long-poll path, else None."""
    prefix = SESSIONS_PATH + "/"
    if not (path.startswith(prefix) and path.endswith(CREDIT_SUFFIX)):
        return None
    sid = unquote(path[len(prefix):-len(CREDIT_SUFFIX)])
    return sid if sid and "/" not in sid else None


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


class ChunkedAnswer:
    """A Decode Run's answer on a FrameConnection: 200 with chunked RunEvents (RunStream).

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
    """One client connection: serves frame-plane requests one at a time, in order."""

    def __init__(self, server: FrameServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._task: asyncio.Task[None] | None = None  # the request in progress
        self._body: tuple[int, asyncio.Future[bytes]] | None = None  # bytes the handler waits for
        self._discard = 0  # body bytes of a refused frame still to skip
        self._answering = False  # a frame served without a task awaits its answer
        self._steps: StepStreamIn | None = None  # the Step Stream whose body is being read
        self._paused = False
        self.closed = False
        self._since = 0.0  # when the current wait (see `waiting_for`) began
        self._waiting = "idle"

    def waiting_for(self) -> str:
        """What this connection waits for from its client now (see `overdue`)."""
        if self._steps is not None or (self._task is not None and self._body is None) or self._answering:
            return ""  # the node is answering, or a Step Stream runs
        if self._body is not None or self._discard:
            return "body"
        return "head" if self._buf else "idle"

    def _mark(self) -> None:
        """Start the clock of a new wait when what the connection waits for changed."""
        now = self.waiting_for()
        if now != self._waiting:
            self._waiting = now
            self._since = asyncio.get_running_loop().time()

    def check_deadline(self, now: float, bounds: ConnectionBounds) -> None:
        """Close the connection if its client overran its current wait."""
        self._mark()
        what = overdue(self._waiting, self._since, now, bounds)
        if what is None or self.closed:
            return
        if self._body is not None and not self._body[1].done():
            self._body[1].set_exception(TimeoutError("the body did not arrive in time"))
            self._body = None
        if what == "idle" or (what == "body" and self._discard):  # nothing is waiting for an answer
            self._drop()
        else:
            self._fail(408, f"request {what} not received within "
                            f"{bounds.head_timeout_s if what == 'head' else bounds.body_timeout_s:g} s")
        self._buf.clear()

    # --- asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self._since = asyncio.get_running_loop().time()
        if len(self.server.connections) >= self.server.bounds.max_connections:
            self._fail(503, f"too many connections (at most {self.server.bounds.max_connections})")
            return
        self.server.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.connections.discard(self)
        if self._body is not None and not self._body[1].done():
            self._body[1].set_exception(ConnectionResetError("client closed the connection"))
        steps, self._steps = self._steps, None
        if steps is not None:
            steps.lost()
        # a frame already queued keeps running: its session owns it, not this connection

    def data_received(self, data: bytes) -> None:
        if self._discard:
            n = min(self._discard, len(data))
            self._discard -= n
            data = data[n:]
        self._buf += data
        if self._steps is not None:
            self._feed_steps()
        elif self._body is not None:
            self._feed_body()
        elif self._task is None and not self._answering:
            self._next_request()
        if len(self._buf) > MAX_BUFFER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._mark()

    # --- requests -----------------------------------------------------------------------

    def _next_request(self) -> None:
        end = self._buf.find(b"\r\n\r\n")
        if end < 0:
            if len(self._buf) > MAX_HEAD_BYTES:
                self._fail(431, "request head too large")
            return
        if end + 4 > MAX_HEAD_BYTES:
            self._fail(431, "request head too large")
            return
        raw = bytes(self._buf[:end + 4])
        try:
            head = parse_head(raw)
        except BadRequest as exc:
            self._fail(exc.status, str(exc))
            return
        if not self._is_ours(head):
            self._hand_over()
            return
        del self._buf[:end + 4]
        self._resume()
        if head.method == "POST" and "transfer-encoding" in head.headers:  # chunked (parse_head)
            self._open_steps(head)
            return
        if self._serve_now(head):
            return
        self._task = asyncio.get_running_loop().create_task(self._serve(head))
        self._task.add_done_callback(self._served)

    def _serve_now(self, head: RequestHead) -> bool:
        """The common case without a task: a frame whose body has arrived, for a live session.

        Admission, the body and queueing all run here, in the callback that read the bytes;
        the answer is written by whoever decides it (at once, or the session's worker)."""
        length = head.content_length
        if (head.method != "POST" or head.path != FRAMES_PATH or length is None or length < 0
                or len(self._buf) < length or "expect" in head.headers
                or "transfer-encoding" in head.headers):
            return False
        admitted = admit_now(self.server.runtime, head.headers.get(FRAME_HEADER), length)
        if admitted is None:
            return False  # the session may still be opening: the task path waits for it
        body = bytes(self._buf[:length])
        del self._buf[:length]
        if isinstance(admitted, FrameError):
            self._respond(error_reply(admitted), head.keep_alive)
            asyncio.get_running_loop().call_soon(self._after_answer)  # not recursively: pipelined refusals
            return True
        self._answering = True

        def answered() -> None:
            self._answering = False
            asyncio.get_running_loop().call_soon(self._after_answer)

        def respond(reply: Reply) -> None:
            self._respond(reply, head.keep_alive)
            answered()

        run_frame(self.server.runtime, admitted, body, head.size + length, respond,
                  self._stream_for(admitted, head, answered), same_turn=True)
        return True

    def _stream_for(self, admitted: Admitted, head: RequestHead, done: Callable[[], None]) -> RunStream | None:
        """The chunked answer a Decode Run streams into (HTTP/1.1 clients only)."""
        if not admitted.header.is_run or head.version != "HTTP/1.1":
            return None
        return ChunkedAnswer(self, head.keep_alive, done)

    def _after_answer(self) -> None:
        """Go on with the next request already read, if any (keep-alive, pipelining)."""
        self._mark()
        if (self._task is None and not self._answering and not self.closed
                and self.transport is not None and not self.transport.is_closing()):
            self._next_request()

    def _is_ours(self, head: RequestHead) -> bool:
        if head.path == FRAMES_PATH:
            return True  # POST, or a clear 405 for any other method
        return head.method == "GET" and credit_session(head.path) is not None

    # --- Step Streams: a chunked frame request, one chunk per decode step --------------------

    def _open_steps(self, head: RequestHead) -> None:
        """A chunked POST /v1/frames (the only chunked request this path takes, _is_ours)."""
        admitted = admit_now(self.server.runtime, head.headers.get(FRAME_HEADER), None, chunked=True)
        if admitted is None:  # the session may still be opening
            self._task = asyncio.get_running_loop().create_task(self._open_steps_later(head))
            self._task.add_done_callback(self._served)
            return
        self._start_steps(admitted, head)

    async def _open_steps_later(self, head: RequestHead) -> None:
        admitted = await admit_frame(self.server.runtime, head.headers.get(FRAME_HEADER), None, chunked=True)
        self._start_steps(admitted, head)

    def _start_steps(self, admitted: Admitted | FrameError, head: RequestHead) -> None:
        if isinstance(admitted, FrameError):
            self._respond(error_reply(admitted), keep_alive=False)  # the body's length is unknown
            return
        self._answering = True

        def done() -> None:
            self._answering = False
            asyncio.get_running_loop().call_soon(self._after_answer)

        answer = ChunkedAnswer(self, head.keep_alive and head.version == "HTTP/1.1", done)
        self._steps = StepStreamIn(admitted.session, admitted.header, admitted.length, answer, self._drop)
        self._feed_steps()

    def _feed_steps(self) -> None:
        """Run every whole step chunk read so far; the last chunk ends the stream's body."""
        while (steps := self._steps) is not None:
            if steps.over:  # refused, or its answer could not be written: the connection is closing
                self._steps = None
                self._buf.clear()
                return
            try:
                payload = take_chunk(self._buf, steps.max_chunk)
            except ValueError as exc:
                self._steps = None
                steps.refuse(f"bad Step Stream chunk: {exc}")
                self._buf.clear()
                return
            if payload is None:
                break
            if not payload:  # the body's end: what follows is the next request, read after the answer
                self._steps = None
                steps.end()
                return
            steps.step(payload, len(payload) + len(b"%x" % len(payload)) + 4)
        self._resume()

    def _drop(self) -> None:
        if self.transport is not None:
            self.transport.close()

    async def _serve(self, head: RequestHead) -> None:
        if head.path == FRAMES_PATH:
            if head.method != "POST":
                self._respond(http_error(405, "frames are POSTed"), head.keep_alive)
                return
            await self._serve_frame(head)
        else:
            sid = credit_session(head.path)
            assert sid is not None
            reply = await credit_reply(self.server.runtime, sid, dict(parse_qsl(head.query)))
            self._respond(reply, head.keep_alive)

    async def _serve_frame(self, head: RequestHead) -> None:
        length = head.content_length
        if length is not None and length < 0:
            self._respond(error_reply(FrameError(code="bad_frame", message="bad Content-Length")), keep_alive=False)
            return
        admitted = await admit_frame(self.server.runtime, head.headers.get(FRAME_HEADER), length)
        if isinstance(admitted, FrameError):
            keep = head.keep_alive and length is not None
            if keep:
                self._skip(length or 0)
            self._respond(error_reply(admitted), keep)
            return
        if head.headers.get("expect", "").lower() == "100-continue" and self.transport is not None:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        try:
            body = await self._read_body(admitted)
        except (ConnectionResetError, TimeoutError):
            return  # gone, or too slow (answered 408 by the deadline sweep): the frame never runs
        answered: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def done() -> None:
            if not answered.done():
                answered.set_result(None)

        def respond(reply: Reply) -> None:
            self._respond(reply, head.keep_alive)  # written where the answer is decided
            done()

        run_frame(self.server.runtime, admitted, body, head.size + len(body), respond,
                  self._stream_for(admitted, head, done))
        await answered  # the next request on this connection waits for this answer

    def _read_body(self, admitted: Admitted) -> asyncio.Future[bytes]:
        fut: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._body = (admitted.length, fut)
        self._feed_body()
        return fut

    def _feed_body(self) -> None:
        assert self._body is not None
        n, fut = self._body
        if len(self._buf) < n:
            self._resume()
            return
        body = bytes(self._buf[:n])
        del self._buf[:n]
        self._body = None
        if not fut.done():
            fut.set_result(body)

    def _skip(self, n: int) -> None:
        """Drop the body of a refused frame (whatever of it has arrived and will arrive)."""
        k = min(n, len(self._buf))
        del self._buf[:k]
        self._discard = n - k
        self._resume()

    def _respond(self, reply: Reply, keep_alive: bool) -> None:
        t = self.transport
        if t is None or t.is_closing():
            return
        t.write(render(reply, keep_alive=keep_alive))
        if not keep_alive:
            t.close()

    def _served(self, task: asyncio.Task[None]) -> None:
        self._task = None
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("frame request failed", exc_info=exc)
            self._fail(500, f"internal error: {type(exc).__name__}")
            return
        self._after_answer()  # a Step Stream it opened goes on without the task

    def _fail(self, status: int, message: str) -> None:
        self._respond(http_error(status, message), keep_alive=False)

    def _resume(self) -> None:
        if self._paused and self.transport is not None and len(self._buf) <= MAX_BUFFER:
            self._paused = False
            self.transport.resume_reading()

    def _hand_over(self) -> None:
        """Give this connection, and the bytes read so far, to the aiohttp app."""
        t = self.transport
        assert t is not None
        self.server.connections.discard(self)
        self.transport = None
        proto = self.server.fallback()
        t.set_protocol(proto)
        proto.connection_made(t)
        data, self._buf = bytes(self._buf), bytearray()
        self._resume_for(t)
        if data:
            proto.data_received(data)

    def _resume_for(self, t: asyncio.Transport) -> None:
        if self._paused:
            self._paused = False
            t.resume_reading()

    @property
    def task(self) -> asyncio.Task[None] | None:
        """The request in progress, if any."""
        return self._task

    def abort(self) -> None:
        """Close the connection now and stop its request (node shutdown)."""
        if self._task is not None:
            self._task.cancel()
        if self.transport is not None:
            self.transport.close()


class FrameServer:
    """The node's listener: the frame plane here, everything else through `fallback`."""

    def __init__(self, runtime: NodeRuntime, fallback: Callable[[], asyncio.Protocol],
                 bounds: ConnectionBounds | None = None) -> None:
        self.runtime = runtime
        self.fallback = fallback  # a protocol factory, e.g. aiohttp's web.Server
        self.bounds = bounds or ConnectionBounds()
        self.connections: set[FrameConnection] = set()
        self._server: asyncio.Server | None = None
        self._sweeper: asyncio.Task[None] | None = None

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
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
