"""A telemetry stream whose client left frees its slot at once, not at its next keep-alive."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from tests.test_gateway_api import Edge, edge, tokenizer  # noqa: F401  (fixtures)

GUARD_S = 30.0  # well under the keep-alive interval below: the slot must not wait for it


@pytest.fixture
def gateway_overrides() -> dict[str, Any]:
    return {"max_telemetry_streams": 64, "max_telemetry_streams_per_client": 3, "keepalive": 600.0}


async def test_closed_streams_free_their_clients_share_before_any_keepalive(edge: Edge) -> None:  # noqa: F811
    """A user probe: 16 closed streams locked their client out for a keep-alive interval (15 s)."""
    async with aiohttp.ClientSession() as http:
        held = [await http.get(f"{edge.url}/v1/telemetry") for _ in range(3)]
        assert [r.status for r in held] == [200, 200, 200]
        async with http.get(f"{edge.url}/v1/mesh/events") as refused:
            assert refused.status == 429
        for resp in held:
            resp.close()  # the client leaves; the gateway's handlers sit in a 600 s wait
        async with asyncio.timeout(GUARD_S):
            while True:
                async with http.get(f"{edge.url}/v1/telemetry") as resp:
                    if resp.status == 200:
                        break
                await asyncio.sleep(0.05)
