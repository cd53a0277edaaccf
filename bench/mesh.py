"""A `meshnet up`-style mesh for benchmarks: nats-server, tracker, nodes and gateway processes.

    async with local_mesh(model, logs=Path(...), node_args=[...], gateway_args=[...]) as mesh:
        ...  # HTTP against mesh.url, model name mesh.model_id

Every process runs in a session of its own (a terminal's Ctrl-C reaches only the benchmark,
which then stops them in order) and is stopped when the block exits, however it exits:
SIGTERM, a bounded wait, then SIGKILL for any that is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from bus.server import NatsServer, free_port

ROOT = Path(__file__).resolve().parent.parent
TWO_SHARDS = ((0, 15), (15, 30))
STOP_WAIT_S = 20.0


@dataclass(slots=True)
class Mesh:
    """A running mesh: where its gateway listens and what it serves."""

    url: str
    model_id: str
    nats_url: str
    logs: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)


def spawn(log: Path, command: str, *args: str) -> subprocess.Popen[bytes]:
    """Start `meshnet <command> args` in a session of its own, output in `log`."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "meshnet.cli", command, *args],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=env, start_new_session=True,
        )


def stop_all(procs: Sequence[subprocess.Popen[bytes]], wait_s: float = STOP_WAIT_S) -> None:
    """SIGTERM every process (last started first), wait up to `wait_s`, SIGKILL the rest."""
    try:
        for p in reversed(procs):
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + wait_s
        for p in reversed(procs):
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@contextlib.asynccontextmanager
async def local_mesh(
    model: Path,
    *,
    logs: Path,
    shards: Sequence[tuple[int, int]] = TWO_SHARDS,
    node_args: Sequence[str] = (),
    gateway_args: Sequence[str] = (),
    tracker_args: Sequence[str] = (),
    log_level: str = "WARNING",
    ready_timeout_s: float = 300.0,
    composite: bool = False,
) -> AsyncIterator[Mesh]:
    """Start nats-server, `meshnet tracker`, one `meshnet node` per shard (`composite`: one
    composite node process serving them all, as `meshnet up` runs a replica) and `meshnet
    gateway`; yield once the gateway's /healthz answers 200 (a full route exists); stop them
    all on exit. The *_args are appended to each command line as given; logs (an existing
    directory) gets one log file per process."""
    async with NatsServer.start(store_dir=logs / "js") as srv:
        nats = ["--nats", srv.url]
        level = ["--log-level", log_level]
        port = free_port()
        mesh = Mesh(url=f"http://127.0.0.1:{port}", model_id="", nats_url=srv.url, logs=logs)
        try:
            mesh.procs.append(spawn(logs / "tracker.log", "tracker", *nats, *level, *tracker_args))
            each = [["--layers", f"{a}:{b}", "--node-id", f"bench-node-{i}"] for i, (a, b) in enumerate(shards)]
            for i, shard in enumerate([[a for s in each for a in s]] if composite else each):
                mesh.procs.append(spawn(logs / f"node-{i}.log", "node", "--model", str(model), *shard,
                                        "--port", "0", *nats, *level, *node_args))
            mesh.procs.append(spawn(
                logs / "gateway.log", "gateway", "--port", str(port), "--model", str(model),
                *nats, *level, *gateway_args))
            mesh.model_id = await wait_ready(mesh, ready_timeout_s)
            yield mesh
        finally:
            stop_all(mesh.procs)


async def wait_ready(mesh: Mesh, timeout_s: float, *, nodes: int = 0) -> str:
    """Poll the gateway's /healthz until it answers 200 and lists at least `nodes` routable
    nodes (every replica up, so the first requests spread over them); the model id it serves."""
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline:
            dead = [p.args[3] for p in mesh.procs if p.poll() is not None]
            if dead:
                raise RuntimeError(f"mesh process(es) {dead} exited; logs in {mesh.logs}")
            with contextlib.suppress(aiohttp.ClientError):
                async with http.get(f"{mesh.url}/healthz") as resp:
                    body = await resp.json() if resp.status == 200 else None
                    if body is not None and len(body["nodes"]) >= nodes:
                        return str(body["model"])
            await asyncio.sleep(0.25)
    raise RuntimeError(f"the mesh had no full route (of {nodes} nodes at least) after {timeout_s:.0f} s; logs in {mesh.logs}")
