"""Seam Links: one connection per pair of consecutive hops' nodes carries every session's
decode steps, one message per turn of the sender's event loop, one lane per Decode Run.

Link level against a scripted server (the sender's side: the steps of several sessions sent in
one turn go as one message on one connection, a lane's end is read before its session's next
request, refusals and failures typed and only for their lane, a link cut short fails every
lane and the next lane connects again). Node level with raw sockets against a real tail (the
receiver's side: one answer per step, the session held while its lane is open, a bad part
failing only its own session while the other lane in the same message goes on, a message that
does not parse ending the link, a lost link letting go of its sessions). Exactness of tokens
decoded over Seam Links is in test_decode_run.py and test_route_exact.py, which run Decode Runs
over 2 and 3 real hops."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import numpy as np
import orjson
import pytest

import wire.seam_link
from gateway.route_client import RouteClient
from schemas.credentials import CREDENTIAL_HEADER
from schemas.frames import (
    FRAME_HEADER,
    LANE_END,
    LANE_OPEN,
    LANE_STEP,
    FrameError,
    FrameHeader,
    FrameRejectedError,
    FrameResult,
    HopUnreachableError,
    RunEvent,
    encode_rows,
    lane_open,
    link_answer,
    link_part,
    parse_lane_open,
    parse_link_answer,
    parse_link_message,
)
from schemas.route import RouteFailure
from tests.fixtures.chunks import take_chunk
from tests.fixtures.mesh import Mesh, NodeProc
from wire.link import FrameLink
from wire.seam_link import SeamLink, _messages

HIDDEN = 576


def token_event(token_id: int, position: int) -> bytes:
    return RunEvent(result=FrameResult(token_id=token_id, position=position)).model_dump_json().encode()


class LinkServer:
    """A raw loopback hop speaking the Seam Link: answers each step of a lane with the next event
    scripted for its session (by the lane's opening header), a lane's end with its end event; a
    Content-Length request with a plain 202. Records connections and each message's parts."""

    def __init__(self, events: dict[str, list[bytes]]) -> None:
        self.events = events
        self.connections = 0
        self.messages: list[list[tuple[int, int]]] = []  # (lane, kind) of each part
        self.plain = 0
        self.lanes: dict[int, str] = {}
        self.writers: list[asyncio.StreamWriter] = []
        self.muted: set[asyncio.StreamWriter] = set()  # connections that take writes and answer nothing

    async def __aenter__(self) -> str:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            self.writers.append(writer)
            buf = bytearray()
            try:
                while True:
                    head = (await reader.readuntil(b"\r\n\r\n")).decode().lower()
                    if "transfer-encoding: chunked" not in head:
                        await reader.readexactly(int(head.split("content-length:")[1].split("\r\n")[0]))
                        self.plain += 1
                        body = b'{"seq":0,"credit":9,"done":3}'
                        writer.write(b"HTTP/1.1 202 Accepted\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body))
                        continue
                    assert head.startswith("post /v1/links ")
                    writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
                    while (chunk := take_chunk(buf)) is None or chunk:
                        if chunk is None:
                            data = await reader.read(65536)
                            if not data:
                                raise ConnectionResetError("the sender went away")
                            buf += data
                            continue
                        self._message(chunk, writer)
                    break
            except (asyncio.IncompleteReadError, ConnectionError):
                writer.close()

        self.server = await asyncio.start_server(handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    def _message(self, chunk: bytes, writer: asyncio.StreamWriter) -> None:
        if writer in self.muted:
            return
        parts = parse_link_message(chunk)
        self.messages.append([(lane, kind) for lane, kind, _ in parts])
        for lane, kind, data in parts:
            if kind == LANE_OPEN:
                self.lanes[lane] = FrameHeader.from_header(parse_lane_open(data)[0]).session_id
            sid = self.lanes[lane]
            if kind == LANE_END:
                end = RunEvent(end=True, credit=12, done=8).model_dump_json().encode()
                out = [link_answer(lane, end, True)]
            else:
                event = self.events[sid].pop(0)
                out = [link_answer(lane, event, orjson.loads(event).get("result") is None)]
            writer.write(b"".join(b"%x\r\n%b\r\n" % (len(c), c) for c in out))

    async def __aexit__(self, *exc: object) -> None:
        for w in self.writers:
            w.close()
        self.server.close()


def link(url: str, seam: SeamLink, session: str = "s") -> FrameLink:
    return FrameLink(url, hop_index=1, node_id="tail", session_id=session, route_id="r", epoch=1, seam=seam)


def first_header(seq: int, session: str = "s") -> str:
    return FrameHeader(session_id=session, route_id="r", epoch=1, hop=1, seq=seq, phase="decode", position=20 + seq,
                       n_rows=1, dtype="f32", width=4, final=True, stream=True).to_header()


ROW = encode_rows(np.ones((1, 4), np.float32), "f32")


def test_parts_join_into_messages_under_the_bound() -> None:
    parts = [b"a" * 3, b"b" * 3, b"c" * 5]
    assert _messages(parts) == [(b"aaabbbccccc", 3)]
    big = [b"x" * (3 << 20), b"y" * (2 << 20), b"z"]
    assert [n for _, n in _messages(big)] == [1, 2]  # 4 MiB at most; a part never splits
    assert parse_link_message(link_part(3, LANE_STEP, b"abc") + link_part(3, LANE_END)) == [
        (3, LANE_STEP, b"abc"), (3, LANE_END, b"")]
    with pytest.raises(Exception, match="does not fit"):
        parse_link_message(link_part(3, LANE_STEP, b"abc")[:-1])
    assert parse_link_answer(link_answer(9, b"{}", True)) == (9, True, b"{}")
    assert parse_lane_open(parse_link_message(lane_open(1, "h", "c", b"rows"))[0][2]) == ("h", "c", b"rows")


async def test_the_steps_of_one_turn_go_as_one_message_on_one_connection() -> None:
    sessions = ["a", "b", "c"]
    srv = LinkServer({s: [token_event(i, 21), token_event(i + 10, 22)] for i, s in enumerate(sessions)})
    async with srv as url:
        seam = SeamLink(url)
        links = [link(url, seam, s) for s in sessions]
        got = await asyncio.gather(*(lk.stream_step(0, lambda s=s: first_header(0, s), ROW)
                                     for lk, s in zip(links, sessions, strict=True)))
        assert [r["token_id"] for r in got] == [0, 1, 2]
        got = await asyncio.gather(*(lk.stream_step(1, lambda: "", ROW) for lk in links))
        assert [r["token_id"] for r in got] == [10, 11, 12]
        # one message per turn: three opening parts, then three steps
        assert srv.messages == [[(1, LANE_OPEN), (2, LANE_OPEN), (3, LANE_OPEN)],
                                [(1, LANE_STEP), (2, LANE_STEP), (3, LANE_STEP)]]
        for lk in links:
            lk.end_stream()
        await links[0].send_rendered(2, first_header(2, "a").replace('"stream":true,', ""), ROW)  # reads the end first
        assert links[0].credit == 12 and srv.connections == 2  # the link, and the session's own for frames
        assert seam.messages == 3 and seam.parts == 9
        seam.close()


async def test_a_refusal_or_failure_ends_only_its_lane_and_is_typed() -> None:
    failure = RouteFailure(session_id="b", route_id="r", phase="decode", hop_index=2, node_id="n2",
                           reason="hop unreachable: gone", code="hop_lost")
    refusal = RunEvent(error=FrameError(code="bad_frame", message="bad part")).model_dump_json().encode()
    srv = LinkServer({"a": [token_event(7, 21), refusal, token_event(9, 22)],
                      "b": [token_event(8, 21), RunEvent(failure=failure).model_dump_json().encode()]})
    async with srv as url:
        seam = SeamLink(url)
        a, b = link(url, seam, "a"), link(url, seam, "b")
        assert (await a.stream_step(0, lambda: first_header(0, "a"), ROW))["token_id"] == 7
        assert (await b.stream_step(0, lambda: first_header(0, "b"), ROW))["token_id"] == 8
        with pytest.raises(FrameRejectedError) as info:
            await a.stream_step(1, lambda: first_header(1, "a"), ROW)
        assert info.value.status == 400 and info.value.error.code == "bad_frame"
        with pytest.raises(FrameRejectedError) as info:
            await b.stream_step(1, lambda: first_header(1, "b"), ROW)
        assert info.value.error.failure == failure  # the hop's own failure, passed on
        # the refused lane is gone: the next step opens a new lane on the same connection
        assert (await a.stream_step(1, lambda: first_header(1, "a"), ROW))["token_id"] == 9
        assert srv.connections == 1 and srv.messages[-1] == [(3, LANE_OPEN)]
        seam.close()


async def test_a_link_cut_short_fails_every_lane_and_the_next_lane_connects_again() -> None:
    srv = LinkServer({"a": [token_event(7, 21)], "b": []})
    async with srv as url:
        seam = SeamLink(url)
        a, b = link(url, seam, "a"), link(url, seam, "b")
        assert (await a.stream_step(0, lambda: first_header(0, "a"), ROW))["token_id"] == 7
        pending = asyncio.ensure_future(b.stream_step(0, lambda: first_header(0, "b"), ROW))
        await asyncio.sleep(0.1)
        srv.writers[0].close()  # the hop dies with b's step unanswered
        with pytest.raises(HopUnreachableError):
            await pending
        with pytest.raises(HopUnreachableError):
            await a.stream_step(1, lambda: "", ROW)
        srv.events["a"].append(token_event(9, 22))
        assert (await a.stream_step(1, lambda: first_header(1, "a"), ROW))["token_id"] == 9
        assert srv.connections == 2
        seam.close()


async def test_a_link_gone_silent_is_let_go_with_its_last_lane_and_the_next_lane_connects_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A cut between two machines leaves the kept-alive connection open, taking writes and answering
    nothing: the session's stall ends its lane, and the next run must not go on the same connection."""
    monkeypatch.setattr(wire.seam_link, "SILENT_S", 0.2)
    srv = LinkServer({"a": [token_event(7, 21), token_event(9, 22)]})
    async with srv as url:
        seam = SeamLink(url)
        a = link(url, seam, "a")
        assert (await a.stream_step(0, lambda: first_header(0, "a"), ROW))["token_id"] == 7
        srv.muted.update(srv.writers)  # the path to the hop is cut: nothing comes back on it
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.5):  # (the gateway's stall deadline, shortened)
                await a.stream_step(1, lambda: "", ROW)
        async with asyncio.timeout(5):
            assert (await a.stream_step(1, lambda: first_header(1, "a"), ROW))["token_id"] == 9
        assert srv.connections == 2
        seam.close()


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


@asynccontextmanager
async def prefilled(mesh: Mesh, nodes: tuple[NodeProc, NodeProc] | None = None,
                    ) -> AsyncIterator[tuple[NodeProc, NodeProc, FrameHeader, list[str]]]:
    """A 2-hop session after a 10-token prefill: (head, tail, the header of the tail's next
    decode step, as a lane opens with it, the hops' credentials); on `nodes` when given."""
    head, tail = nodes or (await mesh.spawn((0, 15)), await mesh.spawn((15, 30)))
    session = await mesh.route([head, tail])
    async with RouteClient(session, mesh.http, chunk_size=8, bus=mesh.bus) as rc:
        await rc.prefill(list(range(300, 310)))
        step = FrameHeader(
            session_id=session.session_id, route_id=session.route_id, epoch=session.epoch, hop=1, seq=rc.seq,
            phase="decode", position=rc.position, n_rows=1, dtype="f32", width=HIDDEN, final=True, stream=True)
        yield head, tail, step, session.credentials




def link_request(first_message: bytes) -> bytes:
    return b"POST /v1/links HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + message(first_message)


def message(payload: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(payload), payload)


async def lane_event(conn: Raw) -> tuple[int, bool, dict]:
    lane, last, event = parse_link_answer(await conn.chunk())
    return lane, last, orjson.loads(event)


async def test_a_tail_answers_each_step_holds_the_session_and_ends_the_lane_cleanly(mesh: Mesh) -> None:
    async with prefilled(mesh) as (_head, tail, step, creds):
        seq, pos, session_id = step.seq, step.position, step.session_id
        row = encode_rows(np.ones((1, HIDDEN), np.float32), "f32")
        conn, other = await Raw.open(tail.url), await Raw.open(tail.url)
        try:
            conn.writer.write(link_request(lane_open(5, step.to_header(),
                                                     creds[1], row)))
            status, headers = await conn.head()
            assert status == 200 and headers["transfer-encoding"] == "chunked"
            lane, last, first = await lane_event(conn)
            assert (lane, last) == (5, False) and first["result"]["position"] == pos + 1
            assert [t["node_id"] for t in first["result"]["timings"]] == [tail.node_id]
            conn.writer.write(message(link_part(5, LANE_STEP, row)))
            assert (await lane_event(conn))[2]["result"]["position"] == pos + 2
            # while the lane is open it holds the session: a lane on another link is refused
            busy = step.model_copy(update={"seq": seq + 2, "position": pos + 2})
            other.writer.write(link_request(lane_open(7, busy.to_header(), creds[1], row)))
            assert (await other.head())[0] == 200
            lane, last, refused = await lane_event(other)
            assert (lane, last, refused["error"]["code"]) == (7, True, "session_busy")
            # the sender ends the lane: the hop ends it with its credit; the link stays
            conn.writer.write(message(link_part(5, LANE_END)))
            lane, last, end = await lane_event(conn)
            assert (lane, last) == (5, True) and end["end"] and end["done"] == seq + 2 and end["credit"] > seq + 2
            # and a new lane of the same link carries the next steps, from seq + 2
            conn.writer.write(message(lane_open(6, busy.to_header(), creds[1], row)))
            lane, last, nxt = await lane_event(conn)
            assert (lane, last) == (6, False) and nxt["result"]["position"] == pos + 3
            stats = await mesh.session_stats(tail, session_id)
            assert stats["decode_frames"] == 3 and stats["engine_position"] == pos + 3
        finally:
            conn.close()
            other.close()


async def test_a_bad_part_fails_only_its_session_and_a_lost_link_lets_go(mesh: Mesh) -> None:
    async with prefilled(mesh) as (head, tail, step_a, creds_a), prefilled(mesh, (head, tail)) as (_, _, step_b, creds_b):
        row = encode_rows(np.ones((1, HIDDEN), np.float32), "f32")
        a, b = step_a, step_b
        conn = await Raw.open(tail.url)
        conn.writer.write(link_request(lane_open(1, a.to_header(), creds_a[1], row) + lane_open(2, b.to_header(), creds_b[1], row)))
        assert (await conn.head())[0] == 200
        assert {(await lane_event(conn))[0] for _ in range(2)} == {1, 2}
        # one message: a's step is short by 4 bytes, b's is whole; only a's lane ends, with a refusal
        conn.writer.write(message(link_part(1, LANE_STEP, row[:-4]) + link_part(2, LANE_STEP, row)))
        events = {lane: (last, ev) for lane, last, ev in [await lane_event(conn) for _ in range(2)]}
        assert events[1][0] and events[1][1]["error"]["code"] == "bad_frame" and "bytes" in events[1][1]["error"]["message"]
        assert not events[2][0] and events[2][1]["result"]["position"] == b.position + 2
        # a lane whose credential is not the hop's: refused at its opening; b goes on
        c = b.model_copy(update={"seq": b.seq + 2, "position": b.position + 2})
        conn.writer.write(message(lane_open(3, c.to_header(), creds_a[1], row) + link_part(2, LANE_STEP, row)))
        events = {lane: (last, ev) for lane, last, ev in [await lane_event(conn) for _ in range(2)]}
        assert events[3][0] and events[3][1]["error"]["code"] == "bad_credential"
        assert events[2][1]["result"]["position"] == b.position + 3
        # a message that does not parse ends every lane and the connection
        conn.writer.write(message(b"\x02\x00\x00\x00\x09"))
        lane, last, ev = await lane_event(conn)
        assert (lane, last) == (2, True) and ev["error"]["code"] == "bad_frame"
        assert await conn.chunk() == b"" and await conn.closed()
        conn.close()
        # b's session was let go: a lane on a new link takes it again
        conn = await Raw.open(tail.url)
        taken = b.model_copy(update={"seq": b.seq + 3, "position": b.position + 3})
        conn.writer.write(link_request(lane_open(1, taken.to_header(), creds_b[1], row)))
        assert (await conn.head())[0] == 200
        assert (await lane_event(conn))[2]["result"]["position"] == b.position + 4
        conn.writer.write(message(link_part(1, LANE_END)))
        assert (await lane_event(conn))[1]
        # a lane whose sender vanishes lets go of its session too
        nxt = taken.model_copy(update={"seq": taken.seq + 1, "position": taken.position + 1})
        lost = await Raw.open(tail.url)
        lost.writer.write(link_request(lane_open(1, nxt.to_header(), creds_b[1], row)))
        assert (await lost.head())[0] == 200 and "result" in (await lane_event(lost))[2]
        lost.close()
        await asyncio.sleep(0.2)
        again = taken.model_copy(update={"seq": taken.seq + 2, "position": taken.position + 2})
        conn.writer.write(message(lane_open(2, again.to_header(), creds_b[1], row)))
        assert (await lane_event(conn))[2]["result"]["position"] == b.position + 6
        conn.close()


async def test_frames_with_chunked_bodies_and_lanes_to_the_head_are_refused(mesh: Mesh) -> None:
    async with prefilled(mesh) as (head, _tail, step, creds):
        conn = await Raw.open(head.url)
        to_head = step.model_copy(update={"hop": 0, "dtype": "i32", "width": 1, "stream": True})
        ids = encode_rows(np.array([5], np.int32), "i32")
        conn.writer.write(link_request(lane_open(1, to_head.to_header(), creds[0], ids)))
        assert (await conn.head())[0] == 200
        lane, last, ev = await lane_event(conn)
        assert (lane, last) == (1, True) and ev["error"]["code"] == "bad_frame"
        conn.close()
        conn = await Raw.open(head.url)
        conn.writer.write((f"POST /v1/frames HTTP/1.1\r\nHost: x\r\n{FRAME_HEADER}: {to_head.to_header()}\r\n"
                           f"{CREDENTIAL_HEADER}: {creds[0]}\r\nTransfer-Encoding: chunked\r\n\r\n").encode() + message(ids))
        status, headers = await conn.head()
        assert (status, orjson.loads(await conn.body(headers))["code"]) == (400, "bad_frame")
        assert await conn.closed()
        conn.close()
