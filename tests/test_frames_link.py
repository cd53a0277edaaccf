"""FrameLink over a real loopback HTTP server: acks, credit long-poll, errors, stale keep-alives."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import numpy as np
import pytest
import pytest_asyncio
from aiohttp import web

from schemas.frames import (
    FRAME_HEADER,
    FrameAck,
    FrameError,
    FrameHeader,
    FrameRejectedError,
    FrameResult,
    HopUnreachableError,
    RunEvent,
    encode_rows,
)
from wire.client import ChunkStream, FrameTransportError, H1Connection
from wire.link import FrameLink

WAIT_S = 30.0  # bounded waits: a hang fails with a message


class FakeHop:
    """A receiver that accepts frames and grants credit = done + window, done moved by the test."""

    def __init__(self) -> None:
        self.done = 0
        self.window = 2
        self.headers: list[FrameHeader] = []
        self.changed = asyncio.Event()

    async def frames(self, request: web.Request) -> web.Response:
        h = FrameHeader.from_header(request.headers[FRAME_HEADER])
        await request.read()
        if h.seq >= self.done + self.window:
            err = FrameError(code="no_credit", message="no credit")
            return web.Response(status=429, body=err.model_dump_json(), content_type="application/json")
        self.headers.append(h)
        ack = FrameAck(seq=h.seq, credit=self.done + self.window, done=self.done)
        return web.Response(status=202, body=ack.model_dump_json(), content_type="application/json")

    async def credit(self, request: web.Request) -> web.Response:
        above = int(request.query["above"])
        while self.done + self.window <= above:
            await self.changed.wait()
            self.changed = asyncio.Event()
        return web.json_response({"credit": self.done + self.window, "done": self.done})

    def advance(self) -> None:
        self.done += 1
        self.changed.set()


@pytest_asyncio.fixture
async def hop() -> AsyncIterator[tuple[FakeHop, web.AppRunner, str]]:
    fake = FakeHop()
    app = web.Application()
    app.router.add_post("/v1/frames", fake.frames)
    app.router.add_get("/v1/sessions/{sid}/credit", fake.credit)
    runner = web.AppRunner(app, keepalive_timeout=0.2)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield fake, runner, f"http://127.0.0.1:{port}"
    await runner.cleanup()


def frame(seq: int) -> tuple[FrameHeader, bytes]:
    h = FrameHeader(session_id="s", route_id="r", epoch=1, hop=1, seq=seq, phase="prefill",
                    position=seq * 2, n_rows=2, dtype="f32", width=4)
    return h, encode_rows(np.zeros((2, 4), np.float32), "f32")


def link(url: str) -> FrameLink:
    return FrameLink(url, hop_index=1, node_id="n1", session_id="s", route_id="r", epoch=1)


async def test_sender_waits_for_credit_instead_of_overrunning(hop) -> None:
    fake, _runner, url = hop
    lk = link(url)
    assert (await lk.send(*frame(0))).credit == 2
    await lk.send(*frame(1))
    assert lk.conn.connects == 1  # one keep-alive connection for every request
    blocked = asyncio.create_task(lk.send(*frame(2)))  # seq 2 >= credit 2: must wait
    await asyncio.sleep(0.05)
    assert not blocked.done() and len(fake.headers) == 2
    fake.advance()
    await blocked
    assert [h.seq for h in fake.headers] == [0, 1, 2] and lk.stats.credit_waits == 1
    lk.close()


async def test_stale_keepalive_is_retried_but_a_dead_hop_is_unreachable(hop) -> None:
    fake, runner, url = hop
    lk = link(url)
    await lk.send(*frame(0))
    await asyncio.sleep(0.5)  # the server drops the idle keep-alive connection
    await lk.send(*frame(1))  # transparently reconnects
    assert [h.seq for h in fake.headers] == [0, 1] and lk.conn.connects == 2
    await runner.cleanup()
    with pytest.raises(HopUnreachableError) as info:
        await lk.send(*frame(2))
    assert info.value.hop_index == 1 and info.value.node_id == "n1"


async def test_refusals_are_typed(hop) -> None:
    fake, _runner, url = hop
    fake.window = 0
    lk = link(url)
    with pytest.raises(FrameRejectedError) as info:
        await lk.send(*frame(0))
    assert info.value.status == 429 and info.value.error.code == "no_credit"
    lk.close()


class ScriptedServer:
    """A raw loopback server that answers each request with the next scripted bytes."""

    def __init__(self, answers: list[bytes | None]) -> None:
        self.answers = answers  # None: hold the request unanswered
        self.requests = 0
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> str:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                while True:
                    await reader.readuntil(b"\r\n\r\n")
                    self.requests += 1
                    answer = self.answers.pop(0)
                    if answer is not None:
                        writer.write(answer)
            except (asyncio.IncompleteReadError, ConnectionError, IndexError):
                writer.close()

        self.server = await asyncio.start_server(handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()


async def test_connection_skips_interim_answers_and_refuses_garbage() -> None:
    answers = [b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
               b"NOT HTTP AT ALL\r\n\r\n"]
    async with ScriptedServer(answers) as url:
        conn = H1Connection(url)
        assert await conn.request("GET", "/", {}) == (200, b"ok")
        with pytest.raises(FrameTransportError, match="malformed response"):
            await conn.request("GET", "/", {})
        conn.close()


async def test_a_cancelled_request_never_leaves_its_answer_for_the_next_one() -> None:
    async with ScriptedServer([None, b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nfresh"]) as url:
        conn = H1Connection(url)
        pending = asyncio.create_task(conn.request("GET", "/a", {}))
        await asyncio.sleep(0.1)
        pending.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pending
        # the cancelled request's answer could still come on that connection: the next
        # request must not reuse it
        assert await conn.request("GET", "/b", {}) == (200, b"fresh")
        assert conn.connects == 2
        conn.close()


def chunked(*events: bytes, end: bool = True) -> bytes:
    """A 200 answer with one chunk per event (and the last chunk unless `end` is False)."""
    body = b"".join(b"%x\r\n%b\r\n" % (len(e), e) for e in events)
    return b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + body + (b"0\r\n\r\n" if end else b"")


@pytest.mark.parametrize("bad", [
    b"-2\r\nabc", b"0x3\r\nabc\r\n", b"+3\r\nabc\r\n", b" 3\r\nabc\r\n", b"zz\r\nab\r\n",
    b"2\r\nabXY", b"1" * 17 + b"\r\n"])
async def test_a_malformed_chunked_answer_is_a_transport_error_and_costs_its_connection(bad: bytes) -> None:
    """Sizes only a lax parser takes: a negative size once ended the body, and what followed
    was read as the connection's next answer."""
    async with ScriptedServer([b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + bad,
                               b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"]) as url:
        conn = H1Connection(url)
        _, stream = await conn.stream("POST", "/", {})
        assert isinstance(stream, ChunkStream)
        with pytest.raises(FrameTransportError, match="malformed response"):
            [c async for c in stream]
        assert await conn.request("GET", "/", {}) == (200, b"ok")
        assert conn.connects == 2
        conn.close()


async def test_chunked_answers_stream_and_keep_their_connection() -> None:
    answers = [chunked(b"one", b"two"), chunked(b"x", b"y"),
               b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nnext"]
    async with ScriptedServer(answers) as url:
        conn = H1Connection(url)
        status, stream = await conn.stream("POST", "/", {})
        assert status == 200 and isinstance(stream, ChunkStream)
        assert [c async for c in stream] == [b"one", b"two"]
        assert await conn.request("GET", "/", {}) == (200, b"xy")  # request() collects a stream
        assert await conn.request("GET", "/", {}) == (200, b"next")
        assert conn.connects == 1
        conn.close()


async def test_a_stream_left_before_its_end_closes_its_connection() -> None:
    async with ScriptedServer([chunked(b"a", b"b", end=False),
                               b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"]) as url:
        conn = H1Connection(url)
        _, stream = await conn.stream("POST", "/", {})
        assert isinstance(stream, ChunkStream)
        async for chunk in stream:
            assert chunk == b"a"
            break
        stream.abandon()  # the rest of the answer would be read as the next one's
        assert await conn.request("GET", "/", {}) == (200, b"ok")
        assert conn.connects == 2
        conn.close()


def run_frame_header() -> tuple[FrameHeader, bytes]:
    h = FrameHeader(session_id="s", route_id="r", epoch=1, hop=0, seq=0, phase="decode", position=9,
                    n_rows=1, dtype="i32", width=1, final=True, steps=3)
    return h, encode_rows(np.array([5], np.int32), "i32")


async def test_a_decode_run_yields_tokens_then_its_end() -> None:
    tokens = [RunEvent(result=FrameResult(token_id=t, position=10 + i)).model_dump_json().encode()
              for i, t in enumerate((7, 8, 9))]
    end = RunEvent(end=True, credit=7, done=3).model_dump_json().encode()
    async with ScriptedServer([chunked(*tokens, end)]) as url:
        lk = FrameLink(url, hop_index=0, node_id="head", session_id="s", route_id="r", epoch=1)
        events = [e async for e in lk.run(*run_frame_header())]
        assert [e.result.token_id for e in events[:-1]] == [7, 8, 9]  # type: ignore[union-attr]
        assert events[-1].end and lk.credit == 7
        lk.close()


async def test_a_decode_run_cut_short_is_unreachable_and_a_refusal_is_typed() -> None:
    token = RunEvent(result=FrameResult(token_id=7, position=10)).model_dump_json().encode()
    refusal = FrameError(code="session_busy", message="busy").model_dump_json().encode()
    answers = [chunked(token), b"HTTP/1.1 409 Conflict\r\nContent-Length: %d\r\n\r\n%b" % (len(refusal), refusal)]
    async with ScriptedServer(answers) as url:
        lk = FrameLink(url, hop_index=0, node_id="head", session_id="s", route_id="r", epoch=1)
        with pytest.raises(HopUnreachableError, match="without its last event"):
            [e async for e in lk.run(*run_frame_header())]
        with pytest.raises(FrameRejectedError) as info:
            [e async for e in lk.run(*run_frame_header())]
        assert info.value.status == 409 and info.value.error.code == "session_busy"
        lk.close()


async def test_a_connect_that_times_out_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """TimeoutError is an OSError: caught as one, the reason read 'TimeoutError: ' and nothing
    more (what an operator saw for a hop whose host drops packets: 'hop unreachable: TimeoutError: ')."""
    loop = asyncio.get_running_loop()

    async def silent(*_args: object, **_kwargs: object) -> None:
        await asyncio.sleep(30)  # SYNs dropped: no answer, no refusal

    monkeypatch.setattr(loop, "create_connection", silent)
    conn = H1Connection("http://127.0.0.1:9", connect_timeout=0.05)
    with pytest.raises(FrameTransportError, match=r"^connect timed out after 0.05s$"):
        await conn.request("GET", "/", {})


class HeldAcks:
    """A raw hop that reads every request as it comes and answers in order, holding the acks
    of frames from `hold_from` on until `release` is set: what a hop a round trip away looks
    like to a sender while its answers are on their way. Frame `refuse` gets a 409 (or a 408:
    the hop gave up waiting for its body, with `timed_out`)."""

    def __init__(self, hold_from: int, window: int, refuse: int = -1, timed_out: bool = False) -> None:
        self.hold_from, self.window, self.refuse, self.timed_out = hold_from, window, refuse, timed_out
        self.seqs: list[int] = []
        self.release = asyncio.Event()
        self.server: asyncio.Server | None = None

    def _answer(self, seq: int) -> bytes:
        if seq == self.refuse and self.timed_out:
            body = FrameError(code="bad_frame", message="request body stalled").model_dump_json().encode()
            return b"HTTP/1.1 408 Request Timeout\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body)
        if seq == self.refuse:
            body = FrameError(code="seq_mismatch", message="refused").model_dump_json().encode()
            return b"HTTP/1.1 409 Conflict\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body)
        done = seq + 1 if self.release.is_set() else 0
        body = FrameAck(seq=seq, credit=done + self.window, done=done).model_dump_json().encode()
        return b"HTTP/1.1 202 Accepted\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body)

    async def __aenter__(self) -> str:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            answers: asyncio.Queue[int] = asyncio.Queue()

            async def answer() -> None:
                while True:
                    seq = await answers.get()
                    if seq >= self.hold_from:
                        await self.release.wait()
                    writer.write(self._answer(seq))

            answering = asyncio.create_task(answer())
            try:
                while True:
                    head = await reader.readuntil(b"\r\n\r\n")
                    fields = dict(line.split(b": ", 1) for line in head.split(b"\r\n")[1:-2])
                    await reader.readexactly(int(fields[b"Content-Length"]))
                    seq = FrameHeader.from_header(fields[FRAME_HEADER.encode()].decode()).seq
                    self.seqs.append(seq)
                    answers.put_nowait(seq)
            except (asyncio.IncompleteReadError, ConnectionError):
                writer.close()
            finally:
                answering.cancel()

        self.server = await asyncio.start_server(handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()


async def test_posted_frames_go_out_up_to_the_credit_before_their_acks_come() -> None:
    """A prompt's chunks do not wait a round trip each: frames 1-3 reach the hop while their
    acks are held, frame 4 (past the credit) waits for them, and every ack runs its callback."""
    acked: list[int] = []
    hop = HeldAcks(hold_from=1, window=4)
    async with hop as url:
        lk = link(url)
        for seq in range(4):  # the first ack (credit 4) is read when frame 1 finds no credit
            await lk.post(seq, frame(seq)[0].to_header(), frame(seq)[1], lambda s=seq: acked.append(s))
        blocked = asyncio.create_task(lk.post(4, frame(4)[0].to_header(), frame(4)[1]))
        for _ in range(500):
            if len(hop.seqs) == 4:
                break
            await asyncio.sleep(0.01)
        assert hop.seqs == [0, 1, 2, 3], "frames 1-3 went out back to back, their acks held"
        assert not blocked.done() and acked == [0] and lk.conn.connects == 1
        hop.release.set()
        await asyncio.wait_for(blocked, WAIT_S)
        await asyncio.wait_for(lk.drain(), WAIT_S)
        assert acked == [0, 1, 2, 3] and hop.seqs == [0, 1, 2, 3, 4] and lk.credit >= 5
        lk.close()


async def test_a_new_sessions_first_frames_go_out_up_to_the_hops_announced_window() -> None:
    """A hop that announced a window of 4 admits frames 0-3 of a new session before any ack:
    they go out back to back, not one round trip after frame 0 (Hop.window). Before, a sender
    knew only frame 0's credit until the first ack came."""
    hop = HeldAcks(hold_from=0, window=4)
    async with hop as url:
        lk = FrameLink(url, hop_index=1, node_id="n1", session_id="s", route_id="r", epoch=1, window=4)

        async def post_all() -> None:
            for seq in range(5):  # frame 4 waits for credit: the acks are held
                await lk.post(seq, frame(seq)[0].to_header(), frame(seq)[1])

        posting = asyncio.create_task(post_all())
        for _ in range(300):
            if len(hop.seqs) == 4:
                break
            await asyncio.sleep(0.01)
        assert hop.seqs == [0, 1, 2, 3] and not posting.done(), "frames 0-3 went out, every ack held"
        hop.release.set()
        await asyncio.wait_for(posting, WAIT_S)
        await asyncio.wait_for(lk.drain(), WAIT_S)
        assert hop.seqs == [0, 1, 2, 3, 4]
        lk.close()


async def test_a_refused_posted_frame_raises_from_the_next_call() -> None:
    async with HeldAcks(hold_from=99, window=8, refuse=1) as url:
        lk = link(url)
        for seq in (0, 1):
            await lk.post(seq, frame(seq)[0].to_header(), frame(seq)[1])
        with pytest.raises(FrameRejectedError) as info:
            await asyncio.wait_for(lk.drain(), WAIT_S)
        assert info.value.status == 409 and info.value.error.code == "seq_mismatch"
        # the answers after a refusal are unknown: the connection went with it, the next frame opens another
        await lk.post(2, frame(2)[0].to_header(), frame(2)[1])
        await asyncio.wait_for(lk.drain(), WAIT_S)
        assert lk.conn.connects == 2
        lk.close()


async def test_a_posted_frame_the_hop_timed_out_is_a_lost_hop() -> None:
    """A 408 to a posted chunk means the link lost bytes that were sent (the hop gave up waiting
    for them): the route restarts (HopUnreachableError), as for a frame that awaited its ack,
    instead of failing as a refused frame."""
    async with HeldAcks(hold_from=99, window=8, refuse=1, timed_out=True) as url:
        lk = link(url)
        for seq in (0, 1):
            await lk.post(seq, frame(seq)[0].to_header(), frame(seq)[1])
        with pytest.raises(HopUnreachableError, match="HTTP 408"):
            await asyncio.wait_for(lk.drain(), WAIT_S)
        lk.close()
