"""RouteClient's release of a route whose hop was lost (a restart follows): a hop of the lost
node's process (a composite node's other shard, frozen with it) must not hold the restart."""

from __future__ import annotations

import asyncio
import contextlib
import time

import aiohttp
from aiohttp import web

from gateway.route_client import RELEASE_TIMEOUT_S, RouteClient
from schemas.route import Hop, RouteFailure, RouteSession
from tests.fixtures.http_app import serve_app


async def _hop_server(delay_s: float, seen: list[dict[str, str]]) -> tuple[web.AppRunner, str]:
    async def delete(request: web.Request) -> web.Response:
        seen.append(dict(request.query))
        await asyncio.sleep(delay_s)
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_delete("/v1/sessions/{sid}", delete)
    return await serve_app(app)


def _session(*hops: tuple[str, str]) -> RouteSession:
    return RouteSession(session_id="s", route_id="r", model="m", model_revision="m", cache_abi="a",
                        n_layer=len(hops), hidden_size=8, n_ctx=64,
                        hops=[Hop(node_id=n, activation_url=u, layer_start=i, layer_end=i + 1)
                              for i, (n, u) in enumerate(hops)])


async def test_a_restarts_abort_does_not_wait_out_a_frozen_hop_but_still_tells_it() -> None:
    fast_seen: list[dict[str, str]] = []
    frozen_seen: list[dict[str, str]] = []
    fast, fast_url = await _hop_server(0.0, fast_seen)
    frozen, frozen_url = await _hop_server(2.0, frozen_seen)  # answers after the release timeout
    try:
        async with aiohttp.ClientSession() as http:
            # the head (lost) and its process's tail (frozen with it), then a live hop
            rc = RouteClient(_session(("head", "http://127.0.0.1:9"), ("tail", frozen_url), ("x", fast_url)), http)
            rc.interrupt(RouteFailure(session_id="s", route_id="r", phase="decode", node_id="head",
                                      reason="node head expired", code="hop_lost"))
            t0 = time.monotonic()
            await rc.abort("lost head")
            took = time.monotonic() - t0
            assert took < RELEASE_TIMEOUT_S / 2, f"the restart's release waited {took:.2f} s"
            assert [q["lost"] for q in fast_seen] == ["head"]
            await asyncio.sleep(0.1)
            assert [q["lost"] for q in frozen_seen] == ["head"], "the frozen hop is still told, late"
    finally:
        await fast.cleanup()
        await frozen.cleanup()


async def test_a_close_still_waits_for_every_hop() -> None:
    seen: list[dict[str, str]] = []
    slow, slow_url = await _hop_server(0.4, seen)
    try:
        async with aiohttp.ClientSession() as http:
            rc = RouteClient(_session(("a", slow_url), ("b", slow_url)), http)
            t0 = time.monotonic()
            await rc.close()
            assert time.monotonic() - t0 >= 0.35
            assert len(seen) == 2 and all(q["action"] == "close" for q in seen)
    finally:
        await slow.cleanup()


async def test_a_cancelled_caller_tells_the_hops_what_that_means() -> None:
    """A client that left and a gateway shutting down both cancel the route's caller: the hops
    and the tracker logged 'caller stopped: CancelledError', which told an operator neither."""
    seen: list[dict[str, str]] = []
    hop, url = await _hop_server(0.0, seen)
    try:
        async with aiohttp.ClientSession() as http:

            async def drive() -> None:
                async with RouteClient(_session(("a", url)), http) as rc:
                    rc.position = 5  # as if the prompt went
                    await asyncio.sleep(30)

            task = asyncio.create_task(drive())
            await asyncio.sleep(0.05)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        assert [q["action"] for q in seen] == ["abort"]
        assert "client left" in seen[0]["reason"] and "CancelledError" not in seen[0]["reason"]
    finally:
        await hop.cleanup()
