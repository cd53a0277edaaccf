"""Benchmark a local Inference Route against the single-process model, in the same run.

    python bench/route.py [--json] [--hops 2|3] [--runs 5]

Starts nats-server, a tracker and one composite `meshnet node` process serving every hop on
loopback (as `meshnet up` runs a replica: the hops take turns on its one engine thread), and a
plain llama_cpp.Llama of the whole model in this process. Reports medians over the runs
(baseline and route measured side by side, decode in alternating blocks): decode tok/s, prefill tok/s (512-token prompt),
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
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import aiohttp
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from artifacts.bundled import resolve_model  # noqa: E402
from artifacts.gguf_header import read_header  # noqa: E402
from artifacts.layout import balanced_ranges, layer_costs, shard_layout  # noqa: E402
from artifacts.revision import model_revision  # noqa: E402
from bus import runloop, subjects  # noqa: E402
from bus.client import Bus  # noqa: E402
from bus.errors import BusTimeoutError  # noqa: E402
from bus.server import NatsServer  # noqa: E402
from gateway.route_client import RouteClient  # noqa: E402
from schemas.credentials import CREDENTIAL_HEADER  # noqa: E402
from schemas.frames import COLOCATED_CHUNK_SIZE, DEFAULT_CHUNK_SIZE, DEFAULT_WINDOW  # noqa: E402
from schemas.route import RoutePolicy, RouteReply, RouteRequest, RouteSession  # noqa: E402

LAYOUTS = ("compute", "layers")
READY = re.compile(r"serving .* at (http://\S+)")


def hop_ranges(model: Path, hops: int, layout: str = "compute") -> list[tuple[int, int]]:
    """The Shards of a `hops`-hop route: cut where each costs about the same per token, as
    `meshnet up` cuts (artifacts/layout.py), or at equal layer counts (`layers`, a baseline)."""
    header = read_header(model)
    if layout == "layers":
        return balanced_ranges([1] * len(layer_costs(header)[0]), hops)
    return shard_layout(header, hops)


async def spawn_nodes(nats: NatsServer, model: Path, splits: list[tuple[int, int]], args: argparse.Namespace,
                      ) -> tuple[asyncio.subprocess.Process, list[tuple[str, str]]]:
    """Start one node process serving `splits` (a composite node for several hops); return it
    and each hop's (id, URL)."""
    user, password = nats.credentials("node")  # the shared node user: it speaks for every hop's id
    tag = uuid.uuid4().hex[:4]
    ids = [f"bench-{a}-{b}-{tag}" for a, b in splits]
    shards = [flag for (a, b), node_id in zip(splits, ids, strict=True)
              for flag in ("--layers", f"{a}:{b}", "--node-id", node_id)]
    cmd = [sys.executable, "-m", "nodes.main", "--model", str(model), *shards,
           "--nats", nats.url, "--nats-user", user, "--nats-password", password,
           "--threads", str(args.threads), *(["--batch-threads", str(args.batch_threads)] if args.batch_threads else []),
           "--window", str(args.window), "--ctx", "2048",
           "--compression", args.compression, "--wire-dtype", args.wire_dtype, "--log-level", "WARNING",
           *args.node_arg]
    env = {**os.environ, **dict(kv.split("=", 1) for kv in args.node_env)}
    with tempfile.TemporaryFile() as errors:  # the node's stderr: its last lines explain a failed start
        proc = await asyncio.create_subprocess_exec(*cmd, cwd=ROOT, env=env, stdout=asyncio.subprocess.PIPE,
                                                    stderr=errors)
        assert proc.stdout is not None
        urls: dict[str, str] = {}
        while len(urls) < len(ids):
            line = (await proc.stdout.readline()).decode()
            if not line:
                errors.seek(0)
                tail = errors.read()[-2000:].decode(errors="replace")
                raise RuntimeError(f"node process {ids} exited before it was ready; its stderr ends:\n{tail}")
            if m := READY.search(line):
                urls[line.split()[2]] = m.group(1)  # "meshnet node <id> serving ..."
    return proc, [(node_id, urls[node_id]) for node_id in ids]


async def stop_processes(procs: list[asyncio.subprocess.Process], timeout_s: float) -> None:
    """SIGTERM every process, then wait up to timeout_s for each."""
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            p.send_signal(signal.SIGTERM)
    for p in procs:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(p.wait(), timeout_s)


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


class Baseline:
    """Single-process whole model, stepped in blocks so it can alternate with the route.

    Every llama.cpp call, loading included, runs on one thread of its own: libgomp keeps a
    worker pool per calling thread, and a second pool would throttle the baseline's barriers
    (the same trap nodes.server.runner avoids for the nodes)."""

    def __init__(self, llm, pool: ThreadPoolExecutor) -> None:
        self.llm = llm
        self.pool = pool
        self.tok = 0
        self.step_ms: list[float] = []

    async def run(self, fn, *args):
        """Run `fn` on the baseline's own thread."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def prefill(self, prompt: list[int]) -> float:
        """Reset, evaluate the prompt, pick the first token; return the seconds it took."""
        self.llm.reset()
        t0 = time.perf_counter()
        self.llm.eval(prompt)
        self.tok = int(np.argmax(last_logits(self.llm)))
        return time.perf_counter() - t0

    def decode(self, steps: int) -> float:
        """Greedy-decode `steps` tokens; return the seconds it took."""
        t0 = s0 = time.perf_counter()
        for _ in range(steps):
            self.llm.eval([self.tok])
            self.tok = int(np.argmax(last_logits(self.llm)))
            now = time.perf_counter()
            self.step_ms.append((now - s0) * 1e3)
            s0 = now
        return time.perf_counter() - t0


class RouteRun:
    """One Route Session through the nodes, stepped in blocks like the baseline."""

    def __init__(self, rc: RouteClient, mode: str = "run") -> None:
        self.rc = rc
        self.mode = mode  # "run": one Decode Run per block (the head feeds itself); "step": a run of one step per token
        self.tok = 0
        self.step_ms: list[float] = []
        self.hop_compute_ms: list[list[float]] = []  # per step, head first

    async def prefill(self, prompt: list[int]) -> float:
        t0 = time.perf_counter()
        self.tok = (await self.rc.prefill(prompt)).token_id
        return time.perf_counter() - t0

    async def decode(self, steps: int) -> float:
        t0 = s0 = time.perf_counter()
        results = self.rc.decode_run(self.tok, steps) if self.mode == "run" else self._steps(steps)
        async for res in results:
            now = time.perf_counter()
            self.step_ms.append((now - s0) * 1e3)
            s0 = now
            self.hop_compute_ms.append([t.compute_ms for t in res.timings])
            self.tok = res.token_id
        return time.perf_counter() - t0

    async def _steps(self, steps: int):
        for _ in range(steps):
            res = await self.rc.decode(self.tok)
            self.tok = res.token_id
            yield res


async def hop_counters(http: aiohttp.ClientSession, session: RouteSession,
                       nodes: list[tuple[str, str]]) -> list[dict[str, float]]:
    """Each hop's counters for the session, head first (asked with each hop's credential)."""
    out = []
    for i, (_, url) in enumerate(nodes):
        async with http.get(f"{url}/v1/sessions/{session.session_id}",
                            headers={CREDENTIAL_HEADER: session.credentials[i]}) as resp:
            out.append(await resp.json())
    return out


def p90(values: list[float]) -> float:
    """The 90th percentile of `values` (nearest rank)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


async def one_run(http: aiohttp.ClientSession, bus: Bus, model: str, nodes: list[tuple[str, str]],
                  base: Baseline, prompt: list[int], steps: int, args: argparse.Namespace) -> dict[str, float]:
    """Baseline and route side by side: prefill each, then alternate decode blocks of --block steps.

    Alternating short blocks keeps the VM's minute-to-minute drift out of the ratios."""
    session = await open_route(bus, model, [n for n, _ in nodes])
    async with RouteClient(session, http, chunk_size=args.chunk, bus=bus, ramp=args.prefill_plan == "ramp") as rc:
        route = RouteRun(rc, args.decode_mode)
        settle = args.settle_ms / 1e3
        base_prefill = await base.run(base.prefill, prompt)
        await asyncio.sleep(settle)
        route_prefill = await route.prefill(prompt)
        base_decode = route_decode = 0.0
        for done in range(0, steps, args.block):
            n = min(args.block, steps - done)
            await asyncio.sleep(settle)
            base_decode += await base.run(base.decode, n)
            await asyncio.sleep(settle)  # the baseline's OpenMP workers spin on after its last step
            route_decode += await route.decode(n)
        after = await hop_counters(http, session, nodes)
        seam = [st["decode_rx_bytes"] / max(1, st["decode_frames"]) for st in after[1:]]
    step = statistics.median(route.step_ms)
    computes = [sum(hops) for hops in route.hop_compute_ms]  # every token names every hop, head first
    compute, overhead_step = statistics.median(computes), step
    base_steps, base.step_ms = base.step_ms, []
    return {
        "baseline_prefill_tps": len(prompt) / base_prefill,
        "baseline_decode_tps": steps / base_decode,
        "prefill_tps": len(prompt) / route_prefill,
        "decode_tps": steps / route_decode,
        "seam_bytes_per_token": statistics.mean(seam) if seam else 0.0,
        "per_hop_overhead_ms": (overhead_step - compute) / len(nodes),
        "step_ms": step,
        "step_mean_ms": statistics.mean(route.step_ms),
        "step_p90_ms": p90(route.step_ms),
        "compute_ms": compute,
        "compute_mean_ms": statistics.mean(computes),
        "baseline_step_ms": statistics.median(base_steps),
        "baseline_step_mean_ms": statistics.mean(base_steps),
        "baseline_step_p90_ms": p90(base_steps),
        "hop_compute_ms": [statistics.median(col) for col in zip(*route.hop_compute_ms, strict=True)],
        "raw": {"route_step_ms": route.step_ms, "route_hop_compute_ms": route.hop_compute_ms,
                "baseline_step_ms": base_steps},
    }


async def bench(args: argparse.Namespace) -> dict[str, object]:
    """Run the whole benchmark and return its summary."""
    from llama_cpp import Llama

    model = resolve_model(args.model)
    prompt = np.random.default_rng(0).integers(100, 40000, size=args.prompt).tolist()
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="baseline")
    llm = await asyncio.get_running_loop().run_in_executor(pool, lambda: Llama(
        model_path=str(model), n_ctx=2048, n_threads=args.baseline_threads,
        n_threads_batch=args.baseline_threads, n_batch=512, verbose=False))
    ranges = hop_ranges(model, args.hops, args.layout)
    procs: list[asyncio.subprocess.Process] = []
    async with NatsServer.start() as nats:
        tracker = await start_tracker(nats)
        procs.append(tracker)
        user, password = nats.credentials("gateway")
        gbus = await Bus.connect(nats.url, role="gateway", user=user, password=password, name="bench")
        try:
            proc, nodes = await spawn_nodes(nats, model, ranges, args)
            procs.append(proc)
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=2.0)
            async with aiohttp.ClientSession(timeout=timeout) as http:
                base = Baseline(llm, pool)
                await one_run(http, gbus, model_revision(model), nodes, base, prompt[:64], 8, args)  # warm-up
                runs = [await one_run(http, gbus, model_revision(model), nodes, base, prompt, args.decode, args)
                        for _ in range(args.runs)]
        finally:
            await stop_processes(procs, 20)
            await gbus.close()
    await asyncio.get_running_loop().run_in_executor(pool, llm.close)
    pool.shutdown()

    raw = [r.pop("raw") for r in runs]

    def med(key: str) -> float:
        return statistics.median(r[key] for r in runs)

    out: dict[str, object] = {
        "hops": args.hops,
        "runs": args.runs,
        "prompt_tokens": args.prompt,
        "decode_steps": args.decode,
        "block_steps": args.block,
        "decode_mode": args.decode_mode,
        "chunk_size": args.chunk or COLOCATED_CHUNK_SIZE,  # loopback hops: prefill_chunk_size's choice
        "prefill_plan": args.prefill_plan,
        "window": args.window,
        "layers": ranges,
        "node_threads": args.threads,
        "node_batch_threads": args.batch_threads or args.threads,
        "wire_dtype": args.wire_dtype,
        "compression": args.compression,
        "baseline_decode_tps": med("baseline_decode_tps"),
        "baseline_prefill_tps": med("baseline_prefill_tps"),
        "route_decode_tps": med("decode_tps"),
        "route_prefill_tps": med("prefill_tps"),
        "decode_ratio": statistics.median(r["decode_tps"] / r["baseline_decode_tps"] for r in runs),
        "prefill_ratio": statistics.median(r["prefill_tps"] / r["baseline_prefill_tps"] for r in runs),
        "seam_bytes_per_token": med("seam_bytes_per_token"),
        "per_hop_overhead_ms": med("per_hop_overhead_ms"),
        "route_step_ms": med("step_ms"),
        "route_step_mean_ms": med("step_mean_ms"),
        "route_step_p90_ms": med("step_p90_ms"),
        "route_compute_ms": med("compute_ms"),
        "route_compute_mean_ms": med("compute_mean_ms"),
        "baseline_step_ms": med("baseline_step_ms"),
        "baseline_step_mean_ms": med("baseline_step_mean_ms"),
        "baseline_step_p90_ms": med("baseline_step_p90_ms"),
        "route_hop_compute_ms": [round(statistics.median(c), 2) for c in zip(*(r["hop_compute_ms"] for r in runs), strict=True)],
    }
    if args.dump_steps:
        out["raw_steps"] = raw
    return out


def main(argv: list[str] | None = None) -> int:
    """Parse flags, run, print a table or JSON."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true")
    p.add_argument("--hops", type=int, default=2, choices=[1, 2, 3])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--decode", type=int, default=128)
    p.add_argument("--block", type=int, default=16, help="decode steps per alternation block")
    p.add_argument("--decode-mode", default="run", choices=["run", "step"],
                   help="run: one Decode Run per block (the head feeds itself); step: one Decode Run of one step per token (the caller drives)")
    p.add_argument("--dump-steps", default=None, metavar="FILE",
                   help="write every decode step's times (route step, per-hop compute, baseline step) as JSON")
    p.add_argument("--settle-ms", type=float, default=50.0,
                   help="idle pause before each timed block, so one side's leftover OpenMP spinning "
                        "(~10 ms after the baseline's last step, libgomp's default) is not timed on the other")
    p.add_argument("--chunk", type=int, default=None,
                   help=f"prefill tokens per frame (default: the route client's choice for co-located hops, "
                        f"{COLOCATED_CHUNK_SIZE}; across machines it would be {DEFAULT_CHUNK_SIZE})")
    p.add_argument("--prefill-plan", default="ramp", choices=["ramp", "plain"],
                   help="ramp: chunk/4 and chunk/2 at both ends of the prompt (the default); plain: equal chunks")
    p.add_argument("--window", type=int, default=DEFAULT_WINDOW)
    p.add_argument("--layout", default="compute", choices=LAYOUTS,
                   help="cut the model where each hop costs about the same per token (as meshnet up), "
                        "or at equal layer counts")
    p.add_argument("--threads", type=int, default=int(os.environ.get("MESHNET_BENCH_THREADS", "2")))
    p.add_argument("--batch-threads", type=int, default=None,
                   help="node threads for prefill chunks (default: --threads)")
    p.add_argument("--baseline-threads", type=int, default=2)
    p.add_argument("--compression", default="none", choices=["none", "zstd"])
    p.add_argument("--wire-dtype", default="f32", choices=["f32", "f16", "bf16"])
    p.add_argument("--model", default=None)
    p.add_argument("--node-env", action="append", default=[], metavar="K=V",
                   help="extra environment for the node processes (repeatable)")
    p.add_argument("--node-arg", action="append", default=[], metavar="ARG",
                   help="extra `meshnet node` argument, e.g. --node-arg=--inline-rows=0 (repeatable)")
    args = p.parse_args(argv)
    out = runloop.run(bench(args))
    if args.dump_steps:
        Path(args.dump_steps).write_text(json.dumps(out.pop("raw_steps")))
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for k, v in out.items():
            print(f"{k:>24}: {v:.3f}" if isinstance(v, float) else f"{k:>24}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
