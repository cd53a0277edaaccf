"""A gateway that dies mid-stream: every hop frees its sessions within seconds (the hops hear
its DriverAlive no more), not after the 600 s idle lease."""

from __future__ import annotations

import asyncio
import signal

import aiohttp

from tests.fixtures.mesh import Mesh, gateway_process

GUARD_S = 90  # a guard, not a speed bound: the lease alone would take 600 s


async def test_a_killed_gateway_frees_its_sessions_on_every_hop(mesh: Mesh) -> None:
    nodes = [await mesh.spawn((0, 15)), await mesh.spawn((15, 30))]
    async with aiohttp.ClientSession() as http, gateway_process(mesh, http, GUARD_S) as (url, gateway):
        body = {"model": "smollm2-135m-instruct", "stream": True, "max_tokens": 1500, "temperature": 0,
                "messages": [{"role": "user", "content": "Tell me a very long story about a lighthouse."}]}
        resp = await http.post(f"{url}/v1/chat/completions", json=body)
        assert resp.status == 200
        chunks = 0
        async for line in resp.content:
            chunks += line.startswith(b"data: {")
            if chunks >= 5:
                break

        async def held() -> list[int]:
            counts = []
            for node in nodes:
                async with http.get(f"{node.url}/v1/sessions") as r:
                    counts.append((await r.json())["live_sessions"])
            return counts

        assert await held() == [1, 1]  # the stream's session, on both hops
        gateway.send_signal(signal.SIGKILL)
        await gateway.wait()
        resp.close()
        async with asyncio.timeout(GUARD_S):
            while await held() != [0, 0]:  # noqa: ASYNC110 - the hops are polled over HTTP
                await asyncio.sleep(0.5)
        for node in nodes:
            async with http.get(f"{node.url}/v1/sessions") as r:
                listing = await r.json()
            assert listing["cache_bytes"] == 0 and listing["engine_sessions"] == 0, listing
