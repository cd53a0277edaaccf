"""The node's frame server at the HTTP level: keep-alive, refused bodies skipped, hand-over of
other requests to the aiohttp app on the same connection, and clear errors for what it does
not take (raw sockets against a real node process)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import orjson
import pytest

from bus.server import free_port
from gateway.route_client import RouteClient
from schemas.credentials import CREDENTIAL_HEADER
from schemas.frames import FRAME_HEADER, FrameHeader, RouteFailedError, encode_rows
from schemas.route import RouteSession
from tests.fixtures.faults import FaultRelay
from tests.fixtures.mesh import Mesh
from wire.body_deadline import body_deadline
from wire.server import CREDIT_SUFFIX, ConnectionBounds, frame_plane_get, overdue, session_of

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


def tail_prompt_frame(session: RouteSession, n_rows: int = 4) -> tuple[FrameHeader, bytes]:
    """A whole prompt's one frame straight into the tail of a 2-hop route nothing was sent on
    yet (hidden rows as the head would pass them), and its rows. Decode steps are not frames
    past the head (they travel as lanes of a Seam Link), so a raw frame to the tail is a prompt's."""
    header = FrameHeader(session_id=session.session_id, route_id=session.route_id, epoch=session.epoch,
                         hop=1, seq=0, phase="prefill", position=0, n_rows=n_rows,
                         dtype="f32", width=HIDDEN, final=True)
    return header, encode_rows(np.ones((n_rows, HIDDEN), np.float32), "f32")


def frame_headers(h: FrameHeader, body: bytes, credential: str, **extra: str) -> dict[str, str]:
    return {FRAME_HEADER: h.to_header(), CREDENTIAL_HEADER: credential, "Content-Length": str(len(body)), **extra}


def test_frame_plane_session_paths() -> None:
    assert session_of("/v1/sessions/abc/credit", CREDIT_SUFFIX) == "abc"
    assert session_of("/v1/sessions//credit", CREDIT_SUFFIX) is None
    assert session_of("/v1/sessions/a/b/credit", CREDIT_SUFFIX) is None
    assert frame_plane_get("/v1/sessions/abc/credit")
    assert not frame_plane_get("/v1/sessions/abc") and not frame_plane_get("/v1/sessions/a/b/credit")
    assert not frame_plane_get("/v1/sessions/abc/returns")  # a Return Stream is a lane of a Seam Link


async def test_frames_credit_then_app_requests_share_one_keep_alive_connection(mesh: Mesh) -> None:
    head, tail = await mesh.spawn((0, 15)), await mesh.spawn((15, 30))
    session = await mesh.route([head, tail])
    async with RouteClient(session, mesh.http, chunk_size=8, bus=mesh.bus):
        good, row = tail_prompt_frame(session)
        cred = {CREDENTIAL_HEADER: session.credentials[1]}  # the tail's
        conn = await Raw.open(tail.url)
        try:
            # a refused frame: its body is skipped and the connection stays usable
            bad = good.model_copy(update={"position": good.position + 5})
            conn.send("POST", "/v1/frames", frame_headers(bad, row, session.credentials[1]), row)
            status, _, body = await conn.response()
            assert (status, orjson.loads(body)["code"]) == (409, "position_mismatch")
            # a credit long-poll on the same connection answers at once (credit is already above 0)
            q = f"route_id={session.route_id}&epoch={session.epoch}&above=0"
            conn.send("GET", f"/v1/sessions/{session.session_id}/credit?{q}", cred)
            status, _, body = await conn.response()
            assert status == 200 and orjson.loads(body)["credit"] > 0
            # a good frame with Expect: 100-continue: the interim answer, then the tail's token
            conn.send("POST", "/v1/frames", frame_headers(good, row, session.credentials[1], Expect="100-continue"))
            assert await conn.reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
            conn.writer.write(row)
            status, headers, body = await conn.response()
            ack = orjson.loads(body)
            assert status == 200 and headers["content-type"] == "application/json"
            assert ack["seq"] == good.seq and ack["result"]["position"] == good.position + good.n_rows
            # any other request moves the connection to the aiohttp app, and it keeps working
            conn.send("GET", "/healthz", {})
            status, _, body = await conn.response()
            assert status == 200 and orjson.loads(body)["layers"] == [15, 30]
            conn.send("GET", f"/v1/sessions/{session.session_id}", cred)  # its counters: to the route's driver
            status, _, body = await conn.response()
            stats = orjson.loads(body)
            # the prompt's frame; the refused frame ran nothing
            assert stats["frames"] == 1 and stats["engine_position"] == good.position + good.n_rows
            # one frame server: the app, which now owns the connection, refuses the frame plane
            conn.send("GET", f"/v1/sessions/{session.session_id}/credit?{q}", cred)
            status, _, body = await conn.response()
            assert (status, orjson.loads(body)["code"]) == (400, "bad_frame")
            conn.send("POST", "/v1/frames", frame_headers(good, row, session.credentials[1]), row)
            status, _, body = await conn.response()
            assert (status, orjson.loads(body)["code"]) == (400, "bad_frame")
            assert "connection of their own" in orjson.loads(body)["message"]
        finally:
            conn.close()


# What a real parser refuses (probe findings: two lengths, a length with a chunked body, an
# encoding that only contains "chunked", lengths that are not ASCII digits, signed or 0x chunk
# sizes), and what this plane does not take. Each is answered with a 4xx and the connection closes.
REFUSED = [
    (b"POST /v1/frames HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400),
    (b"NONSENSE\r\n\r\n", 400),
    (b"GET / SPDY/3\r\n\r\n", 400),
    (b"GET /v1/frames HTTP/1.1\r\nno colon\r\n\r\n", 400),
    (b"GET /v1/frames HTTP/1.1\r\nConnection: close\r\n\r\n", 405),
    (b"POST /v1/frames HTTP/1.1\r\nContent-Length: 4\r\nConnection: close\r\n\r\nabcd", 400),
    (b"GET /v1/sessions HTTP/1.1\r\nX-Big: " + b"x" * 20000 + b"\r\n\r\n", 431),
    (b"POST /v1/frames HTTP/1.1\r\nContent-Length: \xb2\r\n\r\nab", 400),  # a clear 400, no traceback
    (b"POST /v1/frames HTTP/1.1\r\nContent-Length: +3\r\n\r\nabc", 400),
    (b"POST /v1/frames HTTP/1.1\r\nContent-Length: 0x3\r\n\r\nabc", 400),
    (b"POST /v1/frames HTTP/1.1\r\nContent-Length: " + b"9" * 30 + b"\r\n\r\n", 400),
    (b"POST /v1/frames HTTP/1.1\r\nTransfer-Encoding: xchunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n", 400),
    (b"POST /v1/frames HTTP/1.1\r\nTransfer-Encoding: gzip, chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n", 400),
    (b"POST /v1/frames HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 40\r\n\r\nab", 400),
    (b"POST /v1/frames HTTP/1.1\r\nContent-Length: 3\r\ncontent-length: 3\r\n\r\nabc", 400),
    (b"POST /v1/frames HTTP/1.1\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\nabc", 400),
    (b"POST /v1/frames HTTP/1.1\r\nx-meshnet-frame: {}\r\nx-meshnet-frame: {}\r\n\r\n", 400),
    (b"POST /v1/frames HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n-2\r\nabc", 400),
    (b"POST /v1/frames HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0x3\r\nabc\r\n", 400),
]


async def test_requests_the_frame_server_does_not_take_get_a_clear_error(mesh: Mesh) -> None:
    node = await mesh.spawn((0, 30))
    for request_bytes, status in REFUSED:
        conn = await Raw.open(node.url)
        try:
            conn.writer.write(request_bytes)
            got, _, body = await conn.response()
            assert got == status, request_bytes[:80]
            assert orjson.loads(body)["code"] == "bad_frame"
            assert await conn.closed()
        finally:
            conn.close()
    async with mesh.http.get(node.url + "/healthz") as resp:  # the node serves on
        assert resp.status == 200


@pytest.mark.parametrize(("waiting", "since", "now", "over"), [
    ("head", 0.0, 0.9, None), ("head", 0.0, 1.0, "request head not received within 1 s"),
    ("body", 0.0, 1.9, None), ("body", 0.0, 2.0, "request body stalled: no byte of it for 2 s"),
    ("idle", 0.0, 2.9, None), ("idle", 0.0, 3.0, "request idle not received within 3 s"),
    ("", 0.0, 1e9, None),  # answering: no deadline
])
def test_overdue(waiting: str, since: float, now: float, over: str | None) -> None:
    bounds = ConnectionBounds(head_timeout_s=1.0, body_timeout_s=2.0, idle_timeout_s=3.0)
    assert overdue(waiting, since, now, bounds) == over


def test_a_body_that_keeps_arriving_is_never_overdue() -> None:
    """40 s into a body whose bytes keep coming at 12,500 bytes/s (a 0.1 Mbit/s link): not
    overdue, where one 30 s deadline from its head cut it; silent for 30 s it is."""
    bounds = ConnectionBounds(body_timeout_s=30.0, body_min_rate=1000.0)
    assert overdue("body", 0.0, 40.0, bounds, received=500_000, last=39.9) is None
    assert overdue("body", 0.0, 69.8, bounds, received=500_000, last=39.9) is None
    assert "stalled" in (overdue("body", 0.0, 70.0, bounds, received=500_000, last=39.9) or "")


@pytest.mark.parametrize(("started", "last", "received", "due", "why"), [
    (0.0, 0.0, 0, 30.0, "stalled"),  # nothing yet: the grace
    (0.0, 10.0, 5_000, 35.0, "slow"),  # 5,000 bytes earn 5 s beyond the grace
    (0.0, 10.0, 50_000, 40.0, "stalled"),  # ahead of the floor: only silence cuts it
    (0.0, 100.0, 1_000_000, 130.0, "stalled"),  # a 0.1 Mbit/s link's 1 MB, still arriving
    (0.0, 100.0, 50_000, 80.0, "slow"),  # 500 bytes/s for 100 s: below the floor, overdue at 80 s
    (5.0, 5.0, 0, 35.0, "stalled"),
])
def test_body_deadline(started: float, last: float, received: int, due: float, why: str) -> None:
    assert body_deadline(started, last, received, 30.0, 1000.0) == (due, why)


async def test_slow_clients_are_cut_off_and_cost_no_session(mesh: Mesh) -> None:
    """A slowloris head, a body that never comes, a body that trickles below --body-min-rate and
    an idle connection are each closed by their timeout; a connection over the cap is refused;
    the session and the node go on."""
    args = ["--head-timeout", "0.5", "--body-timeout", "0.5", "--body-min-rate", "1000", "--idle-timeout", "1.5",
            "--max-connections", "4"]
    head, tail = await mesh.spawn((0, 15), args=args), await mesh.spawn((15, 30), args=args)
    session = await mesh.route([head, tail])
    async with RouteClient(session, mesh.http, chunk_size=8, bus=mesh.bus) as rc:
        frame, row = tail_prompt_frame(session)
        loris, slow_body, idle, trickle = [await Raw.open(tail.url) for _ in range(4)]

        async def drip() -> None:  # 10 bytes every 0.05 s: never silent for long, but 200 bytes/s
            for i in range(0, len(row), 10):
                trickle.writer.write(row[i:i + 10])
                await asyncio.sleep(0.05)

        trickle.send("POST", "/v1/frames", frame_headers(frame, row, session.credentials[1]))
        dripping = asyncio.create_task(drip())
        try:
            loris.writer.write(b"POST /v1/frames HTTP/1.1\r\nHost: x\r\nX-Slow: ")  # never ends
            slow_body.send("POST", "/v1/frames", frame_headers(frame, row, session.credentials[1]), row[:100])  # 100 of its bytes
            status, _, body = await loris.response()
            assert status == 408 and "head" in orjson.loads(body)["message"]
            assert await loris.closed()
            status, _, body = await slow_body.response()
            assert status == 408 and "body stalled" in orjson.loads(body)["message"]
            assert await slow_body.closed()
            status, _, body = await trickle.response()
            assert status == 408 and "slower than 1000 bytes/s" in orjson.loads(body)["message"]
            assert await trickle.closed()
            assert await idle.closed()  # no request at all: closed after the idle timeout, no answer
            stats = await mesh.session_stats(tail, session.session_id)
            assert stats["frames"] == 0 and stats["engine_position"] == 0  # the cut frame never ran
            over = [await Raw.open(tail.url) for _ in range(5)]
            try:
                status, _, body = await over[-1].response()  # the 5th of at most 4
                assert status == 503 and "too many connections" in orjson.loads(body)["message"]
            finally:
                for c in over:
                    c.close()
        finally:
            dripping.cancel()
            for c in (loris, slow_body, idle, trickle):
                c.close()
        first = await rc.prefill(list(range(300, 310)))  # the session was never touched: it runs
        assert (await rc.decode(first.token_id)).token_id >= 0


async def test_a_big_frame_over_a_slow_link_runs_however_long_its_body_takes(mesh: Mesh) -> None:
    """A prefill frame whose body takes ~5 s to cross a 0.1 Mbit/s link (32 of the bundled
    model's f32 rows, 73,728 bytes) into a tail with `--body-timeout 1`: its bytes keep coming,
    so it runs and the tail answers its token. One deadline from the frame's head cut it with
    a 408 after 1 s, however steadily it arrived."""
    head, tail = await mesh.spawn((0, 15)), await mesh.spawn((15, 30), args=["--body-timeout", "1"])
    session = await mesh.route([head, tail])
    host, port = tail.url.removeprefix("http://").rstrip("/").split(":")
    async with RouteClient(session, mesh.http, chunk_size=8, bus=mesh.bus), \
            FaultRelay(host, int(port), 0.005, rate_mbit=0.1) as relay:  # bytes arrive a segment at a time
        frame, rows = tail_prompt_frame(session, n_rows=32)
        conn = await Raw.open(f"http://{relay.address}")
        try:
            t0 = time.monotonic()
            conn.send("POST", "/v1/frames", frame_headers(frame, rows, session.credentials[1]), rows)
            status, _, body = await conn.response()
            took = time.monotonic() - t0
        finally:
            conn.close()
    assert status == 200, body
    assert orjson.loads(body)["result"]["position"] == 32
    assert took > 3.0, took  # the body did take longer than --body-timeout


class CutProxy:
    """A TCP proxy to a node that passes every connection through, except that a connection
    whose first request is a frame goes silent after `keep` bytes (the link is lost mid-body:
    no FIN, no RST); the node's answers always come back."""

    def __init__(self, target_port: int, keep: int) -> None:
        self.target_port, self.keep = target_port, keep
        self.port = free_port()
        self.server: asyncio.Server | None = None
        self.tasks: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> CutProxy:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, cut: bool) -> None:
            passed, frames = 0, None
            while data := await src.read(65536):
                frames = data.startswith(b"POST /v1/frames") if frames is None else frames
                if cut and frames:
                    data = data[:max(0, self.keep - passed)]
                passed += len(data)
                dst.write(data)
            dst.close()

        for t in (asyncio.create_task(pipe(reader, up_writer, True)), asyncio.create_task(pipe(up_reader, writer, False))):
            self.tasks.add(t)
            t.add_done_callback(self.tasks.discard)


async def test_a_frame_whose_link_goes_silent_mid_body_is_a_lost_hop(mesh: Mesh) -> None:
    """The link from the head to the tail goes silent 4,000 bytes into a prompt's frame: the
    tail cuts the body after --body-timeout (408) and the head reports the tail lost
    (`hop_lost`, which the gateway restarts), not `bad_frame`, which it takes for a protocol
    error and fails the request with at once."""
    port = free_port()
    async with CutProxy(port, keep=4000) as proxy:
        head = await mesh.spawn((0, 15))
        tail = await mesh.spawn((15, 30), args=["--port", str(port), "--advertise", f"http://127.0.0.1:{proxy.port}",
                                                "--body-timeout", "1"])
        session = await mesh.route([head, tail])
        async with RouteClient(session, mesh.http, chunk_size=32, bus=mesh.bus) as rc:
            with pytest.raises(RouteFailedError) as info:
                async with asyncio.timeout(60):  # a guard: the tail cuts the body after 1 s
                    await rc.prefill(list(range(300, 340)))
    failure = info.value.failure
    assert (failure.code, failure.node_id) == ("hop_lost", tail.node_id), failure
    assert "408" in failure.reason and "stalled" in failure.reason, failure


async def test_two_thousand_idle_sockets_from_one_address_leave_the_node_serving(mesh: Mesh) -> None:
    """Idle sockets once took a node off the mesh: they sat in the one shared pool for the idle
    timeout (300 s) and every new chat got 502. Now a silent new connection is closed after
    --first-request-timeout (2 s), and one address holds at most --max-connections-per-peer
    (256) of them: the rest are refused at once, and routes from other addresses go on."""
    head, tail = await mesh.spawn((0, 15)), await mesh.spawn((15, 30))
    host, port = tail.url.removeprefix("http://").rsplit(":", 1)

    async def idle_socket() -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        try:
            return await asyncio.open_connection(host, int(port), local_addr=("127.0.0.2", 0))
        except OSError:
            return None

    sockets = []
    for _ in range(20):  # 2,000 in batches of 100
        sockets += [s for s in await asyncio.gather(*(idle_socket() for _ in range(100))) if s is not None]
    try:
        session = await mesh.route([head, tail])  # the head reaches the tail from 127.0.0.1
        async with RouteClient(session, mesh.http, bus=mesh.bus) as rc:
            first = await rc.prefill(list(range(300, 340)))
            nxt = await rc.decode(first.token_id)
        assert nxt.token_id >= 0

        async def closed(reader: asyncio.StreamReader) -> bool:
            try:
                async with asyncio.timeout(30):  # a guard: the node closes them after 2 s
                    while await reader.read(65536):
                        pass  # a refused one first reads its 503
            except (OSError, TimeoutError):
                return False
            return True

        assert all(await asyncio.gather(*(closed(r) for r, _ in sockets)))  # every idle socket was let go
    finally:
        for _, w in sockets:
            w.close()
