"""`meshnet watch` against a real nats-server with a running tracker and a fake node."""

from __future__ import annotations

import asyncio
import contextlib
import io
import itertools
import sys

from bus import subjects
from bus.server import NatsServer
from meshnet.watch import WatchState, render, shown, watch
from schemas.node import NodeAnnouncement, NodeHeartbeat
from schemas.route import DriverAlive, RouteReply, RouteRequest
from schemas.tracker import NodeSummary, TrackerStatus
from tests.fixtures.nats import BusFactory
from tests.test_tracker_service import FakeNode
from tracker.service import Tracker, TrackerConfig

WAIT = 30.0


async def _until_printed(out: io.StringIO, *needles: str) -> None:
    async with asyncio.timeout(WAIT):
        for _ in itertools.count():
            if all(n in out.getvalue() for n in needles):
                return
            await asyncio.sleep(0.05)


async def test_watch_shows_feed_and_tables(bus_factory: BusFactory) -> None:
    config = TrackerConfig(status_interval=0.1, tick_interval=0.05)
    out = io.StringIO()
    monitor = await bus_factory("monitor")
    async with Tracker(await bus_factory("tracker"), config):
        task = asyncio.create_task(watch(monitor, out, table_every=0.2))
        try:
            await _until_printed(out, "--- nodes")
            node = FakeNode(await bus_factory("node", name="solo"), "solo", 0, 30)
            await node.start()
            gateway = await bus_factory("gateway")
            reply = None
            for _ in range(300):  # until the tracker has seen the announcement
                reply = await gateway.request(subjects.ROUTE_CREATE, RouteRequest(model="smol"), RouteReply, timeout=WAIT)
                if reply.session is not None:
                    break
                await asyncio.sleep(0.05)
            assert reply is not None and reply.session is not None
            await _until_printed(
                out,
                "mesh.node.solo.announce",
                f"OPEN session {reply.session.session_id}",
                "solo[0,30)",
                "[0,30)/30",
                "smol rev rev1",
                "covered",
                "--- sessions (1, from tracker tracker)",
            )
            await node.stop()
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    text = out.getvalue()
    assert "node.heartbeat" not in text and "load 0.00 q 0" not in text  # heartbeats hidden by default


async def test_watch_cli_once(nats_server: NatsServer) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "meshnet.cli", "watch", "--nats", nats_server.url, "--once", "--table-every", "0.3",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    stdout, stderr = await proc.communicate()
    assert proc.returncode == 0, stderr.decode()
    assert "--- nodes (0) ---" in stdout.decode()


def test_render_counts_nodes_heard_only_by_heartbeat() -> None:
    """A watch started after the nodes announced sees their heartbeats first: each is a row
    (model and layers from the tracker status, `?` until it lists them), and the header counts it."""
    state = WatchState()
    for node_id in ("node-0", "node-1"):
        state.apply(NodeHeartbeat(node_id=node_id, sessions=1), now=0.0)
    table = render(state, now=0.0)
    assert "--- nodes (2) ---" in table
    assert sum(line.startswith("node-") for line in table.splitlines()) == 2


def test_the_feed_hides_gateways_driver_alive_beats_like_heartbeats() -> None:
    """A gateway publishes mesh.driver.<id>.alive every second: without --heartbeats the feed
    would print a line a second per gateway, drowning the events."""
    beat = DriverAlive(driver_id="gw-1")
    assert not shown(beat, heartbeats=False) and shown(beat, heartbeats=True)
    assert not shown(NodeHeartbeat(node_id="n1"), heartbeats=False)
    assert shown(RouteRequest(model="m"), heartbeats=False)


def test_nodes_heard_only_by_heartbeat_show_model_and_layers_from_the_tracker_status() -> None:
    """`meshnet watch` started on a running mesh never sees the announcements (they were sent
    at join), so every node row read `?` for model and layers for good; the tracker's status
    lists each node's model and layers, and the row takes them from there."""
    state = WatchState()
    state.apply(NodeHeartbeat(node_id="node-0-0", sessions=1, cache_bytes=2_000_000), now=0.0)
    summary = NodeSummary(node_id="node-0-0", model="smollm2-135m", layer_start=0, layer_end=13, n_layer=30)
    state.apply(TrackerStatus(tracker_id="t", n_nodes=1, nodes=[summary]), now=0.0)
    row = next(line for line in render(state, now=0.0).splitlines() if line.startswith("node-0-0"))
    assert "smollm2-135m" in row and "[0,13)/30" in row and "?" not in row
    assert "2.0MB" in row


def test_a_node_heard_only_by_heartbeat_ages_and_goes_when_it_leaves() -> None:
    """A node that joined before the watch started and then stopped cleanly kept its row for
    good, with no age: its leaving announcement found no registry entry to remove. Its row now
    ages (STALE once silent) and goes when its process says it is leaving."""
    state = WatchState()
    state.apply(NodeHeartbeat(node_id="hand1", started_at=7.0), now=0.0)
    state.apply(NodeHeartbeat(node_id="gone", started_at=7.0), now=0.0)
    row = next(line for line in render(state, now=9.0).splitlines() if line.startswith("gone"))
    assert "9.0s STALE" in row
    leaving = NodeAnnouncement.model_validate(
        {**_announcement_fields("hand1"), "leaving": True, "started_at": 7.0})
    state.apply(leaving, now=1.0)
    table = render(state, now=1.0)
    assert "--- nodes (1) ---" in table and "hand1" not in table


def _announcement_fields(node_id: str) -> dict[str, object]:
    from schemas.capability import CapabilityReport, ShardRange

    cap = CapabilityReport(
        model_arch="llama", model_name="m", model_revision="rev1", runtime="llama.cpp",
        layers=ShardRange(start=0, end=30, n_layer=30), hidden_size=8, vocab_size=8,
        n_ctx=512, cache_abi="abi", cache_bytes_per_token=1)
    return {"node_id": node_id, "activation_url": "http://x", "capability": cap.model_dump()}
