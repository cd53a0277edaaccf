"""`meshnet up` as a user runs it: a real subprocess tree, a real chat request, Ctrl-C."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import aiohttp
import pytest

from meshnet.up import free_port, split_layers


@pytest.mark.parametrize(
    ("n_layer", "n_nodes", "expected"),
    [
        (30, 1, [(0, 30)]),
        (30, 2, [(0, 15), (15, 30)]),
        (30, 4, [(0, 8), (8, 16), (16, 23), (23, 30)]),
    ],
)
def test_split_layers_is_contiguous_and_balanced(n_layer, n_nodes, expected) -> None:
    assert split_layers(n_layer, n_nodes) == expected


def test_split_layers_rejects_impossible_counts() -> None:
    with pytest.raises(ValueError):
        split_layers(30, 0)
    with pytest.raises(ValueError):
        split_layers(30, 31)


async def _wait_for_banner(proc: asyncio.subprocess.Process) -> list[str]:
    lines: list[str] = []
    assert proc.stdout is not None
    while raw := await proc.stdout.readline():
        lines.append(raw.decode().rstrip())
        if "Meshnet is up" in lines[-1]:
            return lines
    raise AssertionError("meshnet up exited before it was ready:\n" + "\n".join(lines[-40:]))


async def test_meshnet_up_serves_a_chat_and_stops_cleanly() -> None:
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "meshnet.cli", "up", "--nodes", "2", "--port", str(port),
        "--nats-port", "0", "--quiet",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        lines = await _wait_for_banner(proc)
        assert any("node-1 serving" in line for line in lines)
        body = {"model": "smollm2-135m-instruct", "max_tokens": 8,
                "messages": [{"role": "user", "content": "Say hi"}]}
        async with aiohttp.ClientSession() as http:
            async with http.get(f"http://127.0.0.1:{port}/v1/models") as r:
                ids = [m["id"] for m in (await r.json())["data"]]
            assert ids == ["smollm2-135m-instruct"]
            async with http.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body) as r:
                assert r.status == 200, await r.text()
                data = await r.json()
                assert r.headers["x-route-session-id"]
        assert data["usage"]["completion_tokens"] >= 1
        assert data["choices"][0]["message"]["content"]
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGINT)
        out = (await proc.stdout.read()).decode()
        await proc.wait()
    assert proc.returncode == 0, out[-2000:]
    assert "[up] stopped" in out
