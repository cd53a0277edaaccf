"""A chat through the gateway over 3 far hops (every node behind a relay at RTT 20 ms, each
advertising the relay, so a Decode Run's tokens take direct return): a middle hop killed
mid-stream restarts the answer on its replica, and the answer equals llama.cpp's uninterrupted
greedy one, as on loopback (tests/test_restart.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio

from tests.test_gateway_e2e import Mesh, Reference, far_running_mesh, load_reference
from tests.test_restart import MAX_TOKENS, STORY, kill_mid_stream, session_events

pytestmark = pytest.mark.asyncio(loop_scope="module")

DELAY_S = 0.010  # one way: RTT 20 ms to and between the nodes
NODES = {"wr-head": "0:10", "wr-mid-a": "10:20", "wr-mid-b": "10:20", "wr-tail": "20:30"}


@pytest.fixture(scope="module")
def reference(model_path: Path) -> Reference:
    return load_reference(model_path)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def mesh(model_path: Path, tmp_path_factory: pytest.TempPathFactory,
               reference: Reference) -> AsyncIterator[Mesh]:
    async with far_running_mesh(model_path, tmp_path_factory.mktemp("wan-restart"), NODES, DELAY_S,
                                node_timeout=3.0, keepalive=1.0, session_wait=600.0) as m:
        yield m


async def test_a_far_middle_killed_mid_stream_restarts_the_greedy_answer_exactly(
        mesh: Mesh, reference: Reference) -> None:
    _, _, text = await asyncio.to_thread(reference.greedy, STORY, MAX_TOKENS)
    async with aiohttp.ClientSession() as http:
        out, victim = await kill_mid_stream(mesh, http, 1, "wan-restart", {"temperature": 0})
        assert out["error"] is None, out
        assert out["text"] == text  # nothing repeated, nothing missing
        events = await session_events(http, mesh.url, "wan-restart")
        restarting = [e for e in events if e["phase"] == "restarting"]
        assert restarting and restarting[0]["lost_node_id"] == victim, [e["phase"] for e in events]
        final = events[-1]
        assert final["phase"] == "completed" and victim not in final["route_nodes"], final
        assert len(final["route_nodes"]) == 3
