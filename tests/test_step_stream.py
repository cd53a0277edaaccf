"""Step Streams: a Decode Run's steps across one seam as one HTTP request with a chunked body.

Link level against a scripted server (the sender's side: one connection, the stream's end read
before the next request, refusals and failures typed). Node level with raw sockets against a
real tail process (the receiver's side: one answer chunk per step, the session held while the
stream is open, a bad chunk refused, a lost stream letting go of the session). Exactness of
tokens decoded through Step Streams is in test_decode_run.py and test_route_exact.py, which run
Decode Runs over 2 and 3 real hops."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import numpy as np
import orjson
import pytest

from gateway.route_client import RouteClient
from schemas.credentials import CREDENTIAL_HEADER
from schemas.frames import (
    FRAME_HEADER,
    FrameError,
    FrameHeader,
    FrameRejectedError,
    FrameResult,
    HopUnreachableError,
    RunEvent,
    encode_rows,
)
from schemas.route import RouteFailure
from tests.fixtures.chunks import take_chunk
from tests.fixtures.mesh import Mesh, NodeProc
from wire.link import FrameLink

HIDDEN = 576


def token_event(token_id: int, position: int) -> bytes:
    return RunEvent(result=FrameResult(token_id=token_id, position=position)).model_dump_json().encode()


class StepServer:
    """A raw loopback hop: answers each step chunk with the next scripted event; a Content-Length
    request with a plain 202; counts connections and what it read."""

    def __init__(self, events: list[bytes]) -> None:
        self.events = events
        self.connections = 0
        self.steps: list[bytes] = []
        self.ended = 0
        self.plain = 0

    async def __aenter__(self) -> str:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            buf = bytearray()
            try:
                while True:
                    head = (await reader.readuntil(b"\r\n\r\n")).decode().lower()
                    if "transfer-encoding: chunked" not in head:
                        length = int(head.split("content-length:")[1].split("\r\n")[0])
                        await reader.readexactly(length)
                        self.plain += 1
                        body = b'{"seq":0,"credit":9,"done":3}'
                        writer.write(b"HTTP/1.1 202 Accepted\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body))
                        continue
                    writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
                    while True:
                        chunk = take_chunk(buf)
                        if chunk is None:
                            data = await reader.read(65536)
                            if not data:
                                raise ConnectionResetError("the sender went away")
                            buf += data
                            continue
                        if not chunk:
                            self.ended += 1
                            end = RunEvent(end=True, credit=12, done=8).model_dump_json().encode()
                            writer.write(b"%x\r\n%b\r\n0\r\n\r\n" % (len(end), end))
                            break
                        self.steps.append(chunk)
                        event = self.events.pop(0)
                        writer.write(b"%x\r\n%b\r\n" % (len(event), event))
                        if b'"result"' not in event:
                            writer.write(b"0\r\n\r\n")
                            writer.close()
                            return
            except (asyncio.IncompleteReadError, ConnectionError):
                writer.close()

        self.server = await asyncio.start_server(handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()


def link(url: str) -> FrameLink:
    return FrameLink(url, hop_index=1, node_id="tail", session_id="s", route_id="r", epoch=1)


def first_header(seq: int) -> str:
    return FrameHeader(session_id="s", route_id="r", epoch=1, hop=1, seq=seq, phase="decode", position=20 + seq,
                       n_rows=1, dtype="f32", width=4, final=True, stream=True).to_header()


ROW = encode_rows(np.ones((1, 4), np.float32), "f32")


async def test_a_step_stream_is_one_request_whose_end_is_read_before_the_next() -> None:
    srv = StepServer([token_event(7, 21), token_event(8, 22), token_event(9, 23)])
    async with srv as url:
        lk = link(url)
        opened: list[int] = []

        def header_for(seq: int):
            def render() -> str:
                opened.append(seq)
                return first_header(seq)
            return render

        got = [await lk.stream_step(seq, header_for(seq), ROW) for seq in (0, 1, 2)]
        assert [r["token_id"] for r in got] == [7, 8, 9] and opened == [0]  # one header, for the first step
        lk.end_stream()
        await lk.send_rendered(3, first_header(3).replace('"stream":true,', ""), ROW)  # reads the end first
        assert lk.credit == 12 and lk.conn.connects == 1
        assert (srv.steps, srv.ended, srv.plain) == ([ROW] * 3, 1, 1)
        lk.close()


async def test_refusals_and_failures_in_a_step_stream_are_typed_and_end_it() -> None:
    failure = RouteFailure(session_id="s", route_id="r", phase="decode", hop_index=2, node_id="n2",
                           reason="hop unreachable: gone", code="hop_lost")
    events = [token_event(7, 21), RunEvent(error=FrameError(code="bad_frame", message="bad chunk")).model_dump_json().encode(),
              RunEvent(failure=failure).model_dump_json().encode()]
    async with StepServer(events) as url:
        lk = link(url)
        assert (await lk.stream_step(0, lambda: first_header(0), ROW))["token_id"] == 7
        with pytest.raises(FrameRejectedError) as info:
            await lk.stream_step(1, lambda: first_header(1), ROW)
        assert info.value.status == 400 and info.value.error.code == "bad_frame"
        # the refused stream is gone: the step again opens a new one, on a new connection
        with pytest.raises(FrameRejectedError) as info:
            await lk.stream_step(1, lambda: first_header(1), ROW)
        assert info.value.error.failure == failure  # the hop's own failure, passed on
        assert lk.conn.connects == 2
        lk.close()


async def test_a_refused_step_stream_drops_its_connection() -> None:
    refusal = FrameError(code="session_busy", message="busy").model_dump_json().encode()
    ack = b'{"seq":0,"credit":9,"done":3}'

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:  # keeps the connection open after the refusal: the sender must not reuse it
                head = (await reader.readuntil(b"\r\n\r\n")).lower()
                if b"chunked" in head:
                    writer.write(b"HTTP/1.1 409 Conflict\r\nContent-Length: %d\r\n\r\n%b" % (len(refusal), refusal))
                    continue
                await reader.readexactly(int(head.split(b"content-length:")[1].split(b"\r\n")[0]))
                writer.write(b"HTTP/1.1 202 Accepted\r\nContent-Length: %d\r\n\r\n%b" % (len(ack), ack))
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    lk = link(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
    with pytest.raises(FrameRejectedError) as info:
        await lk.stream_step(0, lambda: first_header(0), ROW)
    assert info.value.status == 409 and info.value.error.code == "session_busy"
    ack_got = await lk.send_rendered(0, first_header(0).replace('"stream":true,', ""), ROW)
    assert ack_got.credit == 9 and lk.conn.connects == 2  # a fresh connection, not the half-sent one
    lk.close()
    server.close()


async def test_a_step_stream_cut_short_is_unreachable() -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        writer.close()  # the hop dies before answering the step

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    lk = link(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
    with pytest.raises(HopUnreachableError):
        await lk.stream_step(0, lambda: first_header(0), ROW)
    lk.close()
    server.close()


# --- the receiving side: a real tail -------------------------------------------------------


class Raw:
    """One raw HTTP/1.1 connection to a node."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.buf = bytearray()

    @classmethod
    async def open(cls, url: str) -> Raw:
        host, port = url.removeprefix("http://").rstrip("/").split(":")
        return cls(*await asyncio.open_connection(host, int(port)))

    async def head(self) -> tuple[int, dict[str, str]]:
        raw = bytes(self.buf)
        while b"\r\n\r\n" not in raw:
            self.buf += await asyncio.wait_for(self.reader.read(65536), 10)
            raw = bytes(self.buf)
        end = raw.index(b"\r\n\r\n")
        status_line, *lines = raw[:end].decode().split("\r\n")
        del self.buf[:end + 4]
        return int(status_line.split()[1]), {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in lines)}

    async def chunk(self) -> bytes:
        while (c := take_chunk(self.buf)) is None:
            data = await asyncio.wait_for(self.reader.read(65536), 10)
            if not data:
                raise ConnectionResetError("closed")
            self.buf += data
        return c

    async def body(self, headers: dict[str, str]) -> bytes:
        n = int(headers["content-length"])
        while len(self.buf) < n:
            self.buf += await asyncio.wait_for(self.reader.read(65536), 10)
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    async def closed(self) -> bool:
        return not self.buf and await asyncio.wait_for(self.reader.read(1), 5) == b""

    def close(self) -> None:
        self.writer.close()


def stream_request(h: FrameHeader, first: bytes, cred: str) -> bytes:
    return (f"POST /v1/frames HTTP/1.1\r\nHost: x\r\n{FRAME_HEADER}: {h.to_header()}\r\n{CREDENTIAL_HEADER}: {cred}\r\n"
            f"Transfer-Encoding: chunked\r\n\r\n").encode() + b"%x\r\n%b\r\n" % (len(first), first)


def plain_request(h: FrameHeader, body: bytes, cred: str) -> bytes:
    return (f"POST /v1/frames HTTP/1.1\r\nHost: x\r\n{FRAME_HEADER}: {h.to_header()}\r\n{CREDENTIAL_HEADER}: {cred}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


@asynccontextmanager
async def prefilled(mesh: Mesh) -> AsyncIterator[tuple[NodeProc, NodeProc, FrameHeader, list[str]]]:
    """A 2-hop session after a 10-token prefill: (head, tail, the tail's next decode frame,
    the hops' credentials)."""
    head, tail = await mesh.spawn((0, 15)), await mesh.spawn((15, 30))
    session = await mesh.route([head, tail])
    async with RouteClient(session, mesh.http, chunk_size=8, bus=mesh.bus) as rc:
        await rc.prefill(list(range(300, 310)))
        yield head, tail, FrameHeader(
            session_id=session.session_id, route_id=session.route_id, epoch=session.epoch, hop=1, seq=rc.seq,
            phase="decode", position=rc.position, n_rows=1, dtype="f32", width=HIDDEN, final=True), session.credentials


async def test_a_tail_answers_each_step_holds_the_session_and_ends_cleanly(mesh: Mesh) -> None:
    async with prefilled(mesh) as (_head, tail, step, creds):
        seq, pos, session_id = step.seq, step.position, step.session_id
        row = encode_rows(np.ones((1, HIDDEN), np.float32), "f32")
        conn, other = await Raw.open(tail.url), await Raw.open(tail.url)
        try:
            conn.writer.write(stream_request(step.model_copy(update={"stream": True}), row, creds[1]))
            status, headers = await conn.head()
            assert status == 200 and headers["transfer-encoding"] == "chunked"
            first = orjson.loads(await conn.chunk())
            assert first["result"]["position"] == pos + 1 and [t["node_id"] for t in first["result"]["timings"]] == [tail.node_id]
            conn.writer.write(b"%x\r\n%b\r\n" % (len(row), row))
            assert orjson.loads(await conn.chunk())["result"]["position"] == pos + 2
            # while the stream is open it holds the session: any other frame is refused
            other.writer.write(plain_request(step.model_copy(update={"seq": seq + 2, "position": pos + 2}), row, creds[1]))
            status, headers = await other.head()
            assert (status, orjson.loads(await other.body(headers))["code"]) == (409, "session_busy")
            # the sender ends its body: the hop ends its answer, with its credit
            conn.writer.write(b"0\r\n\r\n")
            end = orjson.loads(await conn.chunk())
            assert end["end"] and end["done"] == seq + 2 and end["credit"] > seq + 2
            assert await conn.chunk() == b""
            # the same connection carries the next frame; the session went on at seq + 2
            conn.writer.write(plain_request(step.model_copy(update={"seq": seq + 2, "position": pos + 2}), row, creds[1]))
            status, headers = await conn.head()
            assert status == 200 and orjson.loads(await conn.body(headers))["result"]["position"] == pos + 3
            stats = await mesh.session_stats(tail, session_id)
            assert stats["decode_frames"] == 3 and stats["engine_position"] == pos + 3
        finally:
            conn.close()
            other.close()


async def test_bad_step_streams_are_refused_and_a_lost_one_lets_go_of_the_session(mesh: Mesh) -> None:
    async with prefilled(mesh) as (head, tail, plain_step, creds):
        seq, pos = plain_step.seq, plain_step.position
        step = plain_step.model_copy(update={"stream": True})
        row = encode_rows(np.ones((1, HIDDEN), np.float32), "f32")
        # to the head: a Step Stream only goes to a hop after it
        conn = await Raw.open(head.url)
        to_head = step.model_copy(update={"hop": 0, "dtype": "i32", "width": 1})
        conn.writer.write(stream_request(to_head, encode_rows(np.array([5], np.int32), "i32"), creds[0]))
        status, headers = await conn.head()
        assert (status, orjson.loads(await conn.body(headers))["code"]) == (400, "bad_frame")
        assert await conn.closed()
        conn.close()
        # a step whose chunk does not fit the header: an error event, and the connection closes
        conn = await Raw.open(tail.url)
        conn.writer.write(stream_request(step, row, creds[1]))
        assert (await conn.head())[0] == 200
        assert "result" in orjson.loads(await conn.chunk())
        conn.writer.write(b"%x\r\n%b\r\n" % (len(row) - 4, row[:-4]))
        err = orjson.loads(await conn.chunk())
        assert err["error"]["code"] == "bad_frame" and "bytes" in err["error"]["message"]
        assert await conn.chunk() == b"" and await conn.closed()
        conn.close()
        # a stream whose sender vanishes lets go of the session: a plain frame is taken again
        conn = await Raw.open(tail.url)
        conn.writer.write(stream_request(step.model_copy(update={"seq": seq + 1, "position": pos + 1}), row, creds[1]))
        assert (await conn.head())[0] == 200 and "result" in orjson.loads(await conn.chunk())
        conn.close()
        await asyncio.sleep(0.2)
        conn = await Raw.open(tail.url)
        plain = step.model_copy(update={"seq": seq + 2, "position": pos + 2, "stream": False})
        conn.writer.write(plain_request(plain, row, creds[1]))
        status, headers = await conn.head()
        assert status == 200 and orjson.loads(await conn.body(headers))["result"]["position"] == pos + 3
        conn.close()
