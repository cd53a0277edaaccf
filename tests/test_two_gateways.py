"""Two gateways in front of one mesh (a load balancer spreads clients over them): a client's
session id that is in use on one gateway is the same conflict on the other."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp

from bus.config import ENV_PASSWORD, ENV_USER
from bus.server import free_port
from tests.fixtures.mesh import Mesh

GUARD_S = 120  # a guard, not a speed bound (shared 2-core machine)
MODEL = "smollm2-135m-instruct"


@asynccontextmanager
async def gateway(mesh: Mesh, http: aiohttp.ClientSession) -> AsyncIterator[str]:
    """A `meshnet gateway` process on the mesh; its URL once it sees a routable model."""
    port = free_port()
    user, password = mesh.nats.credentials("gateway")
    env = {**os.environ, ENV_USER: user, ENV_PASSWORD: password, "PYTHONUNBUFFERED": "1"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "meshnet.cli", "gateway", "--port", str(port), "--nats", mesh.nats.url,
        "--model", str(mesh.model_path), env=env,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        async with asyncio.timeout(GUARD_S):
            while True:
                try:
                    async with http.get(f"{url}/v1/models") as r:
                        if r.status == 200 and (await r.json())["data"]:
                            break
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.2)
        yield url
    finally:
        proc.kill()
        await proc.wait()


async def test_a_session_id_in_use_on_one_gateway_is_a_409_on_the_other(mesh: Mesh) -> None:
    """It was a 400 bad_request 'the tracker refused the request: session X already has a
    route', as if the request were malformed, where the same id on one gateway is a 409
    session_exists (docs/gateway.md)."""
    await mesh.spawn((0, 15))
    await mesh.spawn((15, 30))
    body = {"model": MODEL, "stream": True, "max_tokens": 1500, "temperature": 0,
            "messages": [{"role": "user", "content": "Tell me a very long story about a lighthouse."}]}
    headers = {"x-route-session-id": "shared-id-1"}
    async with aiohttp.ClientSession() as http, gateway(mesh, http) as a, gateway(mesh, http) as b:
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
