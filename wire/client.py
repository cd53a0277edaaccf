"""The client side of the activation transport: one keep-alive HTTP/1.1 connection to a hop.

A seam needs one connection and requests in order, so a small asyncio Protocol replaces a
general client: a request goes out in one write (behind others still unanswered, for a prompt's
chunks: `submit`), and its response is parsed by llhttp (httptools) where its bytes arrive,
waking the caller once (measured: about 250 µs less per frame than an
aiohttp ClientSession request, and less again than asyncio streams, on the 2-core reference
VM). A chunked answer (a Decode Run's tokens, a Seam Link's answers) is read chunk by chunk
as a ChunkStream.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from urllib.parse import urlsplit

import httptools

from wire.chunks import LAST_CHUNK, encode_chunks

MAX_RESPONSE_HEAD = 16 * 1024  # bytes of header names and values one response may carry
MAX_RESPONSE_BODY = 16 * 1024 * 1024  # a frame-plane answer (or one chunk of it) is small JSON


class FrameTransportError(Exception):
    """The connection to a hop failed before a complete response arrived."""


class _StaleConnection(Exception):
    """The peer closed the connection before answering (a stale keep-alive, or a dead hop)."""


def wire_request_bytes(method: str, path_qs: str, raw_headers: list[tuple[bytes, bytes]], body: int) -> int:
    """Bytes of an HTTP/1.1 request as sent: request line, header lines, blank line, body."""
    line = len(method) + 1 + len(path_qs) + len(" HTTP/1.1\r\n")
    return line + sum(len(k) + len(v) + 4 for k, v in raw_headers) + 2 + body


def activation_address(base_url: str) -> tuple[str, int]:
    """(host, port) of a hop's activation URL, http://host[:port] with nothing after it but a
    slash; ValueError naming the URL otherwise (pure)."""
    url = urlsplit(base_url)
    try:
        port = 80 if url.port is None else url.port
    except ValueError:
        port = 0
    if url.scheme != "http" or not url.hostname or not 0 < port < 65536 or url.path.strip("/") or url.query:
        raise ValueError(f"activation URL must be http://host:port, got {base_url!r}")
    return url.hostname, port


def authority(host: str, port: int) -> str:
    """host:port as a URL or a Host header writes it: an IPv6 address in brackets (pure)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class H1Connection:
    """One keep-alive HTTP/1.1 connection to a hop: the frame plane's only transport."""

    def __init__(self, base_url: str, *, connect_timeout: float = 2.0) -> None:
        self.host, self.port = activation_address(base_url)
        self.connect_timeout = connect_timeout
        self._prefix = f"Host: {authority(self.host, self.port)}\r\n"
        self._proto: _ResponseReader | None = None
        self.connects = 0

    async def _connect(self) -> _ResponseReader:
        """A new connection (FrameTransportError if it cannot be made)."""
        self.connects += 1
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, proto = await loop.create_connection(_ResponseReader, self.host, self.port)
        except TimeoutError as exc:  # first: an OSError too, whose message is empty ("TimeoutError: ")
            self.close()
            raise FrameTransportError(f"connect timed out after {self.connect_timeout}s") from exc
        except (OSError, ValueError) as exc:
            self.close()
            raise FrameTransportError(f"{type(exc).__name__}: {exc}") from exc
        self._proto = proto
        return proto

    async def request(self, method: str, path_qs: str, headers: dict[str, str], body: bytes = b"") -> tuple[int, bytes]:
        """Send one request, return (status, body). Retries once if a reused connection was stale."""
        status, answer = await self.stream(method, path_qs, headers, body)
        if isinstance(answer, ChunkStream):  # a streamed answer nobody asked for: collect it
            return status, b"".join([c async for c in answer])
        return status, answer

    def _head(self, method: str, path_qs: str, headers: dict[str, str], length: str) -> bytes:
        lines = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        return f"{method} {path_qs} HTTP/1.1\r\n{self._prefix}{lines}{length}\r\n\r\n".encode()

    async def open_stream(self, path_qs: str, headers: dict[str, str], first_chunk: bytes,
                          deliver: Callable[[bytes | BaseException | None], None],
                          ) -> asyncio.Future[tuple[int, bytes | ChunkStream]]:
        """POST a request whose chunked body stays open, on a new connection: `first_chunk` is
        written with the head, send_chunk may add more at once and end_body ends it (a Seam
        Link). The future resolves with (status, answer) when the answer's head arrives; a
        chunked answer's chunks then go straight to `deliver` (then None at its end, or the error)."""
        self.close()
        proto = await self._connect()
        head = self._head("POST", path_qs, headers, "Transfer-Encoding: chunked")
        return proto.exchange(head, encode_chunks([first_chunk]), deliver)

    async def stream(self, method: str, path_qs: str, headers: dict[str, str],
                     body: bytes = b"") -> tuple[int, bytes | ChunkStream]:
        """Send one request; a chunked answer comes back as a ChunkStream to iterate, any other
        as its whole body. Leaving the stream before its end closes the connection."""
        head = self._head(method, path_qs, headers, f"Content-Length: {len(body)}")
        for attempt in (0, 1):
            proto = self._proto
            reused = proto is not None and proto.open
            try:
                if not reused:
                    self.close()
                    proto = await self._connect()
                assert proto is not None
                return await proto.exchange(head, body)
            except _StaleConnection:
                self.close()
                if attempt or not reused:
                    raise FrameTransportError("connection closed before any response") from None
            except (OSError, ValueError) as exc:
                self.close()
                raise FrameTransportError(f"{type(exc).__name__}: {exc}") from exc
            except asyncio.CancelledError:
                self.close()  # a response may still arrive for this request: never reuse the connection
                raise
        raise FrameTransportError("unreachable")  # pragma: no cover

    async def submit(self, method: str, path_qs: str, headers: dict[str, str],
                     body: bytes = b"") -> asyncio.Future[tuple[int, bytes | ChunkStream]]:
        """Write one request behind those whose answers are still to come (HTTP/1.1 pipelining)
        and return its answer's future without waiting for it: a seam far away then carries
        several frames per round trip instead of one. Read the future with `answer_of`. A
        pipelined request is not retried on a stale connection (its answer fails instead)."""
        head = self._head(method, path_qs, headers, f"Content-Length: {len(body)}")
        proto = self._proto
        if proto is None or not proto.open:
            self.close()
            proto = await self._connect()
        try:
            return proto.exchange(head, body)
        except (OSError, ValueError) as exc:
            self.close()
            raise FrameTransportError(f"{type(exc).__name__}: {exc}") from exc

    def send_chunk(self, payload: bytes) -> bool:
        """One more chunk of the open chunked request body; False if the connection is gone."""
        proto = self._proto
        if proto is None or not proto.open or proto.transport is None:
            return False
        proto.transport.write(encode_chunks((payload,)))
        return True

    def end_body(self) -> bool:
        """End the open chunked request body; False if the connection is gone."""
        proto = self._proto
        if proto is None or not proto.open or proto.transport is None:
            return False
        proto.transport.write(LAST_CHUNK)
        return True

    def close(self) -> None:
        """Drop the connection (the next request opens a new one)."""
        if self._proto is not None:
            self._proto.close()
        self._proto = None


async def answer_of(fut: asyncio.Future[tuple[int, bytes | ChunkStream]]) -> tuple[int, bytes]:
    """The (status, body) of a request `H1Connection.submit` wrote; FrameTransportError if its
    connection failed before the whole answer came."""
    try:
        status, answer = await fut
    except (_StaleConnection, OSError, ValueError) as exc:
        raise _transport_error(exc) from exc
    if isinstance(answer, ChunkStream):  # a streamed answer nobody asked for: collect it
        return status, b"".join([c async for c in answer])
    return status, answer


def failed_answer(fut: asyncio.Future[tuple[int, bytes | ChunkStream]]) -> FrameTransportError | None:
    """The transport error a finished submitted request failed with, None if it was answered."""
    if fut.cancelled():
        return FrameTransportError("the request was cancelled")
    exc = fut.exception()
    return None if exc is None else _transport_error(exc)


def _transport_error(exc: BaseException) -> FrameTransportError:
    if isinstance(exc, _StaleConnection):
        return FrameTransportError("connection closed before any response")
    return FrameTransportError(f"{type(exc).__name__}: {exc}")


def forget_answer(fut: asyncio.Future[tuple[int, bytes | ChunkStream]]) -> None:
    """Let go of a submitted request's answer: its error, if it fails, is not logged as never
    retrieved. (It is not cancelled: a caller may still be awaiting it, and must see the
    connection's error, not a cancellation of its own task.)"""
    fut.add_done_callback(_retrieve)


def _retrieve(fut: asyncio.Future[tuple[int, bytes | ChunkStream]]) -> None:
    if not fut.cancelled():
        fut.exception()


class ChunkStream:
    """The body of one chunked HTTP response, chunk by chunk, as it arrives.

    Iterate it to the end; stopping early (break, cancel, error) closes the connection, since
    the rest of the answer would otherwise be read as the next request's. A chunk that comes
    while the reader waits resolves its waiter directly (no queue: the per-token path runs
    right after a model call, on cold caches, where every Python call counts)."""

    def __init__(self, on_abandon: Callable[[], None],
                 deliver: Callable[[bytes | BaseException | None], None] | None = None) -> None:
        self._on_abandon = on_abandon  # the reader's close: the connection goes (a lane's: the lane goes)
        self._deliver = deliver  # each chunk, the end or an error straight to it, never queued (a Seam Link's answer)
        self._items: deque[bytes | BaseException | None] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self.ended = False

    def _put(self, item: bytes | BaseException | None) -> None:
        if self._deliver is not None:
            self._deliver(item)
            return
        self._items.append(item)
        w = self._waiter
        if w is not None:
            self._waiter = None
            if not w.done():
                w.set_result(None)

    @property
    def ready(self) -> bool:
        """Whether the next read returns at once (a chunk, the end or an error has arrived)."""
        return bool(self._items) or self.ended

    @property
    def buffered(self) -> int:
        """Chunks already received and not yet read (the end counts as one)."""
        return len(self._items)

    def __aiter__(self) -> ChunkStream:
        return self

    async def __anext__(self) -> bytes:
        if self.ended:
            raise StopAsyncIteration
        if not self._items:
            self._waiter = w = asyncio.get_running_loop().create_future()
            try:
                await w
            except BaseException:
                self._waiter = None
                self.abandon()
                raise
        item = self._items.popleft()
        if item is None:
            self.ended = True
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self.ended = True
            raise FrameTransportError(f"{type(item).__name__}: {item}") from item
        return item

    def abandon(self) -> None:
        """Stop reading before the end: the connection is closed (the sender sees it go)."""
        if not self.ended:
            self.ended = True
            self._on_abandon()


async def first_ready(a: ChunkStream, b: ChunkStream) -> ChunkStream:
    """Whichever of two streams has something to read first (`a` when both do): one future
    shared as both streams' waiter, no task per wait (the per-token path of direct return)."""
    while not (a.ready or b.ready):
        w = asyncio.get_running_loop().create_future()
        a._waiter = b._waiter = w
        try:
            await w
        finally:
            a._waiter = b._waiter = None
    return a if a.ready else b


class _ResponseReader(asyncio.Protocol):
    """The client side of one connection: writes requests; llhttp parses their responses as they
    arrive (the callbacks below), in order, skipping interim (1xx) answers. Requests with a
    whole-body answer may be pipelined (each waits for its answer in `_waiters`, oldest first);
    a chunked answer is read alone."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._waiters: deque[asyncio.Future[tuple[int, bytes | ChunkStream]]] = deque()  # oldest first
        self._stream: ChunkStream | None = None  # the chunked answer being read
        self._body = bytearray()  # the whole body being read, or the current chunk of a stream
        self._status = 0
        self._chunked = False
        self._head_bytes = 0
        self._reading = False  # bytes of a response have arrived
        self._deliver: Callable[[bytes | BaseException | None], None] | None = None
        self.open = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.open = True

    def connection_lost(self, exc: Exception | None) -> None:
        self.open = False
        stream, self._stream = self._stream, None
        if stream is not None:
            stream._put(ConnectionResetError(f"connection closed mid-stream: {exc or 'EOF'}"))
        waiters, self._waiters = self._waiters, deque()
        for i, w in enumerate(waiters):
            if w.done():
                continue
            if self._reading or i:  # (a pipelined request behind the first is never retried)
                w.set_exception(ConnectionResetError(f"connection closed mid-response: {exc or 'EOF'}"))
            else:
                w.set_exception(_StaleConnection())

    def exchange(self, head: bytes, body: bytes,
                 deliver: Callable[[bytes | BaseException | None], None] | None = None,
                 ) -> asyncio.Future[tuple[int, bytes | ChunkStream]]:
        """Write one request; the future resolves with its (status, body or ChunkStream). Requests
        before it whose answers are still to come are answered first (pipelining)."""
        assert self.transport is not None and self._stream is None
        assert deliver is None or not self._waiters, "a Seam Link's request is never pipelined"
        self._deliver = deliver
        fut: asyncio.Future[tuple[int, bytes | ChunkStream]] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        if len(body) < 65536:
            self.transport.write(head + body)
        else:
            self.transport.writelines((head, body))
        return fut

    def data_received(self, data: bytes) -> None:
        if not self._waiters and self._stream is None and not self._reading:
            self._fail(ValueError("bytes arrived that answer no request"))
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            cause = exc.__context__ if isinstance(exc, httptools.HttpParserCallbackError) else None
            self._fail(ValueError(f"malformed response: {cause or exc}"))

    # --- llhttp callbacks --------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._reading = True
        self._body.clear()
        self._chunked = False
        self._head_bytes = 0

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_bytes += len(name) + len(value)
        if self._head_bytes > MAX_RESPONSE_HEAD:
            raise ValueError("response head too large")
        if name.lower() == b"transfer-encoding":
            self._chunked = value.rstrip().lower().endswith(b"chunked")  # llhttp's rule: chunked comes last

    def on_headers_complete(self) -> None:
        self._status = status = self._parser.get_status_code()
        if status < 200 or not self._chunked:
            return  # an interim answer (100 Continue: the real one follows), or a whole body to read
        w = self._waiters.popleft() if self._waiters else None
        self._stream = stream = ChunkStream(self.close, self._deliver)
        if w is not None and not w.done():
            w.set_result((status, stream))

    def on_body(self, body: bytes) -> None:
        self._body += body
        if len(self._body) > MAX_RESPONSE_BODY:
            raise ValueError(f"an answer (or chunk) over {MAX_RESPONSE_BODY} bytes")

    def on_chunk_complete(self) -> None:
        stream = self._stream
        if self._body and stream is not None:
            stream._put(bytes(self._body))
        self._body.clear()

    def on_message_complete(self) -> None:
        self._reading = False
        if self._status < 200:
            return
        stream, self._stream = self._stream, None
        if stream is not None:  # the last chunk: the connection is free for the next request
            stream._put(None)
            return
        w = self._waiters.popleft() if self._waiters else None
        body = bytes(self._body)
        self._body.clear()
        if w is not None and not w.done():
            w.set_result((self._status, body))

    def _fail(self, exc: Exception) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            stream._put(exc)
        waiters, self._waiters = self._waiters, deque()
        for w in waiters:
            if not w.done():
                w.set_exception(exc)
        self.close()

    def close(self) -> None:
        self.open = False
        if self.transport is not None:
            self.transport.close()
