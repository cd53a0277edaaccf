"""Decode Runs on real node processes: the head feeds each token back by itself and streams it.

Exactness against the single-process model is in test_route_exact.py; failures (a hop killed
mid-run) in test_route_failure.py. Here: stop ids, leaving a run early, what is refused while
a run is in progress, and the same run over a connection the node's aiohttp app serves."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import orjson
import pytest

from gateway.route_client import LinkPhase, RouteClient
from schemas.credentials import CREDENTIAL_HEADER
from schemas.frames import (
    FRAME_HEADER,
    FrameHeader,
    FrameRejectedError,
    RouteFailedError,
    encode_rows,
)
from tests.fixtures.mesh import Mesh
from wire.link import FrameLink

TEXT = ("<|im_start|>user\nWrite a short story about a lighthouse keeper and a storm."
        "<|im_end|>\n<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def prompt_ids(model_path: Path) -> list[int]:
    from llama_cpp import Llama

    vocab = Llama(model_path=str(model_path), vocab_only=True, verbose=False)
    return vocab.tokenize(TEXT.encode(), add_bos=False, special=True)


async def stepwise(mesh: Mesh, nodes, prompt_ids: list[int], n: int) -> list[int]:
    """The tokens one frame per step gives (the caller feeds every token)."""
    session = await mesh.route(nodes)
    async with RouteClient(session, mesh.http, bus=mesh.bus) as rc:
        tokens = [(await rc.prefill(prompt_ids)).token_id]
        while len(tokens) < n:
            tokens.append((await rc.decode(tokens[-1])).token_id)
    return tokens


async def test_a_run_gives_the_stepwise_tokens_stops_on_a_stop_id_and_the_session_goes_on(mesh: Mesh, prompt_ids: list[int]) -> None:
    head, tail = await mesh.spawn((0, 15)), await mesh.spawn((15, 30))
    reference = await stepwise(mesh, [head, tail], prompt_ids, 24)
    session = await mesh.route([head, tail])
    async with RouteClient(session, mesh.http, bus=mesh.bus) as rc:
        first = (await rc.prefill(prompt_ids)).token_id
        run = [r async for r in rc.decode_run(first, 12)]
        assert [first] + [r.token_id for r in run] == reference[:13]
        assert [r.position for r in run] == list(range(len(prompt_ids) + 1, len(prompt_ids) + 13))
        assert [t.node_id for t in run[-1].timings] == [head.node_id, tail.node_id]
        # stop on the first token after index 16 that has not come before
        stop_at = next(i for i in range(17, 24) if reference[i] not in reference[13:i])
        stopped = [r.token_id async for r in rc.decode_run(reference[12], 50, stop_ids=[reference[stop_at]])]
        assert stopped == reference[13:stop_at + 1]
        stats = await mesh.session_stats(head, session.session_id)
        assert stats["running"] is False and stats["done"] == stats["seq"] == rc.seq
        assert stats["position"] == rc.position
        # the session goes on with a run of one step where the run stopped
        assert (await rc.decode(reference[stop_at])).token_id == reference[stop_at + 1]
    for node in (head, tail):
        listing = await mesh.sessions(node)
        assert listing["engine_sessions"] == 0 and listing["cache_bytes"] == 0


async def test_a_batched_run_holds_tokens_and_gives_the_same_tokens(mesh: Mesh, prompt_ids: list[int]) -> None:
    head, tail = await mesh.spawn((0, 15)), await mesh.spawn((15, 30))
    reference = await stepwise(mesh, [head, tail], prompt_ids, 20)
    session = await mesh.route([head, tail])
    async with RouteClient(session, mesh.http, bus=mesh.bus) as rc:
        first = (await rc.prefill(prompt_ids)).token_id
        got, arrived_together = [], 0
        async for r in rc.decode_run(first, 19, flush_ms=1000):
            got.append(r.token_id)
            arrived_together += rc.results_ready  # the next token (or the end) came in the same write
        assert [first, *got] == reference
        assert arrived_together >= 10  # the first token at once, the rest held and sent together
        assert not rc.results_ready and rc.phase is LinkPhase.PREFILLED
        assert (await rc.decode(reference[-1])).token_id is not None  # the session goes on
    for node in (head, tail):
        listing = await mesh.sessions(node)
        assert listing["engine_sessions"] == 0 and listing["cache_bytes"] == 0


async def test_frames_during_a_run_are_refused_and_leaving_a_run_stops_the_head(mesh: Mesh, prompt_ids: list[int]) -> None:
    head = await mesh.spawn((0, 15))
    tail = await mesh.spawn((15, 30), env={"MESHNET_TEST_DELAY_MS": "30"})
    session = await mesh.route([head, tail])
    async with RouteClient(session, mesh.http, bus=mesh.bus) as rc:
        first = (await rc.prefill(prompt_ids)).token_id
        # a run must go to the head, and fit the context
        tail_link = FrameLink(tail.url, hop_index=1, node_id=tail.node_id, session_id=session.session_id,
                              route_id=session.route_id, epoch=session.epoch, credential=session.credentials[1])
        run_to_tail = FrameHeader(session_id=session.session_id, route_id=session.route_id, epoch=session.epoch,
                                  hop=1, seq=rc.seq, phase="decode", position=rc.position, n_rows=1,
                                  dtype="f32", width=576, final=True, steps=4)
        with pytest.raises(FrameRejectedError) as info:
            await tail_link.send(run_to_tail, encode_rows(np.zeros((1, 576), np.float32), "f32"))
        assert info.value.error.code == "bad_frame"
        tail_link.close()
        with pytest.raises(RouteFailedError, match="context size"):
            [r async for r in rc.decode_run(first, 100_000)]
    # the refused run failed that client: a new session for the rest
    session = await mesh.route([head, tail])
    async with RouteClient(session, mesh.http, bus=mesh.bus) as rc:
        first = (await rc.prefill(prompt_ids)).token_id
        other = FrameLink(head.url, hop_index=0, node_id=head.node_id, session_id=session.session_id,
                          route_id=session.route_id, epoch=session.epoch, credential=session.credentials[0])
        got = 0
        async for _ in rc.decode_run(first, 200):
            got += 1
            if got == 3:  # a second caller's frame while the run goes on: a clear 409
                frame = FrameHeader(session_id=session.session_id, route_id=session.route_id,
                                    epoch=session.epoch, hop=0, seq=rc.seq, phase="decode",
                                    position=rc.position, n_rows=1, dtype="i32", width=1, final=True)
                with pytest.raises(FrameRejectedError) as info:
                    await other.send(frame, encode_rows(np.array([first], np.int32), "i32"))
                assert info.value.status == 409 and info.value.error.code == "session_busy"
            if got == 5:
                break  # leave the run: the head stops after the step in flight
        other.close()
        with pytest.raises(RuntimeError, match="left before its end"):
            await rc.decode(first)
        done = None
        for _ in range(50):
            stats = await mesh.session_stats(head, session.session_id)
            if not stats["running"] and stats["done"] == done:
                break
            done = stats["done"]
            await asyncio.sleep(0.1)
        assert not stats["running"] and stats["done"] <= rc.seq + 2  # not 200 steps on
    for node in (head, tail):
        listing = await mesh.sessions(node)
        assert listing["engine_sessions"] == 0 and listing["cache_bytes"] == 0


async def test_a_frame_on_a_connection_the_app_serves_is_refused_and_the_session_goes_on(
        mesh: Mesh, prompt_ids: list[int]) -> None:
    """One frame server: a connection that began with a request for the node's app (here
    /healthz) carries no frames; the refusal is typed and the session is untouched."""
    head, tail = await mesh.spawn((0, 15)), await mesh.spawn((15, 30))
    reference = await stepwise(mesh, [head, tail], prompt_ids, 6)
    session = await mesh.route([head, tail])
    async with RouteClient(session, mesh.http, bus=mesh.bus) as rc:
        first = await rc.prefill(prompt_ids)
        host, port = head.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")  # the connection moves to aiohttp
            head_end = await reader.readuntil(b"\r\n\r\n")
            length = int(next(line.split(b":")[1] for line in head_end.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            await reader.readexactly(length)
            h = FrameHeader(session_id=session.session_id, route_id=session.route_id, epoch=session.epoch,
                            hop=0, seq=rc.seq, phase="decode", position=rc.position, n_rows=1,
                            dtype="i32", width=1, final=True, steps=5)
            body = encode_rows(np.array([reference[0]], np.int32), "i32")
            writer.write(f"POST /v1/frames HTTP/1.1\r\nHost: x\r\n{FRAME_HEADER}: {h.to_header()}\r\n"
                         f"{CREDENTIAL_HEADER}: {session.credentials[0]}\r\n"
                         f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            answer = await reader.readuntil(b"\r\n\r\n")
            assert answer.lower().startswith(b"http/1.1 400"), answer
            length = int(next(line.split(b":")[1] for line in answer.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            err = orjson.loads(await reader.readexactly(length))
            assert err["code"] == "bad_frame" and "connection of their own" in err["message"], err
        finally:
            writer.close()
        # the frame never reached the session: a run on the frame plane takes the same step
        tokens = [r.token_id async for r in rc.decode_run(first.token_id, 5)]
        assert [first.token_id, *tokens] == reference[:6]
