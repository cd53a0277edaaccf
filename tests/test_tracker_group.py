"""Trackers as one queue group: kill one while requests stream in, and no request fails.

Each request reaches one tracker of the group. Every tracker reads every announcement and every
route directive, so each counts the others' routes and can close or give back any of them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from bus import subjects
from bus.server import NatsServer
from schemas.credentials import hop_credential
from schemas.route import RouteDirective, RouteReply, RouteRequest
from tests.fixtures.nats import BusFactory
from tests.test_concurrent_serving import PROMPTS, stream_chat
from tests.test_gateway_e2e import load_reference, running_mesh
from tests.test_tracker_service import FakeNode
from tracker.service import Tracker, TrackerConfig

ROOT = Path(__file__).resolve().parent.parent
CONFIG = TrackerConfig(heartbeat_interval=0.1, expire_after=1.5, tick_interval=0.05, rebalance_interval=3600.0)


async def test_a_route_asked_again_of_another_tracker_is_the_same_route(bus_factory: BusFactory) -> None:
    nodes = []
    for node_id, (a, b) in {"h": (0, 15), "t": (15, 30)}.items():
        fake = FakeNode(await bus_factory("node", name=node_id), node_id, a, b)
        await fake.start()
        nodes.append(fake)
    one = Tracker(await bus_factory("tracker", name="one"), dataclasses.replace(CONFIG, tracker_id="one"))
    two = Tracker(await bus_factory("tracker", name="two"), dataclasses.replace(CONFIG, tracker_id="two"))
    async with one, two:
        for _ in range(200):
            if {"h", "t"} <= set(one._live) and {"h", "t"} <= set(two._live):
                break
            await asyncio.sleep(0.05)
        req = RouteRequest(model="smol", session_id="asked-twice", request_id="ask-1")
        first = await one.handle_route_request(req)
        assert first.session is not None
        for _ in range(200):  # the open directive reaches the other tracker
            if first.session.route_id in two.sessions:
                break
            await asyncio.sleep(0.02)
        assert two._live["h"] == one._live["h"]  # it counts the route's slot too
        again = await two.handle_route_request(req)  # the gateway asks again: the first tracker "died"
        assert again.session is not None and again.session.route_id == first.session.route_id
        assert again.credentials == first.credentials
        s = again.session
        assert again.credentials[0] == hop_credential(two.frame_keys["h"], s.session_id, s.route_id, s.epoch, 0,
                                                      s.expires_at)
        for other in (RouteRequest(model="smol", session_id="asked-twice", epoch=2, request_id="ask-1"),
                      RouteRequest(model="smol", session_id="asked-twice", request_id="someone-else")):
            refused = await two.handle_route_request(other)  # not a retry of that ask: no route, no credentials
            assert refused.error is not None and "already has a route" in refused.error.message
        # a close seen by both ends the route in both
        gateway = await bus_factory("gateway")
        await gateway.publish(subjects.route_directive(s.route_id),
                              RouteDirective(action="close", session=s, issued_by="gateway"))
        for _ in range(200):
            if s.route_id not in one.sessions and s.route_id not in two.sessions:
                break
            await asyncio.sleep(0.02)
        assert s.route_id not in one.sessions and s.route_id not in two.sessions
        reply = await gateway.request(subjects.ROUTE_CREATE, RouteRequest(model="smol"), RouteReply, timeout=5.0)
        assert reply.session is not None  # one of the group answers, once
        await asyncio.sleep(0.3)
        assert (reply.session.route_id in one.sessions) and (reply.session.route_id in two.sessions)
    for fake in nodes:
        await fake.stop()


@pytest.mark.asyncio(loop_scope="module")
async def test_killing_one_of_two_trackers_during_a_stream_of_requests_fails_none(
        model_path: Path, tmp_path: Path) -> None:
    ref = load_reference(model_path)
    want = {i: ref.greedy(PROMPTS[i % len(PROMPTS)], 16) for i in range(4)}
    async with running_mesh(model_path, tmp_path, {"tg-head": "0:15", "tg-tail": "15:30"},
                            node_timeout=3.0, keepalive=1.0, session_wait=600.0) as mesh:
        nats: NatsServer = mesh.nats
        user, password = nats.credentials("tracker")
        second = subprocess.Popen(  # noqa: ASYNC220 - started once; killed below
            [sys.executable, "-m", "meshnet.cli", "tracker", "--tracker-id", "tracker-b", "--nats", nats.url,
             "--nats-user", user, "--nats-password", password, "--log-level", "info"],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, env={**os.environ})
        opened: list[tuple[str, bool]] = []  # (issuer, after the kill) of every open directive
        killed = asyncio.Event()

        async def directives() -> None:
            async with mesh.monitor.subscribe(subjects.DIRECTIVE_ALL, RouteDirective) as sub:
                async for d in sub:
                    if d.action == "open":
                        opened.append((d.issued_by, killed.is_set()))

        watcher = asyncio.create_task(directives())
        try:
            results: list[dict] = []
            served_by_b = asyncio.Event()  # set when tracker-b is killed, with requests in flight

            async def client(k: int, http: aiohttp.ClientSession) -> None:
                for j in range(10):
                    i = (k + j) % 4
                    out = await stream_chat(http, mesh.url, PROMPTS[i % len(PROMPTS)], 16)
                    results.append({"i": i, **out})
                    await asyncio.sleep(0.05)

            async def killer() -> None:
                for _ in range(1200):  # until tracker-b (after its warm-up) has answered its share
                    if sum(1 for who, _ in opened if who == "tracker-b") >= 2:
                        break
                    await asyncio.sleep(0.05)
                served_by_b.set()
                second.send_signal(signal.SIGKILL)
                second.wait()
                killed.set()

            async with aiohttp.ClientSession() as http:
                await asyncio.gather(client(0, http), client(1, http), client(2, http), killer())
            assert second.returncode == -signal.SIGKILL and served_by_b.is_set()
            assert len(results) == 30
            failed = [r for r in results if r["status"] != 200 or r["error"]]
            assert not failed, failed[:3]
            for r in results:  # each the single-process greedy answer
                assert r["text"] == want[r["i"]][2], r
            await asyncio.sleep(0.5)
            assert mesh.tracker.sessions == {}  # every route ended, whichever tracker opened it
            assert ("tracker-b", False) in opened  # both answered before the kill ...
            assert ("tracker", False) in opened and ("tracker", True) in opened  # ... and one after it
            assert ("tracker-b", True) not in opened
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
            if second.poll() is None:
                second.kill()
                second.wait()


async def test_a_tracker_that_starts_late_counts_the_routes_opened_before_it(bus_factory: BusFactory) -> None:
    nodes = []
    for node_id, (a, b) in {"h2": (0, 15), "t2": (15, 30)}.items():
        fake = FakeNode(await bus_factory("node", name=node_id), node_id, a, b, max_sessions=2)
        await fake.start()
        nodes.append(fake)
    one = Tracker(await bus_factory("tracker", name="early"), dataclasses.replace(CONFIG, tracker_id="early"))
    async with one:
        for _ in range(200):
            if {"h2", "t2"} <= set(one._live):
                break
            await asyncio.sleep(0.05)
        opened = await one.handle_route_request(RouteRequest(model="smol", session_id="before-late"))
        assert opened.session is not None
        await asyncio.sleep(0.3)  # the session bucket write is off the request path
        late = Tracker(await bus_factory("tracker", name="late"), dataclasses.replace(CONFIG, tracker_id="late"))
        async with late:  # never saw the open directive: it reads the session bucket
            assert opened.session.route_id in late.sessions
            for _ in range(200):
                if {"h2", "t2"} <= set(late._live):
                    break
                await asyncio.sleep(0.05)
            assert late._live == one._live == {"h2": 1, "t2": 1}  # the slot is taken in both views
    for fake in nodes:
        await fake.stop()
