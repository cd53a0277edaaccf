"""Kept Hops: a restart continues on the hops of the lost route that still serve.

A real mesh as in tests/test_restart.py (nats-server, tracker, gateway and four node
processes, two replicas of each half of the bundled model, the default KV profile). A hop is
SIGKILLed mid-decode. The new route keeps the surviving node: its Hot KV State already holds
the history, so it computes only the last token again. The lost range starts empty on the
other replica and prefills the whole history, from tokens (a new head) or from the kept
head's Seam Log (a new tail). The answer still equals single-process llama.cpp's
uninterrupted greedy answer, and each node's session on the new route counts only the rows
it computed.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from tests.fixtures.mesh import OPERATOR
from tests.test_gateway_e2e import Mesh, Reference, load_reference, wait_routable
from tests.test_restart import (
    MAX_TOKENS,
    STORY,
    gateway_counter,
    kill_mid_stream,
    restart_mesh,
    session_events,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")

NODES = {"rk-head-a": "0:15", "rk-head-b": "0:15", "rk-tail-a": "15:30", "rk-tail-b": "15:30"}


@pytest.fixture(scope="module")
def reference(model_path: Path) -> Reference:
    return load_reference(model_path)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def mesh(model_path: Path, tmp_path_factory: pytest.TempPathFactory,
               reference: Reference) -> AsyncIterator[Mesh]:
    async with restart_mesh(model_path, tmp_path_factory.mktemp("restart-keep-mesh"), NODES) as m:
        yield m


def node_url(mesh: Mesh, node_id: str) -> str:
    return next(s.announcement.activation_url for s in mesh.tracker.registry if s.node_id == node_id)


async def hop_session(http: aiohttp.ClientSession, mesh: Mesh, node_id: str, sid: str) -> dict[str, Any]:
    """GET /v1/sessions/<sid> on a node: its counters on that route."""
    async with http.get(f"{node_url(mesh, node_id)}/v1/sessions/{sid}", headers=OPERATOR) as resp:
        assert resp.status == 200, (node_id, sid, await resp.text())
        return await resp.json()


async def kept_hops_metric(http: aiohttp.ClientSession, url: str) -> float:
    return sum((await gateway_counter(http, url, "meshnet_gateway_restart_kept_hops_total")).values())


@pytest.mark.parametrize("hop", [0, 1])
async def test_a_restart_keeps_the_surviving_hop_and_prefills_only_the_lost_range(
        mesh: Mesh, reference: Reference, hop: int) -> None:
    prompt, uninterrupted, text = reference.greedy(STORY, MAX_TOKENS)
    sid = f"restart-keep-{hop}"
    async with aiohttp.ClientSession() as http:
        kept_before = await kept_hops_metric(http, mesh.url)
        out, victim = await kill_mid_stream(mesh, http, hop, sid, {"temperature": 0}, after_tokens=24)
        assert out["error"] is None, out
        assert out["text"] == text, (out["text"], text)
        events = await session_events(http, mesh.url, sid)
        restarting = [e for e in events if e["phase"] == "restarting"]
        assert restarting and restarting[0]["lost_node_id"] == victim
        final = events[-1]
        assert final["phase"] == "completed", final
        route = final["route_nodes"]
        survivor = route[1 - hop]
        assert victim not in route
        assert final["kept_nodes"] == [survivor], final  # the hop that was not lost
        assert await kept_hops_metric(http, mesh.url) == kept_before + 1
        new_sid = f"{sid}-e2"
        kept = await hop_session(http, mesh, survivor, new_sid)
        fresh = await hop_session(http, mesh, route[hop], new_sid)
        history = final["prefill_tokens_total"]  # the prompt and the tokens generated before the loss
        assert kept["prefill_tokens"] == 1, kept  # only the history's last token ran again
        # the new hop rebuilt the whole history: computed, or shared with a session of the same
        # prompt it holds (nodes/shared_prefix.py; the prompt part only, never replayed rows)
        assert fresh["prefill_tokens"] + fresh["shared_prefix_tokens"] == history, (fresh, history)
        assert fresh["prefill_tokens"] >= history - len(prompt), fresh
        print(f"hop {hop} lost after {restarting[0]['generated_tokens']} tokens: {survivor} kept the "
              f"history and computed 1 row, {route[hop]} prefilled {history}; the answer equals "
              f"llama.cpp's ({len(uninterrupted)} tokens)")
        mesh.start_node(victim, NODES[victim])
        async with asyncio.timeout(300):
            await wait_routable(mesh, set(NODES), http)


async def test_a_seeded_sampled_answer_continues_exactly_on_a_kept_tail(mesh: Mesh) -> None:
    from tests.test_concurrent_serving import stream_chat

    sampled = {"temperature": 0.9, "top_p": 0.95, "seed": 77}
    async with aiohttp.ClientSession() as http:
        whole = await stream_chat(http, mesh.url, STORY, MAX_TOKENS, extra=sampled)
        assert whole["error"] is None, whole
        out, victim = await kill_mid_stream(mesh, http, 0, "restart-keep-seeded", sampled, after_tokens=20)
        assert out["error"] is None, out
        final = (await session_events(http, mesh.url, "restart-keep-seeded"))[-1]
        assert final["kept_nodes"], final  # the tail continued its sampler's session
        assert out["text"] == whole["text"]
        mesh.start_node(victim, NODES[victim])
        async with asyncio.timeout(300):
            await wait_routable(mesh, set(NODES), http)


@pytest.mark.parametrize("hop", [0, 1])
async def test_penalties_continue_from_the_tokens_generated_before_a_restart(mesh: Mesh, hop: int) -> None:
    """A restart's tail starts its penalties from what the session generated before the loss
    (SamplingParams.generated): a fresh tail (hop 1 lost) and a kept one (hop 0 lost) alike."""
    from tests.test_concurrent_serving import stream_chat

    penalized = {"temperature": 0, "presence_penalty": 1.0, "frequency_penalty": 1.0}
    sid = f"restart-keep-penalty-{hop}"
    async with aiohttp.ClientSession() as http:
        whole = await stream_chat(http, mesh.url, STORY, MAX_TOKENS, extra=penalized)
        plain = await stream_chat(http, mesh.url, STORY, MAX_TOKENS, extra={"temperature": 0})
        assert whole["error"] is None and whole["text"] != plain["text"]
        out, victim = await kill_mid_stream(mesh, http, hop, sid, penalized, after_tokens=20)
        assert out["error"] is None, out
        assert [e for e in await session_events(http, mesh.url, sid) if e["phase"] == "restarting"]
        assert out["text"] == whole["text"]
        mesh.start_node(victim, NODES[victim])
        async with asyncio.timeout(300):
            await wait_routable(mesh, set(NODES), http)


async def test_nothing_is_left_held_once_the_mesh_is_idle(mesh: Mesh) -> None:
    """Parked state a restart did not take (the lost route's other hops) is freed within the
    keep window; sessions that finished hold nothing."""
    async with aiohttp.ClientSession() as http:
        async with asyncio.timeout(60):
            while True:
                held = 0
                for node_id in NODES:
                    async with http.get(f"{node_url(mesh, node_id)}/v1/sessions") as resp:
                        body = await resp.json()
                    held += body["cache_bytes"] + body["parked_sessions"]  # the engine's, parked included
                if held == 0:
                    break
                await asyncio.sleep(0.5)
