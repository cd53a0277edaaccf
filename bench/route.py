"""Benchmark a local Inference Route against the single-process model, in the same run.

    python bench/route.py [--json] [--hops 2|3] [--runs 5]

Starts nats-server, a tracker and one `meshnet node` process per hop on loopback, and a
plain llama_cpp.Llama of the whole model in this process. Reports medians over the runs
(baseline and route measured alternately): decode tok/s, prefill tok/s (512-token prompt),
their ratios to the single process, seam bytes per decode step and per-hop overhead.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import signal
import statistics
import sys
import time
import uuid
from pathlib import Path

import aiohttp
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from artifacts.bundled import resolve_model  # noqa: E402
from artifacts.revision import model_revision  # noqa: E402
from bus import runloop, subjects  # noqa: E402
from bus.client import Bus  # noqa: E402
from bus.errors import BusTimeoutError  # noqa: E402
from bus.server import NatsServer  # noqa: E402
from gateway.route_client import RouteClient  # noqa: E402
from schemas.frames import DEFAULT_CHUNK_SIZE, DEFAULT_WINDOW  # noqa: E402
from schemas.route import RoutePolicy, RouteReply, RouteRequest, RouteSession  # noqa: E402

SPLITS = {1: [(0, 30)], 2: [(0, 15), (15, 30)], 3: [(0, 10), (10, 20), (20, 30)]}
READY = re.compile(r"serving .* at (http://\S+)")


async def spawn_node(nats: NatsServer, model: Path, layers: tuple[int, int], args: argparse.Namespace,
                     ) -> tuple[asyncio.subprocess.Process, str, str]:
    """Start one node process; return it, its id and its URL."""
    node_id = f"bench-{layers[0]}-{layers[1]}-{uuid.uuid4().hex[:4]}"
    user, password = nats.credentials("node")
    cmd = [sys.executable, "-m", "nodes.main", "--model", str(model), "--layers", f"{layers[0]}:{layers[1]}",
           "--node-id", node_id, "--nats", nats.url, "--nats-user", user, "--nats-password", password,
           "--threads", str(args.threads), *(["--batch-threads", str(args.batch_threads)] if args.batch_threads else []),
           "--window", str(args.window), "--ctx", "2048",
           "--compression", args.compression, "--wire-dtype", args.wire_dtype, "--log-level", "WARNING"]
    env = {**os.environ, **dict(kv.split("=", 1) for kv in args.node_env)}
    proc = await asyncio.create_subprocess_exec(*cmd, cwd=ROOT, env=env, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.DEVNULL)
    assert proc.stdout is not None
    while True:
        line = (await proc.stdout.readline()).decode()
        if not line:
            raise RuntimeError(f"node {node_id} exited before it was ready")
        if m := READY.search(line):
            return proc, node_id, m.group(1)


async def start_tracker(nats: NatsServer) -> asyncio.subprocess.Process:
    """A `meshnet tracker` process on the bench's nats-server."""
    user, password = nats.credentials("tracker")
    cmd = [sys.executable, "-m", "meshnet.cli", "tracker", "--nats", nats.url, "--nats-user", user,
           "--nats-password", password, "--log-level", "warning"]
    return await asyncio.create_subprocess_exec(*cmd, cwd=ROOT, stdout=asyncio.subprocess.DEVNULL,
                                                stderr=asyncio.subprocess.DEVNULL)


async def open_route(bus: Bus, model: str, node_ids: list[str]) -> RouteSession:
    """Ask the tracker for a route through exactly these nodes (retry while they announce)."""
    req = RouteRequest(model=model, policy=RoutePolicy(kind="private", allow_nodes=node_ids))
    for _ in range(300):
        try:
            reply = await bus.request(subjects.ROUTE_CREATE, req, RouteReply, timeout=5.0)
        except BusTimeoutError:  # the tracker is still starting
            await asyncio.sleep(0.1)
            continue
        if reply.session is not None and [h.node_id for h in reply.session.hops] == node_ids:
            return reply.session
        await asyncio.sleep(0.1)
    raise RuntimeError(f"no route through {node_ids}")


def last_logits(llm) -> np.ndarray:
    """Logits of the last evaluated token of a llama_cpp.Llama (without logits_all)."""
    import llama_cpp

    ptr = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
    return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),))


def baseline(llm, prompt: list[int], steps: int) -> dict[str, float]:
    """Single-process whole model: prefill tok/s of the prompt, greedy decode tok/s."""
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(prompt)
    tok = int(np.argmax(last_logits(llm)))
    prefill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(steps):
        llm.eval([tok])
        tok = int(np.argmax(last_logits(llm)))
    decode_s = time.perf_counter() - t0
    return {"prefill_tps": len(prompt) / prefill_s, "decode_tps": steps / decode_s}


async def route_run(http: aiohttp.ClientSession, bus: Bus, model: str, nodes: list[tuple[str, str]],
                    prompt: list[int], steps: int, chunk: int) -> dict[str, float]:
    """One session through the route: prefill tok/s, decode tok/s, seam bytes, overhead."""
    session = await open_route(bus, model, [n for n, _ in nodes])
    async with RouteClient(session, http, chunk_size=chunk, bus=bus) as rc:
        t0 = time.perf_counter()
        tok = (await rc.prefill(prompt)).token_id
        prefill_s = time.perf_counter() - t0
        step_ms: list[float] = []
        compute_ms: list[float] = []
        t0 = time.perf_counter()
        for _ in range(steps):
            s0 = time.perf_counter()
            res = await rc.decode(tok)
            step_ms.append((time.perf_counter() - s0) * 1e3)
            compute_ms.append(sum(t.compute_ms for t in res.timings))
            tok = res.token_id
        decode_s = time.perf_counter() - t0
        seam = []
        for _, url in nodes[1:]:
            async with http.get(f"{url}/v1/sessions/{session.session_id}") as resp:
                st = await resp.json()
            seam.append(st["decode_rx_bytes"] / max(1, st["decode_frames"]))
    hops = len(nodes)
    return {
        "prefill_tps": len(prompt) / prefill_s,
        "decode_tps": steps / decode_s,
        "seam_bytes_per_token": statistics.mean(seam) if seam else 0.0,
        "per_hop_overhead_ms": (statistics.median(step_ms) - statistics.median(compute_ms)) / hops,
        "step_ms": statistics.median(step_ms),
        "compute_ms": statistics.median(compute_ms),
    }


async def bench(args: argparse.Namespace) -> dict[str, object]:
    """Run the whole benchmark and return its summary."""
    from llama_cpp import Llama

    model = resolve_model(args.model)
    prompt = np.random.default_rng(0).integers(100, 40000, size=args.prompt).tolist()
    llm = Llama(model_path=str(model), n_ctx=2048, n_threads=args.baseline_threads,
                n_threads_batch=args.baseline_threads, n_batch=512, verbose=False)
    procs: list[asyncio.subprocess.Process] = []
    async with NatsServer.start() as nats:
        tracker = await start_tracker(nats)
        procs.append(tracker)
        user, password = nats.credentials("gateway")
        gbus = await Bus.connect(nats.url, role="gateway", user=user, password=password, name="bench")
        try:
            nodes = []
            for layers in SPLITS[args.hops]:
                proc, node_id, url = await spawn_node(nats, model, layers, args)
                procs.append(proc)
                nodes.append((node_id, url))
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=2.0)
            async with aiohttp.ClientSession(timeout=timeout) as http:
                await route_run(http, gbus, model_revision(model), nodes, prompt[:64], 8, args.chunk)  # warm-up
                await asyncio.to_thread(baseline, llm, prompt[:64], 8)
                base_runs, route_runs = [], []
                for _ in range(args.runs):
                    base_runs.append(await asyncio.to_thread(baseline, llm, prompt, args.decode))
                    route_runs.append(await route_run(http, gbus, model_revision(model), nodes, prompt,
                                                      args.decode, args.chunk))
        finally:
            for p in procs:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signal.SIGTERM)
            for p in procs:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(p.wait(), 20)
            await gbus.close()
    llm.close()

    def med(runs: list[dict[str, float]], key: str) -> float:
        return statistics.median(r[key] for r in runs)

    out: dict[str, object] = {
        "hops": args.hops,
        "runs": args.runs,
        "prompt_tokens": args.prompt,
        "decode_steps": args.decode,
        "chunk_size": args.chunk,
        "window": args.window,
        "node_threads": args.threads,
        "node_batch_threads": args.batch_threads or args.threads,
        "wire_dtype": args.wire_dtype,
        "compression": args.compression,
        "baseline_decode_tps": med(base_runs, "decode_tps"),
        "baseline_prefill_tps": med(base_runs, "prefill_tps"),
        "route_decode_tps": med(route_runs, "decode_tps"),
        "route_prefill_tps": med(route_runs, "prefill_tps"),
        "decode_ratio": statistics.median(r["decode_tps"] / b["decode_tps"] for r, b in zip(route_runs, base_runs, strict=False)),
        "prefill_ratio": statistics.median(r["prefill_tps"] / b["prefill_tps"] for r, b in zip(route_runs, base_runs, strict=False)),
        "seam_bytes_per_token": med(route_runs, "seam_bytes_per_token"),
        "per_hop_overhead_ms": med(route_runs, "per_hop_overhead_ms"),
        "route_step_ms": med(route_runs, "step_ms"),
        "route_compute_ms": med(route_runs, "compute_ms"),
    }
    return out


def main(argv: list[str] | None = None) -> int:
    """Parse flags, run, print a table or JSON."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true")
    p.add_argument("--hops", type=int, default=2, choices=[1, 2, 3])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--decode", type=int, default=64)
    p.add_argument("--chunk", type=int, default=DEFAULT_CHUNK_SIZE)
    p.add_argument("--window", type=int, default=DEFAULT_WINDOW)
    p.add_argument("--threads", type=int, default=int(os.environ.get("MESHNET_BENCH_THREADS", "2")))
    p.add_argument("--batch-threads", type=int, default=None, help="node threads for prefill chunks")
    p.add_argument("--baseline-threads", type=int, default=2)
    p.add_argument("--compression", default="none", choices=["none", "zstd"])
    p.add_argument("--wire-dtype", default="f32", choices=["f32", "f16", "bf16"])
    p.add_argument("--model", default=None)
    p.add_argument("--node-env", action="append", default=[], metavar="K=V",
                   help="extra environment for the node processes (repeatable)")
    args = p.parse_args(argv)
    if args.batch_threads is None:  # co-located hops overlap in prefill: split the cores between them
        args.batch_threads = max(1, (os.cpu_count() or 2) // args.hops)
    out = runloop.run(bench(args))
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for k, v in out.items():
            print(f"{k:>24}: {v:.3f}" if isinstance(v, float) else f"{k:>24}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
