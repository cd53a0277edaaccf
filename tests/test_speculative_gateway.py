"""Speculative decoding through the gateway, over 3 far hops (every node behind a relay at RTT
20 ms, `--kv-profile exact`): a copy-heavy chat gives llama.cpp's greedy answer (loaded with the
same profile) with most tokens drafted, and the same answer with `"speculative": false`; the
usage, the session's telemetry and /metrics say what speculation did; a middle hop killed while
the head drafts gives the usual restart with the same answer."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio

from schemas.frames import MAX_DRAFT
from tests.test_concurrent_serving import stream_chat
from tests.test_gateway_e2e import Mesh, Reference, far_running_mesh, load_reference
from tests.test_restart import route_nodes, session_events

pytestmark = pytest.mark.asyncio(loop_scope="module")

DELAY_S = 0.010  # one way: RTT 20 ms to and between the nodes
NODES = {"sp-head": "0:10", "sp-mid-a": "10:20", "sp-mid-b": "10:20", "sp-tail": "20:30"}
TEXT = ("The lighthouse keeper climbed the stairs every evening at dusk, lit the great lamp, and watched "
        "the ships pass safely through the narrow channel. In the morning he wrote the names of the ships "
        "in a thick book, put out the lamp, and slept until noon.")
COPY = [{"role": "user", "content": f"Copy this text exactly: {TEXT}"}]
MAX_TOKENS = 80


@pytest.fixture(scope="module")
def reference(model_path: Path) -> Reference:
    return load_reference(model_path)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def mesh(model_path: Path, tmp_path_factory: pytest.TempPathFactory,
               reference: Reference) -> AsyncIterator[Mesh]:
    reference.greedy(COPY, MAX_TOKENS)  # before the mesh starts: it never competes with the nodes
    async with far_running_mesh(model_path, tmp_path_factory.mktemp("spec"), NODES, DELAY_S,
                                ("--kv-profile", "exact"), node_timeout=3.0, keepalive=1.0,
                                session_wait=600.0) as m:
        yield m


async def test_a_copy_is_drafted_and_gives_the_greedy_answer_with_and_without_speculation(
        mesh: Mesh, reference: Reference) -> None:
    _, ids, text = reference.greedy(COPY, MAX_TOKENS)
    async with aiohttp.ClientSession() as http:
        spec = await stream_chat(http, mesh.url, COPY, MAX_TOKENS, sid="spec-on")
        plain = await stream_chat(http, mesh.url, COPY, MAX_TOKENS, sid="spec-off", extra={"speculative": False})
        assert spec["error"] is None and plain["error"] is None, (spec, plain)
        assert spec["text"] == text and plain["text"] == text
        drafted = spec["usage"]["speculation"]
        assert drafted["accepted_tokens"] >= len(ids) // 2, drafted  # the copy mostly came in drafts
        assert "speculation" not in plain["usage"]
        final = (await session_events(http, mesh.url, "spec-on"))[-1]
        assert final["spec_trips"] > 0 and final["spec_accepted_per_trip"] > 2, final
        # the drafts the last verify step carried: the head's choice, at most the most a step may carry
        assert 1 <= final["spec_draft_length"] <= MAX_DRAFT, final
        assert 0 <= final["spec_pipelined_trips"] <= final["spec_trips"], final
        # telemetry counts a verify step whole; usage only the kept drafts the answer has
        assert final["spec_acceptance"] >= round(drafted["accepted_tokens"] / drafted["drafted_tokens"], 3)
        assert (await session_events(http, mesh.url, "spec-off"))[-1]["spec_trips"] == 0
        # the header does the same, for clients that cannot add a body field
        off = await stream_chat(http, mesh.url, COPY, MAX_TOKENS, headers={"x-meshnet-speculative": "off"})
        assert off["error"] is None and off["text"] == text and "speculation" not in off["usage"], off
        async with http.get(f"{mesh.url}/metrics") as resp:
            metrics = await resp.text()
        assert "meshnet_gateway_speculative_tokens_per_trip_count" in metrics


async def test_speculative_must_be_a_boolean(mesh: Mesh) -> None:
    async with aiohttp.ClientSession() as http:
        body = {"model": "smollm2", "messages": COPY, "max_tokens": 4, "speculative": "no"}
        async with http.post(f"{mesh.url}/v1/chat/completions", json=body) as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["param"] == "speculative"
        body["speculative"] = None  # null: the default
        async with http.post(f"{mesh.url}/v1/chat/completions", json=body,
                             headers={"x-meshnet-speculative": "maybe"}) as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["param"] == "x-meshnet-speculative"


async def test_a_middle_hop_killed_while_the_head_drafts_restarts_with_the_same_answer(
        mesh: Mesh, reference: Reference) -> None:
    _, _, text = reference.greedy(COPY, MAX_TOKENS)
    arrivals: list[float] = []
    async with aiohttp.ClientSession() as http:
        task = asyncio.ensure_future(stream_chat(http, mesh.url, COPY, MAX_TOKENS, arrivals, sid="spec-kill"))
        victim = (await route_nodes(http, mesh.url, "spec-kill"))[1]
        async with asyncio.timeout(120):
            while len(arrivals) < 10:
                assert not task.done(), task.result()
                await asyncio.sleep(0.002)
        mesh.kill_node(victim)
        async with asyncio.timeout(300):
            out = await task
        assert out["error"] is None, out
        assert out["text"] == text
        events = await session_events(http, mesh.url, "spec-kill")
        assert any(e["phase"] == "restarting" and e["lost_node_id"] == victim for e in events)
        assert events[-1]["phase"] == "completed"
