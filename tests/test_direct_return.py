"""Direct return: on a route of 3 hops a Decode Run's tokens come from the tail straight to the
head over the tail's Return Stream, not back through the middle hop.

Real node processes, each behind a delaying relay (RTT 20 ms between parts, tests/fixtures/wan.py),
and the real model: 8 sessions decoding at once give llama.cpp's greedy tokens, every token of
their runs went over the tail's Return Stream, and the Return Stream is open only to the holder
of the tail's credential; a far middle or tail killed mid-run gives the structured failure
naming it, and the survivors free the session.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest

from gateway.route_client import RouteClient
from schemas.credentials import CREDENTIAL_HEADER
from schemas.frames import LANE_RETURN, ReturnRequest, RouteFailedError, lane_open
from tests.fixtures.mesh import Mesh, NodeProc
from tests.fixtures.wan import FarMesh
from tests.test_route_exact import PROMPT, reference_greedy
from tests.test_route_failure import SURVIVOR_ARGS, assert_freed, prompt
from tests.test_seam_link import Raw, lane_event, link_request

N_GENERATE = 12
DELAY_S = 0.010  # one way: RTT 20 ms between any two parts
LAYERS = [(0, 9), (9, 20), (20, 30)]
SESSIONS = 8


def prompts(model_path: Path) -> list[list[int]]:
    from llama_cpp import Llama

    tok = Llama(model_path=str(model_path), vocab_only=True, verbose=False)
    return [tok.tokenize(f"{PROMPT} ({i + 1})".encode(), add_bos=False, special=True) for i in range(SESSIONS)]


async def one_session(mesh: Mesh, nodes: list[NodeProc], prompt: list[int]) -> tuple[list[int], str]:
    session = await mesh.route(nodes, prompt_tokens=len(prompt))
    async with RouteClient(session, mesh.http, bus=mesh.bus) as rc:
        first = await rc.prefill(prompt)
        run = [r async for r in rc.decode_run(first.token_id, N_GENERATE - 1)]
    # the middle hop's timing came forward with the rows: every token names every hop
    for r in run:
        assert [t.node_id for t in r.timings] == [n.node_id for n in nodes], r.timings
        assert all(t.compute_ms > 0 for t in r.timings), r.timings
    return [first.token_id] + [r.token_id for r in run], session.session_id


async def test_eight_sessions_over_three_far_hops_give_llama_cpp_tokens_straight_from_the_tail(
        far_mesh: FarMesh, model_path: Path) -> None:
    ps = await asyncio.to_thread(prompts, model_path)
    expected = await asyncio.to_thread(lambda: [reference_greedy(model_path, p, N_GENERATE) for p in ps])
    nodes = [await far_mesh.spawn(r, delay_s=DELAY_S) for r in LAYERS]
    mesh = far_mesh.mesh
    results = await asyncio.gather(*(one_session(mesh, nodes, p) for p in ps))
    assert [tokens for tokens, _ in results] == expected
    for _, sid in results:
        tail = await mesh.session_stats(nodes[2], sid)
        middle = await mesh.session_stats(nodes[1], sid)
        # the run's tokens (all but the prefill's) left the tail on its Return Stream
        assert tail["returned_tokens"] == N_GENERATE - 1, tail
        assert middle["returned_tokens"] == 0 and middle["decode_tokens"] == N_GENERATE - 1, middle
    for node in nodes:  # nothing held once the sessions closed
        listing = await mesh.sessions(node)
        assert listing["engine_sessions"] == 0 and listing["cache_bytes"] == 0, listing


async def test_a_return_stream_is_the_tails_and_needs_the_tails_credential(far_mesh: FarMesh) -> None:
    nodes = [await far_mesh.spawn(r, delay_s=0.0) for r in LAYERS]
    mesh = far_mesh.mesh
    session = await mesh.route(nodes, prompt_tokens=8)
    assert session.hops[0].sealed_return and not any(h.sealed_return for h in session.hops[1:])
    creds = session.credentials
    async with RouteClient(session, mesh.http, bus=mesh.bus) as rc:
        await rc.prefill(list(range(300, 308)))

        def request(route_id: str = session.route_id) -> str:
            return ReturnRequest(session_id=session.session_id, route_id=route_id, epoch=session.epoch).model_dump_json()

        async def refusal(node: NodeProc, credential: str, req: str) -> str:
            conn = await Raw.open(node.url)
            try:
                conn.writer.write(link_request(lane_open(1, req, credential, b"", LANE_RETURN)))
                assert (await conn.head())[0] == 200
                lane, last, event = await lane_event(conn)
                assert (lane, last) == (1, True)
                return event["error"]["code"]
            finally:
                conn.close()

        for cred in ("", creds[0], creds[1]):  # none, the head's, the middle's
            assert await refusal(nodes[2], cred, request()) == "bad_credential"
        assert await refusal(nodes[2], creds[2], request("other")) == "route_mismatch"
        assert await refusal(nodes[1], creds[1], request()) == "bad_frame"  # not the tail
        assert await refusal(nodes[2], creds[2], "{}") == "bad_frame"
        # no Return Stream outside a Seam Link any more
        async with aiohttp.ClientSession() as http, http.get(
                f"{nodes[2].url}/v1/sessions/{session.session_id}/returns", headers={CREDENTIAL_HEADER: creds[2]}) as resp:
            assert resp.status == 404
        # the session is untouched: the head's run still gets its tokens from the tail
        tokens = [r.token_id async for r in rc.decode_run(5, 4)]
        assert len(tokens) == 4
        assert (await mesh.session_stats(nodes[2], session.session_id))["returned_tokens"] == 4


@pytest.mark.parametrize("victim", [1, 2])  # the middle (its lane breaks), the tail (its Return Stream)
async def test_a_far_hop_killed_mid_run_gives_the_structured_failure_and_the_survivors_free(
        far_mesh: FarMesh, victim: int) -> None:
    nodes = [await far_mesh.spawn(r, delay_s=DELAY_S, args=SURVIVOR_ARGS) for r in LAYERS]
    mesh = far_mesh.mesh
    session = await mesh.route(nodes, prompt_tokens=40)
    got = 0
    with pytest.raises(RouteFailedError) as info:
        async with RouteClient(session, mesh.http, bus=mesh.bus) as rc:
            tok = (await rc.prefill(prompt(40))).token_id
            async for _ in rc.decode_run(tok, 3000):
                got += 1
                if got == 5:
                    nodes[victim].kill()
    f = info.value.failure
    assert (f.phase, f.hop_index, f.node_id, f.code) == ("decode", victim, nodes[victim].node_id, "hop_lost"), f
    await assert_freed(mesh, [n for i, n in enumerate(nodes) if i != victim], parked_ok=True)
