"""A node lost for a moment on a mesh without replicas, as a user sees it: every node of a 4-hop
route behind its own FaultRelay (tests/fixtures/faults.py), advertising it, so the test can reset
the connections between live parts mid-generation (as tests/test_link_faults.py does on 3 hops).
No route avoids a lost node: each answer can only go on, or a new request start, on the same four
nodes, which are alive throughout. Each test loses other nodes (the tracker holds a node lost
again within 10 minutes out of routes longer: docs/control-plane.md, "Lost nodes")."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio

from tests.fixtures.faults import relayed_mesh
from tests.test_concurrent_serving import stream_chat
from tests.test_gateway_e2e import Mesh, Reference, load_reference
from tests.test_link_faults import RELAYS, fault_mid_stream, reset_gateway_link, reset_link, settled
from tests.test_restart import MAX_TOKENS, STORY, session_events

pytestmark = pytest.mark.asyncio(loop_scope="module")

DELAY_S = 0.005  # one way
NODES = {"ln-head": "0:8", "ln-mid1": "8:16", "ln-mid2": "16:24", "ln-tail": "24:30"}


@pytest.fixture(scope="module")
def reference(model_path: Path) -> Reference:
    return load_reference(model_path)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def mesh(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Mesh]:
    async with relayed_mesh(model_path, tmp_path_factory.mktemp("lost-node"), NODES, RELAYS, DELAY_S,
                            node_timeout=3.0, keepalive=1.0, session_wait=600.0) as m:
        yield m


async def test_a_reset_between_two_middle_hops_is_a_lost_hop_at_once(mesh: Mesh, reference: Reference) -> None:
    """One reset of the Seam Link between the two middle hops of a 4-hop route mid-decode: the
    hop behind it fails the session naming the hop before it lost, and the route restarts at
    once (on the same nodes) with the greedy answer. Before, nobody told the head (the tail's
    lane just ended, the first middle hop waits on the head's next step) until the gateway's
    stall deadline, 10 s later, restarted it with no node named."""
    _, _, text = await asyncio.to_thread(reference.greedy, STORY, MAX_TOKENS)
    async with aiohttp.ClientSession() as http:
        began = time.monotonic()
        out, nodes = await fault_mid_stream(mesh, http, "reset-1-2", reset_link(1, 2))
        assert out["error"] is None and out["text"] == text, out
        events = await session_events(http, mesh.url, "reset-1-2")
        restarting = [e for e in events if e["phase"] == "restarting"]
        assert restarting and restarting[0]["lost_node_id"] == nodes[1], restarting
        assert "stall deadline" not in restarting[0]["restart_reason"], restarting[0]
        assert events[-1]["phase"] == "completed" and events[-1]["route_nodes"] == nodes, events[-1]
        print(f"4-hop middle reset: answered in {time.monotonic() - began:.1f} s")
        await settled(http, mesh)


async def test_a_request_while_a_lost_node_is_held_out_waits_for_it(mesh: Mesh, reference: Reference) -> None:
    """A reset of the gateway's connection to the head mid-stream: the gateway reports the head
    lost, and the tracker holds it out of new routes until it hears from it again. A new request
    meanwhile waits for it (phase `queued`) and gets the greedy answer. Before: an immediate 503
    `no_coverage` ("missing layers [0,8)") though the head was alive."""
    _, _, text = await asyncio.to_thread(reference.greedy, STORY, MAX_TOKENS)
    book = mesh.tracker.book
    async with aiohttp.ClientSession() as http:
        first = asyncio.ensure_future(fault_mid_stream(mesh, http, "held-first", reset_gateway_link))
        async with asyncio.timeout(120):
            while not book.suspects:
                assert not first.done(), first.result()
                await asyncio.sleep(0.005)
        held = set(book.suspects)
        began, arrivals = time.monotonic(), []
        second = await stream_chat(http, mesh.url, STORY, MAX_TOKENS, arrivals, sid="held-second")
        assert second["error"] is None and second["text"] == text, second
        out, nodes = await first
        assert held == {nodes[0]}, held
        assert out["error"] is None and out["text"] == text, out
        phases = [e["phase"] for e in await session_events(http, mesh.url, "held-second")]
        assert "queued" in phases and phases[-1] == "completed", phases
        print(f"request while {held} held out: first token after {arrivals[0] - began:.1f} s")
        await settled(http, mesh)


async def test_a_node_lost_twice_within_minutes_is_waited_for_while_the_tracker_holds_it(
        mesh: Mesh, reference: Reference) -> None:
    """Two resets of the tail's Return Stream to the head, in two answers a few seconds apart:
    the second loss of the tail within 10 minutes makes the tracker hold it out 10 s whatever it
    says (tracker/suspicion.py). The restart waits that hold out and goes on with the greedy
    answer. Before: it waited 5 s and the answer failed with 502 `hop_lost`."""
    _, _, text = await asyncio.to_thread(reference.greedy, STORY, MAX_TOKENS)
    async with aiohttp.ClientSession() as http:
        for attempt in ("once", "twice"):
            sid = f"tail-lost-{attempt}"
            began = time.monotonic()
            out, nodes = await fault_mid_stream(mesh, http, sid, reset_link(0, 3))
            assert out["error"] is None and out["text"] == text, (attempt, out)
            events = await session_events(http, mesh.url, sid)
            restarting = [e for e in events if e["phase"] == "restarting"]
            assert restarting and restarting[0]["lost_node_id"] == nodes[3], restarting
            assert events[-1]["phase"] == "completed" and events[-1]["restarts"] == 1, events[-1]
            print(f"tail lost {attempt}: answered in {time.monotonic() - began:.1f} s")
            await settled(http, mesh)
