"""A long prompt over a slow link: the hops behind the head take its rows far slower than the
gateway's old prefill deadline allowed (20 rows/s after the head's last acknowledgement), yet
they make progress all along, and the stall watch sees it (docs/gateway.md, "Stalls"). Three
nodes behind FaultRelays (tests/fixtures/faults.py); the tail's is capped at RATE_MBIT, so the
middle hop hands the tail each prefill frame at that rate. The mesh has no replica."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio

from tests.fixtures.faults import FaultRelay, Pipe, relayed_mesh
from tests.test_concurrent_serving import stream_chat
from tests.test_gateway_e2e import Mesh, Reference, load_reference
from tests.test_link_faults import settled
from tests.test_restart import route_nodes, session_events

pytestmark = pytest.mark.asyncio(loop_scope="module")

DELAY_S = 0.005  # one way
RATE_MBIT = 0.1  # the tail's link: an f32 row (2,304 bytes) of the bundled model takes 0.18 s
ROW_BYTES = 2304
CHUNK = 16  # prefill rows per frame: one frame crosses the capped link in ~3 s
STALL_S = 2.0  # the gateway's --stall-timeout: prefill deadline 3 x 2 s + a frame's 16 rows / 20 rows/s
MAX_TOKENS = 8
NODES = {"sl-head": "0:10", "sl-mid": "10:20", "sl-tail": "20:30"}
RELAYS: dict[str, FaultRelay] = {}
NOTES = [{"role": "user", "content": "Here are my notes from the harbour. " + " ".join(
    f"Day {i}: the lighthouse keeper climbed the tower, trimmed the lamp, logged the wind and watched the ships."
    for i in range(1, 8)) + " Summarise the notes in one sentence."}]
SHORT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def reference(model_path: Path) -> Reference:
    return load_reference(model_path)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def mesh(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Mesh]:
    async with relayed_mesh(model_path, tmp_path_factory.mktemp("slow-link"), NODES, RELAYS, DELAY_S,
                            rates={"sl-tail": RATE_MBIT}, chunk_size=CHUNK, stall_timeout=STALL_S,
                            node_timeout=3.0, keepalive=1.0, session_wait=600.0) as m:
        yield m


async def test_a_long_prompt_over_a_slow_link_is_answered_without_a_restart(
        mesh: Mesh, reference: Reference) -> None:
    """~200 prompt rows cross the capped link in ~40 s, while the head has taken every frame
    within the first ~15 s: the old deadline (6 s + 1 s per 20 prompt rows after the head's last
    acknowledgement) restarted the session on the same slow link, and again, and failed it. The
    hops' own progress now counts: one route, the uninterrupted greedy answer."""
    prompt, _, text = await asyncio.to_thread(reference.greedy, NOTES, MAX_TOKENS)
    link_s = len(prompt) * ROW_BYTES * 8 / (RATE_MBIT * 1e6)
    assert link_s > 2 * (3 * STALL_S + len(prompt) / 20), "the prompt must outlast the old deadline"
    async with aiohttp.ClientSession() as http:
        t0 = time.monotonic()
        out = await asyncio.wait_for(stream_chat(http, mesh.url, NOTES, MAX_TOKENS, sid="slow-notes"), 300)
        took = time.monotonic() - t0
        assert out["error"] is None, out
        assert out["text"] == text
        events = await session_events(http, mesh.url, "slow-notes")
        assert events[-1]["phase"] == "completed" and events[-1]["restarts"] == 0, events[-1]
        assert not [e for e in events if e["phase"] == "restarting"], [e["phase"] for e in events]
        assert took > link_s * 0.8, (took, link_s)  # the rows did cross the capped link
        await settled(http, mesh)


async def test_a_slow_link_gone_half_open_in_prefill_still_restarts(mesh: Mesh, reference: Reference) -> None:
    """The capped link goes silent for good mid-prefill (no FIN, no RST): no hop takes another
    row, the probes show nothing moving, and the stall deadline restarts the session (on new
    connections, the same nodes) with the greedy answer."""
    _, _, text = await asyncio.to_thread(reference.greedy, SHORT, MAX_TOKENS)
    stalled: list[Pipe] = []
    async with aiohttp.ClientSession() as http:
        t0 = time.monotonic()
        task = asyncio.ensure_future(stream_chat(http, mesh.url, SHORT, MAX_TOKENS, sid="slow-silent"))
        try:
            async with asyncio.timeout(60):  # hang guard only
                nodes = await route_nodes(http, mesh.url, "slow-silent")
                while not stalled:  # the middle hop's frames to the tail: silent from the start
                    assert not task.done(), task.result()
                    stalled.extend(p for p in RELAYS[nodes[2]].live("/v1/frames", mesh.nodes[nodes[1]].pid)
                                   if p.opened >= t0)
                    await asyncio.sleep(0.005)
            for pipe in stalled:
                pipe.stall("request")
                pipe.stall("answer")
            async with asyncio.timeout(120):
                out = await task
        finally:
            for pipe in stalled:
                pipe.reset()
        assert out["error"] is None and out["text"] == text, out
        events = await session_events(http, mesh.url, "slow-silent")
        assert events[-1]["phase"] == "completed" and events[-1]["restarts"] == 1, events[-1]
        assert "stall deadline" in (events[-1]["restart_reason"] or ""), events[-1]
        await settled(http, mesh)
