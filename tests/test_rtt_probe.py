"""wire/rtt_probe.py over real HTTP on loopback: a peer's reported round trip includes its
delay, a peer that errs reports nothing, one that cannot be reached reports MAX_RTT_MS until it
answers again, and the report is bounded."""

from __future__ import annotations

import asyncio
import socket

import aiohttp
from aiohttp import web

from nodes.server.peer_probe import probe_targets
from schemas.node import MAX_RTT_MS
from schemas.tracker import NodeSummary
from tests.fixtures.http_app import serve_app
from wire.rtt_probe import RttProbe, smallest

DELAY_S = 0.05


async def _serve(status: int, delay_s: float) -> tuple[web.AppRunner, str]:
    async def healthz(_request: web.Request) -> web.Response:
        await asyncio.sleep(delay_s)
        return web.Response(status=status, text="ok")

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    return await serve_app(app)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_probe_reports_each_answering_peers_round_trip() -> None:
    slow, slow_url = await _serve(200, DELAY_S)
    fast, fast_url = await _serve(200, 0.0)
    failing, failing_url = await _serve(500, 0.0)
    try:
        probe = RttProbe()
        probe.name({"slow": slow_url, "fast": fast_url, "failing": failing_url,
                    "gone": f"http://127.0.0.1:{_closed_port()}"})
        async with aiohttp.ClientSession() as http:
            for _ in range(3):
                await probe.probe_once(http)
        rtt = probe.rtt_ms()
        assert set(rtt) == {"slow", "fast", "gone"}, rtt
        assert rtt["gone"] == MAX_RTT_MS  # not listening: as far as can be, so routes go elsewhere
        assert rtt["slow"] >= DELAY_S * 1e3, rtt
        assert rtt["fast"] < rtt["slow"], rtt
        assert len(probe.samples["slow"]) == 3
    finally:
        for runner in (slow, fast, failing):
            await runner.cleanup()


async def test_a_peer_that_stops_answering_is_far_until_it_answers_again() -> None:
    runner, url = await _serve(200, 0.0)
    probe = RttProbe()
    probe.name({"peer": url})
    async with aiohttp.ClientSession() as http:
        await probe.probe_once(http)
        near = probe.rtt_ms()["peer"]
        assert near < MAX_RTT_MS
        site_port = int(url.rsplit(":", 1)[1])
        await runner.cleanup()  # its address no longer answers (its heartbeats might still flow)
        await probe.probe_once(http)
        assert probe.rtt_ms()["peer"] == MAX_RTT_MS  # its earlier, near samples no longer count
        async def healthz(_request: web.Request) -> web.Response:
            return web.Response(text="ok")

        again = web.Application()
        again.router.add_get("/healthz", healthz)
        back = web.AppRunner(again)
        await back.setup()
        await web.TCPSite(back, "127.0.0.1", site_port).start()
        try:
            await probe.probe_once(http)
            assert probe.rtt_ms()["peer"] < MAX_RTT_MS
        finally:
            await back.cleanup()


def test_smallest_sample_is_reported() -> None:
    assert smallest([30.0, 2.5, 9.0]) == 2.5
    assert smallest([]) is None


def test_a_node_probes_its_next_hops_and_a_head_also_the_tails() -> None:
    def summary(node_id: str, start: int, end: int, rev: str = "r1") -> NodeSummary:
        return NodeSummary(node_id=node_id, model="smol", model_revision=rev, layer_start=start, layer_end=end,
                           n_layer=30, activation_url=f"http://{node_id}")

    nodes = [summary("h", 0, 10), summary("h2", 0, 10), summary("m", 10, 20), summary("t", 20, 30),
             summary("t-other", 20, 30, rev="r2"), summary("whole", 0, 30)]
    assert probe_targets(nodes, node_id="h", model_revision="r1", layer_end=10, head=True) == {
        "m": "http://m", "t": "http://t"}  # (not a node that could never follow it)
    assert probe_targets(nodes, node_id="m", model_revision="r1", layer_end=20) == {"t": "http://t"}
    assert probe_targets(nodes, node_id="t", model_revision="r1", layer_end=30) == {}


async def test_an_address_that_answers_as_another_node_is_unreachable() -> None:
    """A wrong --advertise (or a hostname that resolves to loopback where the same port serves the
    prober itself) reaches another node: near by the clock, but no frame for that peer goes through."""
    async def healthz(_request: web.Request) -> web.Response:
        return web.json_response({"ok": True, "node_id": "b"})

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        probe = RttProbe()
        probe.name({"e": url, "b": url})
        async with aiohttp.ClientSession() as http:
            await probe.probe_once(http)
        rtt = probe.rtt_ms()
        assert rtt["e"] == MAX_RTT_MS, rtt  # e's address answers as b
        assert rtt["b"] < MAX_RTT_MS, rtt  # b's own address is b
    finally:
        await runner.cleanup()
