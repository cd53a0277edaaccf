"""The node's frame server at the HTTP level: keep-alive, refused bodies skipped, hand-over of
other requests to the aiohttp app on the same connection, and clear errors for what it does
not take (raw sockets against a real node process)."""

from __future__ import annotations

import asyncio

import numpy as np
import orjson
import pytest

from gateway.route_client import RouteClient
from nodes.server.frame_server import BadRequest, credit_session, parse_head
from schemas.frames import FRAME_HEADER, FrameHeader, encode_rows
from tests.fixtures.mesh import Mesh

HIDDEN = 576


class Raw:
    """One raw HTTP/1.1 connection."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, url: str) -> Raw:
        host, port = url.removeprefix("http://").rstrip("/").split(":")
        return cls(*await asyncio.open_connection(host, int(port)))

    def send(self, method: str, path: str, headers: dict[str, str], body: bytes = b"") -> None:
        lines = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self.writer.write(f"{method} {path} HTTP/1.1\r\nHost: x\r\n{lines}\r\n".encode() + body)

    async def response(self) -> tuple[int, dict[str, str], bytes]:
        head = (await asyncio.wait_for(self.reader.readuntil(b"\r\n\r\n"), 10)).decode()
        status_line, *lines = head[:-4].split("\r\n")
        headers = {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in lines)}
        body = await self.reader.readexactly(int(headers.get("content-length", "0")))
        return int(status_line.split()[1]), headers, body

    async def closed(self) -> bool:
        return await asyncio.wait_for(self.reader.read(1), 5) == b""

    def close(self) -> None:
        self.writer.close()


def frame_headers(h: FrameHeader, body: bytes, **extra: str) -> dict[str, str]:
    return {FRAME_HEADER: h.to_header(), "Content-Length": str(len(body)), **extra}


def test_parse_head_reads_the_request_and_refuses_garbage() -> None:
    head = parse_head(b"POST /v1/frames?x=1 HTTP/1.1\r\nHost: a\r\nContent-Length: 12\r\n\r\n")
    assert (head.method, head.path, head.query, head.content_length, head.keep_alive) == (
        "POST", "/v1/frames", "x=1", 12, True)
    assert not parse_head(b"GET / HTTP/1.1\r\nConnection: close\r\n\r\n").keep_alive
    assert not parse_head(b"GET / HTTP/1.0\r\n\r\n").keep_alive
    assert parse_head(b"POST / HTTP/1.1\r\n\r\n").content_length is None
    assert parse_head(b"POST / HTTP/1.1\r\nContent-Length: -3\r\n\r\n").content_length == -1
    for bad in (b"GARBAGE\r\n\r\n", b"GET / SPDY/3\r\n\r\n", b"GET / HTTP/1.1\r\nno colon\r\n\r\n"):
        with pytest.raises(BadRequest):
            parse_head(bad)
    assert credit_session("/v1/sessions/abc/credit") == "abc"
    assert credit_session("/v1/sessions//credit") is None
    assert credit_session("/v1/sessions/a/b/credit") is None


async def test_frames_credit_and_app_requests_share_one_keep_alive_connection(mesh: Mesh) -> None:
    head, tail = await mesh.spawn((0, 15)), await mesh.spawn((15, 30))
    session = await mesh.route([head, tail])
    async with RouteClient(session, mesh.http, chunk_size=8, bus=mesh.bus) as rc:
        await rc.prefill(list(range(300, 310)))
        good = FrameHeader(session_id=session.session_id, route_id=session.route_id, epoch=session.epoch,
                           hop=1, seq=rc.seq, phase="decode", position=rc.position, n_rows=1,
                           dtype="f32", width=HIDDEN, final=True)
        row = encode_rows(np.ones((1, HIDDEN), np.float32), "f32")
        conn = await Raw.open(tail.url)
        try:
            # a refused frame: its body is skipped and the connection stays usable
            bad = good.model_copy(update={"position": good.position + 5})
            conn.send("POST", "/v1/frames", frame_headers(bad, row), row)
            status, _, body = await conn.response()
            assert (status, orjson.loads(body)["code"]) == (409, "position_mismatch")
            # a credit long-poll on the same connection answers at once (credit is already above 0)
            q = f"route_id={session.route_id}&epoch={session.epoch}&above=0"
            conn.send("GET", f"/v1/sessions/{session.session_id}/credit?{q}", {})
            status, _, body = await conn.response()
            assert status == 200 and orjson.loads(body)["credit"] > 0
            # a good frame with Expect: 100-continue: the interim answer, then the tail's token
            conn.send("POST", "/v1/frames", frame_headers(good, row, Expect="100-continue"))
            assert await conn.reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
            conn.writer.write(row)
            status, headers, body = await conn.response()
            ack = orjson.loads(body)
            assert status == 200 and headers["content-type"] == "application/json"
            assert ack["seq"] == good.seq and ack["result"]["position"] == good.position + 1
            # any other request moves the connection to the aiohttp app, and it keeps working
            conn.send("GET", "/healthz", {})
            status, _, body = await conn.response()
            assert status == 200 and orjson.loads(body)["layers"] == [15, 30]
            conn.send("GET", f"/v1/sessions/{session.session_id}", {})
            status, _, body = await conn.response()
            stats = orjson.loads(body)
            # 2 prefill chunks + the decode frame; the refused frame ran nothing
            assert stats["frames"] == 3 and stats["engine_position"] == good.position + 1
            # and the app serves the frame plane too, on the connection it now owns
            conn.send("GET", f"/v1/sessions/{session.session_id}/credit?{q}", {})
            status, _, body = await conn.response()
            assert status == 200 and orjson.loads(body)["credit"] > 0
            conn.send("POST", "/v1/frames", frame_headers(bad, row), row)  # seq is behind by now
            status, _, body = await conn.response()
            assert (status, orjson.loads(body)["code"]) == (409, "seq_mismatch")
        finally:
            conn.close()


@pytest.mark.parametrize(("request_bytes", "status"), [
    (b"POST /v1/frames HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400),
    (b"NONSENSE\r\n\r\n", 400),
    (b"GET /v1/frames HTTP/1.1\r\nConnection: close\r\n\r\n", 405),
    (b"POST /v1/frames HTTP/1.1\r\nContent-Length: 4\r\nConnection: close\r\n\r\nabcd", 400),
    (b"GET /v1/sessions HTTP/1.1\r\nX-Big: " + b"x" * 20000 + b"\r\n\r\n", 431),
])
async def test_requests_the_frame_server_does_not_take_get_a_clear_error(
        mesh: Mesh, request_bytes: bytes, status: int) -> None:
    node = await mesh.spawn((0, 30))
    conn = await Raw.open(node.url)
    try:
        conn.writer.write(request_bytes)
        got, _, body = await conn.response()
        assert got == status
        assert orjson.loads(body)["code"] == "bad_frame"
        assert await conn.closed()
        # the node serves on
        async with mesh.http.get(node.url + "/healthz") as resp:
            assert resp.status == 200
    finally:
        conn.close()
