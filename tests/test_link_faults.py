"""Faults of a wide-area link between live parts of a mesh, mid-generation: every node behind its
own FaultRelay (tests/fixtures/faults.py, RTT 10 ms), advertising it, so a Decode Run's steps,
its direct return and the gateway's frames cross relays the test can reset. The mesh has no
replica: a restart can only use the same three nodes, which are alive throughout."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from tests.fixtures.faults import FaultRelay, relayed_mesh
from tests.test_concurrent_serving import node_sessions, stream_chat
from tests.test_gateway_e2e import Mesh, Reference, load_reference
from tests.test_restart import MAX_TOKENS, STORY, route_nodes, session_events

pytestmark = pytest.mark.asyncio(loop_scope="module")

DELAY_S = 0.005  # one way
NODES = {"lf-head": "0:10", "lf-mid": "10:20", "lf-tail": "20:30"}
RELAYS: dict[str, FaultRelay] = {}


@pytest.fixture(scope="module")
def reference(model_path: Path) -> Reference:
    return load_reference(model_path)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def mesh(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Mesh]:
    async with relayed_mesh(model_path, tmp_path_factory.mktemp("link-faults"), NODES, RELAYS, DELAY_S,
                            node_timeout=3.0, keepalive=1.0, session_wait=600.0) as m:
        yield m


Fault = Callable[[Mesh, list[str]], Awaitable[int]]


async def fault_mid_stream(mesh: Mesh, http: aiohttp.ClientSession, sid: str, fault: Fault,
                           after_tokens: int = 12) -> tuple[dict[str, Any], list[str]]:
    """Stream STORY greedily and apply `fault` once `after_tokens` arrived; the answer and the route."""
    arrivals: list[float] = []
    task = asyncio.ensure_future(stream_chat(http, mesh.url, STORY, MAX_TOKENS, arrivals, sid=sid))
    async with asyncio.timeout(120):  # hang guards only
        nodes = await route_nodes(http, mesh.url, sid)
        while len(arrivals) < after_tokens:
            assert not task.done(), task.result()
            await asyncio.sleep(0.005)
    assert await fault(mesh, nodes) > 0, "the fault found no connection to break"
    async with asyncio.timeout(300):
        return await task, nodes


def reset_link(src: int, dst: int) -> Fault:
    """Reset (RST both ways) the Seam Link from hop `src`'s node to hop `dst`'s."""
    async def fault(mesh: Mesh, nodes: list[str]) -> int:
        pipes = RELAYS[nodes[dst]].live("/v1/links", mesh.nodes[nodes[src]].pid)
        for pipe in pipes:
            pipe.reset()
        return len(pipes)
    return fault


async def settled(http: aiohttp.ClientSession, mesh: Mesh) -> dict[str, Any]:
    """Each node's sessions once none is live or parked any more (parked ones go after 10 s)."""
    async with asyncio.timeout(120):
        while True:
            hops = await node_sessions(http, mesh)
            if all(h["live_sessions"] == 0 and h["parked_sessions"] == 0 for h in hops.values()):
                return hops
            await asyncio.sleep(0.5)


async def reset_gateway_link(mesh: Mesh, nodes: list[str]) -> int:
    """Reset the gateway's (this process's) connection carrying the Decode Run to the head."""
    pipes = RELAYS[nodes[0]].live("/v1/frames", os.getpid())
    for pipe in pipes:
        pipe.reset()
    return len(pipes)


# each test loses another node: the tracker holds a node lost again within 10 minutes out of
# routes for 10 s or more (docs/control-plane.md, "Lost nodes"), longer than a restart waits
@pytest.mark.parametrize(("fault", "lost"), [(reset_gateway_link, 0), (reset_link(0, 2), 2)],
                         ids=["gateway-to-head", "return-lane"])
async def test_a_link_reset_between_live_parts_restarts_on_the_same_nodes_with_the_greedy_answer(
        mesh: Mesh, reference: Reference, fault: Fault, lost: int) -> None:
    """One reset mid-decode of the gateway's connection to the head, or of the head's Return
    Stream from the tail: the hop at its far end counts as lost, and no route avoids it. The
    restart waits until the tracker hears from that node again and continues on it; the client
    gets the uninterrupted greedy answer (before: a 502 `hop_lost`, "restart 1 of 2 found no new
    route"), and every node frees the lost route's session."""
    _, _, text = await asyncio.to_thread(reference.greedy, STORY, MAX_TOKENS)
    sid = f"link-reset-{lost}"
    async with aiohttp.ClientSession() as http:
        out, nodes = await fault_mid_stream(mesh, http, sid, fault)
        assert out["error"] is None, out
        assert out["text"] == text  # nothing repeated, nothing missing
        events = await session_events(http, mesh.url, sid)
        restarting = [e for e in events if e["phase"] == "restarting"]
        assert restarting and restarting[0]["lost_node_id"] == nodes[lost], [e["phase"] for e in events]
        assert events[-1]["phase"] == "completed" and events[-1]["route_nodes"] == nodes, events[-1]
        hops = await settled(http, mesh)
        assert all(h["cache_bytes"] == 0 for h in hops.values()), hops
        again = await stream_chat(http, mesh.url, STORY, MAX_TOKENS)
        assert again["error"] is None and again["text"] == text, again


async def test_a_return_lane_gone_silent_for_good_costs_one_restart_and_the_next_route_connects_anew(
        mesh: Mesh, reference: Reference) -> None:
    """The tail's tokens stop coming back mid-decode and never come again, while the connection
    stays open (a half-open path: no FIN, no RST). The gateway's stall deadline (10 s) restarts the
    session on the same nodes, and the head opens the new route's Return Stream on a new
    connection: one restart, the greedy answer. Before, the head kept the silent connection for
    the restart's Return Stream, which stalled again: a second restart and another 10 s."""
    _, _, text = await asyncio.to_thread(reference.greedy, STORY, MAX_TOKENS)
    stalled = []

    async def stall_return(mesh: Mesh, nodes: list[str]) -> int:
        stalled.extend(RELAYS[nodes[2]].live("/v1/links", mesh.nodes[nodes[0]].pid))
        for pipe in stalled:
            pipe.stall("answer")
        return len(stalled)

    async with aiohttp.ClientSession() as http:
        try:
            out, _ = await fault_mid_stream(mesh, http, "return-silent", stall_return)
        finally:
            for pipe in stalled:
                pipe.reset()
        assert out["error"] is None and out["text"] == text, out
        events = await session_events(http, mesh.url, "return-silent")
        assert events[-1]["phase"] == "completed" and events[-1]["restarts"] == 1, events[-1]
        assert "stall deadline" in (events[-1]["restart_reason"] or ""), events[-1]
        await settled(http, mesh)


async def test_a_reset_between_the_last_two_hops_is_a_lost_hop_at_once(mesh: Mesh, reference: Reference) -> None:
    """One reset of the Seam Link from the middle hop to the tail mid-decode: the tail fails the
    session naming the middle hop lost, and its Return Stream tells the head, so the gateway
    restarts (on the same nodes: the middle one is alive) with the greedy answer. Before, nobody
    told the head (it waits on the tail's tokens, the middle hop on the head's next step) until
    the gateway's stall deadline, 10 s later, restarted it with no node named."""
    _, _, text = await asyncio.to_thread(reference.greedy, STORY, MAX_TOKENS)
    async with aiohttp.ClientSession() as http:
        out, nodes = await fault_mid_stream(mesh, http, "link-reset-1-2", reset_link(1, 2))
        assert out["error"] is None and out["text"] == text, out
        events = await session_events(http, mesh.url, "link-reset-1-2")
        restarting = [e for e in events if e["phase"] == "restarting"]
        assert restarting and restarting[0]["lost_node_id"] == nodes[1], restarting
        assert "stall deadline" not in restarting[0]["restart_reason"], restarting[0]
        assert events[-1]["phase"] == "completed" and events[-1]["route_nodes"] == nodes, events[-1]
        await settled(http, mesh)
