"""Abuse of the gateway's edge: pathological requests stay cheap and never stall other streams."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson
import pytest

from tests.test_gateway_api import Edge, _byte_tokens, _post, edge, http, tokenizer  # noqa: F401  (fixtures)

TEXT = "The lighthouse keeper counted the ships that passed in the night. " * 3  # 198 bytes


async def _ready(edge: Edge, http: aiohttp.ClientSession) -> None:  # noqa: F811
    await edge.announce()
    for _ in range(200):  # the announcements reach the gateway's mesh view asynchronously
        async with http.get(f"{edge.url}/v1/models") as r:
            if (await r.json())["data"]:
                return
        await asyncio.sleep(0.05)
    raise AssertionError("the gateway never saw the mesh")


async def test_twenty_thousand_tiny_messages_are_refused_while_a_stream_flows(
        edge: Edge, http: aiohttp.ClientSession) -> None:  # noqa: F811
    """The probe's request: 20,000 one-character messages render to ~580k characters, once
    tokenized on the event loop for ~19 s while every stream stood still. Now it is rendered off
    the loop and refused from its length alone, and the stream keeps receiving tokens."""
    await _ready(edge, http)
    edge.script.tokens = _byte_tokens(edge.tokenizer, TEXT)
    got: list[str] = []
    flowing = asyncio.Event()

    async def stream() -> None:
        body = {"model": "bundled", "messages": [{"role": "user", "content": "go"}], "stream": True,
                "max_tokens": 150}
        async with http.post(f"{edge.url}/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
            async for line in resp.content:
                if line.startswith(b"data: {"):
                    got.append(line.decode())
                    if len(got) >= 5:
                        flowing.set()

    task = asyncio.create_task(stream())
    async with asyncio.timeout(60):
        await flowing.wait()
    before = len(got)
    probe: dict[str, Any] = {"model": "bundled", "messages": [{"role": "user", "content": "x"}] * 20_000}
    status, _, raw = await _post(http, edge.url, probe)
    assert status == 400, raw
    err = orjson.loads(raw)["error"]
    assert (err["code"], err["param"]) == ("context_length_exceeded", "messages")
    small = {"model": "bundled", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with asyncio.timeout(60):
        await task
    assert len(got) > before and '"finish_reason":"length"' in got[-1].replace(" ", "")
    status, _, raw = await _post(http, edge.url, small)  # nothing left queued or stuck behind it
    assert status == 200, raw


@pytest.fixture
def gateway_overrides() -> dict[str, Any]:
    return {"body_timeout": 0.5}


async def test_a_body_that_never_arrives_is_a_408_and_frees_the_connection(
        edge: Edge, http: aiohttp.ClientSession) -> None:  # noqa: F811
    """3,000 connections that announced a body and never sent it were once held for good."""
    await _ready(edge, http)
    host, port = edge.url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"model\": ")
        await writer.drain()
        async with asyncio.timeout(30):  # a guard: the gateway answers after its 0.5 s body timeout
            status_line = await reader.readline()
            rest = await reader.read()
    finally:
        writer.close()
    assert status_line.split()[1] == b"408", status_line
    assert b"body_timeout" in rest


async def test_a_body_over_the_limit_is_a_413_and_counted(edge: Edge, http: aiohttp.ClientSession) -> None:  # noqa: F811
    """A body above --max-body-bytes (4 MiB) is refused before it is parsed, and /metrics counts
    the refusal with the other outcomes of completion requests."""
    huge = {"model": "bundled", "messages": [{"role": "user", "content": "x" * (5 * 1024 * 1024)}]}
    for path in ("/v1/chat/completions", "/v1/completions"):
        async with http.post(f"{edge.url}{path}", json=huge) as resp:
            status, raw = resp.status, await resp.read()
        assert status == 413 and orjson.loads(raw)["error"]["code"] == "body_too_large", raw
    async with http.get(f"{edge.url}/metrics") as resp:
        text = await resp.text()
    assert 'meshnet_gateway_requests_total{outcome="413"} 2' in text, text[:2000]
