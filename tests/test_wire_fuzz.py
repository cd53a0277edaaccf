"""Property and fuzz tests (hypothesis) of both sides of the activation transport's HTTP
parsing, on the real wire.server.FrameConnection and wire.client reader with in-memory
transports: whatever bytes arrive, in whatever pieces, a connection answers or waits; it
never raises, never runs a frame it did not parse whole, and never executes what follows
bytes it refused (request smuggling)."""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field

import numpy as np
import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas.frames import FrameError, FrameFormatError, FrameHeader, encode_rows
from wire.client import ChunkStream, _ResponseReader
from wire.server import ConnectionBounds, FrameConnection, FrameServer, Reply

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class MemoryTransport(asyncio.Transport):
    """Collects what a protocol writes."""

    def __init__(self) -> None:
        super().__init__()
        self.out = bytearray()
        self.closing = False
        self.paused = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        assert not self.closing, "wrote after closing"
        self.out += data

    def writelines(self, lines) -> None:  # type: ignore[no-untyped-def, override]
        for line in lines:
            self.write(line)

    def close(self) -> None:
        self.closing = True

    def is_closing(self) -> bool:
        return self.closing

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self.protocol = protocol


@dataclass
class Admitted:
    header: FrameHeader
    length: int


@dataclass
class Sink:
    max_chunk: int
    steps: list[bytes] = field(default_factory=list)
    over: bool = False
    ended: bool = False
    proven: bool = False

    def message(self, payload: bytes, wire_bytes: int) -> None:
        self.steps.append(payload)

    def end(self) -> None:
        self.ended = True

    def refuse(self, message: str) -> None:
        self.over = True

    def lost(self) -> None:
        self.over = True


class Handlers:
    """Admits any well-formed FrameHeader; records what runs."""

    def __init__(self) -> None:
        self.runs: list[tuple[FrameHeader, bytes]] = []
        self.sinks: list[Sink] = []

    def admit_now(self, header: str | None, length: int | None, *,  # type: ignore[no-untyped-def]
                  credential: str | None = None):
        if header is None:
            return FrameError(code="bad_frame", message="no header")
        try:
            h = FrameHeader.from_header(header)
        except FrameFormatError as exc:
            return FrameError(code="bad_frame", message=str(exc))
        return Admitted(h, length or 0)

    async def admit(self, header, length, *, credential=None):  # type: ignore[no-untyped-def]
        return self.admit_now(header, length, credential=credential)

    def run(self, admitted, body, wire_bytes, respond, stream, *, same_turn):  # type: ignore[no-untyped-def]
        self.runs.append((admitted.header, body))
        respond(Reply(202, b'{"seq":%d}' % admitted.header.seq))

    async def credit(self, session_id, query, credential):  # type: ignore[no-untyped-def]
        return Reply(200, b'{"credit":1,"done":0}')

    def open_link(self, answer, close):  # type: ignore[no-untyped-def]
        sink = Sink(4096)
        self.sinks.append(sink)
        return sink


class Server(FrameServer):
    """The real frame server's bookkeeping, with scripted handlers and an app that records."""

    def __init__(self) -> None:
        self.handed_over: list[bytes] = []
        super().__init__(Handlers(), self.app)  # type: ignore[arg-type]

    def app(self) -> asyncio.Protocol:
        server = self

        class App(asyncio.Protocol):
            def data_received(self, data: bytes) -> None:
                server.handed_over.append(data)

        return App()


def drive(pieces: list[bytes]) -> tuple[Server, MemoryTransport]:
    """Feed `pieces` to one FrameConnection, letting the loop run between them."""

    async def go() -> tuple[Server, MemoryTransport]:
        server = Server()
        conn = FrameConnection(server)  # type: ignore[arg-type]
        t = MemoryTransport()
        conn.connection_made(t)
        for p in pieces:
            if t.closing:
                break
            conn.data_received(p)
            for _ in range(3):
                await asyncio.sleep(0)
        for _ in range(5):
            await asyncio.sleep(0)
        return server, t

    return asyncio.run(go())


def frame(seq: int = 0, n: int = 1) -> bytes:
    h = FrameHeader(session_id="s", route_id="r", epoch=1, hop=1, seq=seq, phase="decode", position=seq,
                    n_rows=n, dtype="f32", width=4, final=True)
    body = encode_rows(np.full((n, 4), seq, np.float32), "f32")
    return (b"POST /v1/frames HTTP/1.1\r\nHost: x\r\nx-meshnet-frame: " + h.to_header().encode()
            + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)


def link_head() -> bytes:
    return b"POST /v1/links HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    out, last = [], 0
    for p in [*points, len(data)]:
        if p > last:
            out.append(data[last:p])
            last = p
    return out


def statuses(out: bytes) -> list[int]:
    return [int(m) for m in re.findall(rb"HTTP/1\.1 (\d{3}) ", out)]


@FUZZ
@given(st.lists(st.integers(0, 10_000), max_size=8), st.integers(1, 4))
def test_requests_split_anywhere_run_the_same_frames_in_order(cuts: list[int], n: int) -> None:
    data = b"".join(frame(seq) for seq in range(n))
    server, t = drive(split(data, cuts))
    assert [(h.seq, len(b)) for h, b in server.handlers.runs] == [(s, 16) for s in range(n)]
    assert statuses(bytes(t.out)) == [202] * n and not t.closing


@FUZZ
@given(st.binary(max_size=300), st.lists(st.integers(0, 400), max_size=4))
def test_arbitrary_bytes_never_raise_and_never_run_a_frame(junk: bytes, cuts: list[int]) -> None:
    server, t = drive(split(junk, cuts))
    assert server.handlers.runs == []  # no well-formed frame header in random bytes
    for status in statuses(bytes(t.out)):
        assert 400 <= status < 600


BAD_SIZES = st.one_of(
    st.sampled_from([b"-2", b"+3", b"0x3", b" 3", b"3 ", b"1_0", b"", b"g", b"1" * 17, b"-0"]),
    st.binary(min_size=1, max_size=6).filter(
        lambda s: not all(c in b"0123456789abcdefABCDEF" for c in s) and b"\r" not in s and b"\n" not in s
        and b";" not in s),
)


@FUZZ
@given(BAD_SIZES, st.lists(st.integers(0, 2000), max_size=5))
def test_a_request_smuggled_after_a_malformed_chunk_never_runs(size: bytes, cuts: list[int]) -> None:
    smuggled = frame(seq=7)
    data = link_head() + size + b"\r\nabc\r\n" + smuggled
    server, t = drive(split(data, cuts))
    assert all(h.seq != 7 for h, _ in server.handlers.runs)
    assert all(b"abc" not in s for sink in server.handlers.sinks for s in sink.steps)
    assert t.closing  # refused: the connection is closed


@FUZZ
@given(st.integers(0, 99), st.integers(0, 99), st.lists(st.integers(0, 500), max_size=3))
def test_two_content_lengths_are_refused_and_nothing_runs(a: int, b: int, cuts: list[int]) -> None:
    body = b"x" * max(a, b)
    data = (b"POST /v1/frames HTTP/1.1\r\nContent-Length: %d\r\nContent-Length: %d\r\n\r\n" % (a, b)
            + body + frame(seq=3))
    server, t = drive(split(data, cuts))
    assert server.handlers.runs == [] and statuses(bytes(t.out)) == [400] and t.closing


@FUZZ
@given(st.lists(st.binary(min_size=1, max_size=40), min_size=1, max_size=5),
       st.lists(st.integers(0, 400), max_size=5))
def test_seam_link_messages_arrive_whole_wherever_the_bytes_split(chunks: list[bytes], cuts: list[int]) -> None:
    body = b"".join(b"%x\r\n%b\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"
    server, _ = drive(split(link_head() + body, cuts))
    [sink] = server.handlers.sinks
    assert sink.steps == chunks and sink.ended


def test_a_seam_link_that_admits_no_lane_is_closed_like_a_silent_socket() -> None:
    """POST /v1/links needs no credential until a lane opens, and a link's body has no
    deadline: 260 such links holding only their head took every connection slot of a head node
    from 127.0.0.1 for good, and every new chat failed. A link that has admitted no lane within
    --first-request-timeout is now closed; one that has (a credential holder's) runs on."""

    async def go() -> list[bool]:
        closed = []
        for proven in (False, True):
            server = Server()
            conn = FrameConnection(server)  # type: ignore[arg-type]
            t = MemoryTransport()
            conn.connection_made(t)
            conn.data_received(link_head() + b"5\r\nhello\r\n")
            await asyncio.sleep(0)
            server.handlers.sinks[0].proven = proven  # type: ignore[attr-defined]
            now = asyncio.get_running_loop().time()
            conn.check_deadline(now, ConnectionBounds())
            conn.check_deadline(now + 2.5, ConnectionBounds())
            closed.append(t.closing)
        return closed

    assert asyncio.run(go()) == [True, False]


@FUZZ
@given(st.lists(st.integers(0, 300), max_size=4))
def test_an_app_request_after_frames_is_handed_over_with_its_bytes(cuts: list[int]) -> None:
    app = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    first = frame(seq=0)
    server, _ = drive([*split(first, cuts), app])  # its own packet: where it begins is known
    assert [h.seq for h, _ in server.handlers.runs] == [0]
    assert b"".join(server.handed_over) == app


# --- the client side ------------------------------------------------------------------------


def read_response(pieces: list[bytes]) -> tuple[str, object]:
    """Feed `pieces` to a reader awaiting one answer: ("ok", (status, body or chunks)),
    ("error", message) or ("waiting", None)."""

    async def go() -> tuple[str, object]:
        reader = _ResponseReader()
        t = MemoryTransport()
        reader.connection_made(t)
        fut = reader.exchange(b"GET / HTTP/1.1\r\n\r\n", b"")
        for p in pieces:
            if t.closing:
                break
            reader.data_received(p)
        await asyncio.sleep(0)
        if not fut.done():
            reader.connection_lost(None)
        try:
            status, answer = await fut
        except (ValueError, ConnectionResetError) as exc:
            return "error", str(exc)
        except Exception as exc:  # _StaleConnection: nothing arrived
            return "stale", type(exc).__name__
        if isinstance(answer, ChunkStream):
            chunks = []
            try:
                async for c in answer:
                    chunks.append(c)
            except Exception as exc:
                return "error", str(exc)
            return "ok", (status, chunks)
        return "ok", (status, answer)

    return asyncio.run(go())


@FUZZ
@given(st.binary(max_size=300), st.lists(st.integers(0, 400), max_size=4))
def test_the_client_takes_any_bytes_as_an_answer_or_a_typed_error(junk: bytes, cuts: list[int]) -> None:
    kind, _ = read_response(split(junk, cuts))
    assert kind in ("ok", "error", "stale")


@FUZZ
@given(st.lists(st.binary(min_size=1, max_size=30), max_size=5), st.lists(st.integers(0, 300), max_size=6),
       st.booleans())
def test_the_client_reads_an_answer_split_anywhere(chunks: list[bytes], cuts: list[int], interim: bool) -> None:
    pre = b"HTTP/1.1 100 Continue\r\n\r\n" if interim else b""
    body = orjson.dumps([c.hex() for c in chunks])
    plain = pre + b"HTTP/1.1 202 Accepted\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body)
    assert read_response(split(plain, cuts)) == ("ok", (202, body))
    streamed = (pre + b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                + b"".join(b"%x\r\n%b\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n")
    assert read_response(split(streamed, cuts)) == ("ok", (200, chunks))


@FUZZ
@given(BAD_SIZES)
def test_the_client_refuses_a_malformed_chunk_size(size: bytes) -> None:
    raw = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + size + b"\r\nabc\r\n0\r\n\r\n"
    kind, _ = read_response([raw])
    assert kind == "error"
