"""Idle telemetry streams of one client never lock the other clients out."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from tests.test_gateway_api import Edge, edge, tokenizer  # noqa: F401  (fixtures)


@pytest.fixture
def gateway_overrides() -> dict[str, Any]:
    return {"max_telemetry_streams": 64, "max_telemetry_streams_per_client": 3}


def client(address: str) -> aiohttp.ClientSession:
    """An HTTP client whose connections come from `address` (any 127.x.y.z is this machine)."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=(address, 0)))


async def test_one_clients_idle_streams_take_only_its_own_share(edge: Edge) -> None:  # noqa: F811
    async with client("127.0.0.2") as greedy, client("127.0.0.3") as other:
        held = []
        try:
            for _ in range(3):  # idle: nothing ever happens on /v1/telemetry here
                resp = await greedy.get(f"{edge.url}/v1/telemetry")
                assert resp.status == 200
                held.append(resp)
            async with greedy.get(f"{edge.url}/v1/telemetry") as refused:
                assert refused.status == 429
                err = (await refused.json())["error"]
                assert err["code"] == "too_many_streams" and "this client" in err["message"]
            async with other.get(f"{edge.url}/v1/telemetry") as resp:  # another client is served
                assert resp.status == 200
                line = await asyncio.wait_for(resp.content.readline(), 30)
                assert line.startswith(b":") or line.startswith(b"data") or line == b"\n"
        finally:
            for resp in held:
                resp.close()
        async with greedy.get(f"{edge.url}/healthz") as resp:
            assert resp.status in (200, 503)
        # the closed streams free the greedy client's share again
        for _ in range(100):
            async with greedy.get(f"{edge.url}/v1/telemetry") as resp:
                if resp.status == 200:
                    break
            await asyncio.sleep(0.05)
        assert resp.status == 200
