"""A restart replayed by one batched prefill, exact: every node runs `--kv-profile exact`
(flash attention on, a q8_0 K cache), so the gateway's `--restart-replay auto` (the default)
rebuilds the lost route's generated tokens as one prefill, not one model call per token, and
the client's greedy answer still equals single-process llama.cpp loaded the same way
(flash_attn=True, type_k=q8_0), token for token.

A real mesh as in tests/test_restart.py: nats-server, tracker, gateway and four node
processes (two replicas of each half of the bundled model); a hop is SIGKILLed mid-decode.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio

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

NODES = {"rx-head-a": "0:15", "rx-head-b": "0:15", "rx-tail-a": "15:30", "rx-tail-b": "15:30"}
EXACT = ["--kv-profile", "exact"]


@pytest.fixture(scope="module")
def reference(model_path: Path) -> Reference:
    return load_reference(model_path)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def mesh(model_path: Path, tmp_path_factory: pytest.TempPathFactory,
               reference: Reference) -> AsyncIterator[Mesh]:
    async with restart_mesh(model_path, tmp_path_factory.mktemp("restart-exact-mesh"), NODES, EXACT) as m:
        yield m


async def replays(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """The gateway's restart replay counters, by how ("batched", "stepwise")."""
    return await gateway_counter(http, url, "meshnet_gateway_restart_replays_total")


async def test_every_node_states_the_exact_profile(mesh: Mesh) -> None:
    caps = {s.node_id: s.capability for s in mesh.tracker.registry}
    assert set(caps) == set(NODES)
    assert {c.kv_profile for c in caps.values()} == {"exact"}


@pytest.mark.parametrize("hop", [0, 1])
async def test_a_restart_replayed_by_batched_prefill_continues_the_greedy_answer_exactly(
        mesh: Mesh, reference: Reference, hop: int) -> None:
    _, uninterrupted, text = reference.greedy(STORY, MAX_TOKENS)
    sid = f"restart-exact-{hop}"
    async with aiohttp.ClientSession() as http:
        before = await replays(http, mesh.url)
        out, victim = await kill_mid_stream(mesh, http, hop, sid, {"temperature": 0}, after_tokens=24)
        assert out["error"] is None, out
        events = await session_events(http, mesh.url, sid)
        restarting = [e for e in events if e["phase"] == "restarting"]
        assert restarting and restarting[0]["lost_node_id"] == victim, [e["phase"] for e in events]
        assert restarting[0]["generated_tokens"] >= 24  # the replay had generated tokens to rebuild
        after = await replays(http, mesh.url)
        assert after.get("batched", 0) == before.get("batched", 0) + 1, (before, after)
        assert after.get("stepwise", 0) == before.get("stepwise", 0), (before, after)
        assert out["text"] == text, (out["text"], text)
        print(f"hop {hop} lost after {restarting[0]['generated_tokens']} tokens: replayed in one batch, "
              f"the answer equals the exact-profile reference ({len(uninterrupted)} tokens)")
        mesh.start_node(victim, NODES[victim], *EXACT)
        async with asyncio.timeout(300):
            await wait_routable(mesh, set(NODES), http)
