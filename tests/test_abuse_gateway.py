"""Abuse of the gateway's edge: pathological requests stay cheap and never stall other streams."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import orjson
import pytest

from tests.fixtures.faults import FaultRelay
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


async def _raw_post(url: str, path: str, head_body: bytes, length: int) -> tuple[asyncio.StreamReader,
                                                                                asyncio.StreamWriter]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {length}\r\n\r\n".encode() + head_body)
    await writer.drain()
    return reader, writer


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
async def test_a_body_that_never_arrives_is_a_408_and_frees_the_connection(
        edge: Edge, http: aiohttp.ClientSession, path: str) -> None:  # noqa: F811
    """3,000 connections that announced a body and never sent it were once held for good; a
    /tokenize whose body never came was held until the client left."""
    await _ready(edge, http)
    reader, writer = await _raw_post(edge.url, path, b'{"model": ', 1000)
    try:
        async with asyncio.timeout(30):  # a guard: the gateway answers after its 0.5 s body timeout
            status_line = await reader.readline()
            rest = await reader.read()
    finally:
        writer.close()
    assert status_line.split()[1] == b"408", status_line
    assert b"body_timeout" in rest and b"stalled" in rest


async def test_a_body_that_trickles_below_the_floor_is_a_408(edge: Edge, http: aiohttp.ClientSession) -> None:  # noqa: F811
    """10 bytes every 0.05 s is never silent for the 0.5 s body timeout, but at 200 bytes/s it
    is below the 1,000 bytes/s floor: cut once its grace is spent, not held for the 50 s its
    10,000 bytes would take."""
    await _ready(edge, http)
    reader, writer = await _raw_post(edge.url, "/v1/chat/completions", b"", 10_000)

    async def drip() -> None:
        for _ in range(1000):
            writer.write(b" " * 10)
            await asyncio.sleep(0.05)

    dripping = asyncio.create_task(drip())
    try:
        async with asyncio.timeout(30):  # a guard: cut ~0.6 s after its head
            status_line = await reader.readline()
            rest = await reader.read()
    finally:
        dripping.cancel()
        writer.close()
    assert status_line.split()[1] == b"408", status_line
    assert b"body_timeout" in rest and b"slower than 1000 bytes/s" in rest


async def test_a_body_over_a_slow_link_is_read_however_long_it_takes(
        edge: Edge, http: aiohttp.ClientSession) -> None:  # noqa: F811
    """A 40 KB chat request (its JSON padded with spaces) crosses a 0.05 Mbit/s link to a
    gateway whose body timeout is 0.5 s: ~4 s past the link's 16 KB burst, a segment every ~0.23 s. Its bytes keep coming,
    so it is answered; one deadline from its head made it a 408 body_timeout."""
    await _ready(edge, http)
    edge.script.tokens = _byte_tokens(edge.tokenizer, "Paris.")
    body = orjson.dumps({"model": "bundled", "messages": [{"role": "user", "content": "Capital of France?"}],
                         "max_tokens": 6}) + b" " * 40_000
    host, port = edge.url.removeprefix("http://").rsplit(":", 1)
    async with FaultRelay(host, int(port), 0.0, rate_mbit=0.05) as relay:  # bytes arrive a segment at a time
        t0 = time.monotonic()
        async with http.post(f"http://{relay.address}/v1/chat/completions", data=body,
                             headers={"Content-Type": "application/json"}) as resp:
            status, raw = resp.status, await resp.read()
        took = time.monotonic() - t0
    assert status == 200, raw
    assert orjson.loads(raw)["choices"][0]["message"]["content"] == "Paris."
    assert took > 2.0, took  # the body did take longer than the body timeout


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
