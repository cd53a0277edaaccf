"""Two gateways in front of one mesh (a load balancer spreads clients over them): a client's
session id that is in use on one gateway is the same conflict on the other."""

from __future__ import annotations

import aiohttp

from tests.fixtures.mesh import Mesh, gateway_process

MODEL = "smollm2-135m-instruct"


async def test_a_session_id_in_use_on_one_gateway_is_a_409_on_the_other(mesh: Mesh) -> None:
    """It was a 400 bad_request 'the tracker refused the request: session X already has a
    route', as if the request were malformed, where the same id on one gateway is a 409
    session_exists (docs/gateway.md)."""
    await mesh.spawn((0, 15))
    await mesh.spawn((15, 30))
    body = {"model": MODEL, "stream": True, "max_tokens": 1500, "temperature": 0,
            "messages": [{"role": "user", "content": "Tell me a very long story about a lighthouse."}]}
    headers = {"x-route-session-id": "shared-id-1"}
    async with (aiohttp.ClientSession() as http, gateway_process(mesh, http) as (a, _),
            gateway_process(mesh, http) as (b, _)):
        async with http.post(f"{a}/v1/chat/completions", json=body, headers=headers) as stream:
            assert stream.status == 200
            chunks = 0
            async for line in stream.content:  # the session runs on gateway a
                chunks += line.startswith(b"data: {")
                if chunks >= 3:
                    break
            for url in (a, b):
                async with http.post(f"{url}/v1/chat/completions", json={**body, "stream": False},
                                     headers=headers) as r:
                    error = (await r.json())["error"]
                    assert (r.status, error["code"]) == (409, "session_exists"), (url, error)
                    assert r.headers.get("x-should-retry") == "false"
                    assert error["param"] == "x-route-session-id"
