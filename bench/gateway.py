"""End-to-end time to first token and decode tok/s through the gateway vs. plain llama.cpp.

    python bench/gateway.py [--json] [--runs 7] [--max-tokens 128] [--node-threads N] [--token-flush-ms 50]

Starts nats-server, the tracker, two `meshnet node` processes ([0,15) and [15,30)) and a
`meshnet gateway` process, and loads the baseline (single-process llama.cpp, the whole
bundled model, on one thread of its own). Each run then measures, back to back (every
other run in the reverse order), so the VM's drift lands on all three:
1. the mesh: an HTTP client streams one chat completion (SSE) through the gateway;
2. the same route driven directly with RouteClient (no gateway), to show the gateway's
   own share of the cost;
3. the baseline on the same prompt token ids, greedy, for as many tokens as the gateway
   produced.
The first run warms up and is not counted.

TTFT is request start → first content chunk (gateway) and prompt eval start → first
token (baseline). Decode tok/s is (tokens - 1) / (last token time - first token time).
Medians over --runs; ratios against the baseline of the same invocation
(`decode_ratio_per_run`: each run's gateway over its own baseline, to show the spread).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp
import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from artifacts.bundled import bundled_model_path  # noqa: E402
from bus.client import Bus  # noqa: E402
from bus.server import NatsServer, free_port  # noqa: E402
from gateway.settings import DEFAULT_TOKEN_FLUSH_MS  # noqa: E402
from gateway.tokenizer import ModelTokenizer  # noqa: E402
from tracker.service import Tracker, TrackerConfig  # noqa: E402

SYSTEM = (
    "You are a careful assistant. You answer with plain text, no markdown. When asked to "
    "count, you write every number, separated by commas, and you never skip a number. "
    "You do not add commentary before or after the list. "
) * 3
SETTLE_S = 0.05  # idle pause between measured parts: the baseline's OpenMP worker spins ~12 ms after its last step
MESSAGES = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "Count from 1 to 500, separated by commas."},
]


class Baseline:
    """Single-process llama.cpp on one thread of its own (libgomp keeps a worker pool per
    calling thread; loading and evaluating on one thread keeps it to one pool)."""

    def __init__(self, model: Path, threads: int) -> None:
        self.model = model
        self.threads = threads
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="baseline")
        self.llm: Any = None

    async def _run(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def load(self) -> None:
        await self._run(self._load)

    def _load(self) -> None:
        import llama_cpp

        self.llm = llama_cpp.Llama(model_path=str(self.model), n_ctx=2048, n_threads=self.threads,
                                   n_threads_batch=self.threads, n_batch=512, verbose=False)

    async def generate(self, prompt: list[int], n_tokens: int, eog: frozenset[int]) -> tuple[float, float]:
        """Greedy: (TTFT seconds, decode tok/s)."""
        return await self._run(self._generate, prompt, n_tokens, eog)

    def _generate(self, prompt: list[int], n_tokens: int, eog: frozenset[int]) -> tuple[float, float]:
        import numpy as np

        llm = self.llm
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        t_first = time.perf_counter()
        for _ in range(n_tokens - 1):
            llm.eval([token])
            token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            _ = token in eog  # the same per-token check the gateway makes
        t_last = time.perf_counter()
        return t_first - t0, (n_tokens - 1) / (t_last - t_first)

    async def close(self) -> None:
        if self.llm is not None:
            await self._run(self.llm.close)
        self.pool.shutdown(wait=True)


async def one_request(http: aiohttp.ClientSession, url: str, model: str,
                      max_tokens: int) -> tuple[float, float, int]:
    """(ttft seconds, decode tok/s, completion tokens) of one streamed completion."""
    body = {"model": model, "messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = last = 0.0
    n_chunks = 0
    usage = 0
    async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for raw in resp.content:
            if not raw.startswith(b"data: {"):
                continue
            chunk = orjson.loads(raw[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]["completion_tokens"]
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                now = time.perf_counter()
                first = first or now
                last = now
                n_chunks += 1
    return first - t0, (usage - 1) / (last - first), usage


def spawn(log: Path, command: str, *args: str) -> subprocess.Popen[bytes]:
    """Start `meshnet <command> args` with its output in `log`."""
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "meshnet.cli", command, *args, "--log-level", "WARNING"],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
        )


async def measure(model: Path, prompt: list[int], runs: int, max_tokens: int, node_threads: int | None,
                  chunk_size: int | None, flush_ms: int, base: Baseline, eog: frozenset[int]) -> dict[str, Any]:
    """Start a 2-node mesh and a gateway; per run a gateway request, the direct route and the
    baseline; medians of TTFT (ms) and decode tok/s for each."""
    tmp = Path(tempfile.mkdtemp(prefix="meshnet-bench-"))
    procs: list[subprocess.Popen[bytes]] = []
    async with NatsServer.start(store_dir=tmp / "js") as srv:
        bus = await Bus.connect(srv.url, role="tracker", name="bench-tracker")
        async with Tracker(bus, TrackerConfig()):
            threads = ["--threads", str(node_threads)] if node_threads else []
            for name, layers in (("bench-head", "0:15"), ("bench-tail", "15:30")):
                procs.append(spawn(tmp / f"{name}.log", "node", "--model", str(model),
                                   "--layers", layers, "--port", "0", "--nats", srv.url,
                                   "--node-id", name, *threads))
            port = free_port()
            chunk = ["--chunk-size", str(chunk_size)] if chunk_size else []
            procs.append(spawn(tmp / "gateway.log", "gateway", "--port", str(port), "--nats",
                               srv.url, "--model", str(model), "--token-flush-ms", str(flush_ms), *chunk))
            url = f"http://127.0.0.1:{port}"
            try:
                async with aiohttp.ClientSession() as http:
                    model_id = await _wait_ready(http, url, procs, tmp)
                    await base.load()
                    results, direct, baseline = [], [], []
                    n_tokens = 0
                    for i in range(runs + 1):
                        # gateway, direct route, baseline; every other run in reverse order, so
                        # the VM's drift within a run does not always favour the same side
                        # (greedy: every run makes the warm-up's number of tokens)
                        for part in ("gateway", "direct", "baseline")[::-1 if i % 2 else 1]:
                            await asyncio.sleep(SETTLE_S)
                            if part == "gateway":
                                results.append(await one_request(http, url, model_id, max_tokens))
                                n_tokens = n_tokens or results[-1][2]
                            elif part == "direct":
                                direct.append(await direct_route(srv.url, http, model, prompt, n_tokens, flush_ms))
                            else:
                                baseline.append(await base.generate(prompt, n_tokens, eog))
            finally:
                for p in procs:
                    p.terminate()
                for p in procs:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        p.wait(timeout=20)
        await bus.close()
    results, direct, baseline = results[1:], direct[1:], baseline[1:]  # the first run warms up
    return {
        "baseline_ttft_ms": statistics.median(r[0] for r in baseline) * 1e3,
        "baseline_decode_tok_s": statistics.median(r[1] for r in baseline),
        "ttft_ms": statistics.median(r[0] for r in results) * 1e3,
        "decode_tok_s": statistics.median(r[1] for r in results),
        "completion_tokens": min(r[2] for r in results),
        "route_ttft_ms": statistics.median(r[0] for r in direct) * 1e3,
        "route_decode_tok_s": statistics.median(r[1] for r in direct),
        "run_ratios": [round(r[1] / b[1], 3) for r, b in zip(results, baseline, strict=True)],
    }


async def direct_route(nats_url: str, http: aiohttp.ClientSession, model: Path,
                       prompt: list[int], n_tokens: int, flush_ms: int) -> tuple[float, float]:
    """The same greedy session driven by RouteClient directly (no gateway), decoding with one
    Decode Run as the gateway does (same token flush interval): TTFT s, tok/s."""
    from artifacts.revision import model_revision
    from bus import subjects
    from gateway.route_client import RouteClient
    from schemas.route import RouteReply, RouteRequest

    bus = await Bus.connect(nats_url, role="gateway", name="bench-direct")
    try:
        t0 = time.perf_counter()
        reply = await bus.request(subjects.ROUTE_CREATE, RouteRequest(
            model=model_revision(model), prompt_tokens=len(prompt)), RouteReply, timeout=5.0)
        assert reply.session is not None, reply.error
        async with RouteClient(reply.session, http, bus=bus) as rc:
            first = await rc.prefill(prompt)
            t_first = time.perf_counter()
            async for _ in rc.decode_run(first.token_id, n_tokens - 1, flush_ms=flush_ms):
                pass
            t_last = time.perf_counter()
    finally:
        await bus.close()
    return t_first - t0, (n_tokens - 1) / (t_last - t_first)


async def _wait_ready(http: aiohttp.ClientSession, url: str, procs: list[subprocess.Popen[bytes]],
                      logs: Path) -> str:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError(f"a mesh process exited; logs in {logs}")
        with contextlib.suppress(aiohttp.ClientError):
            async with http.get(f"{url}/healthz") as resp:
                if resp.status == 200:
                    return str((await resp.json())["model"])
        await asyncio.sleep(0.25)
    raise RuntimeError(f"the mesh did not become routable; logs in {logs}")


async def _measure(model: Path, prompt: list[int], args: argparse.Namespace,
                   eog: frozenset[int]) -> dict[str, Any]:
    base = Baseline(model, args.baseline_threads)
    try:
        return await measure(model, prompt, args.runs, args.max_tokens, args.node_threads,
                             args.chunk_size, args.token_flush_ms, base, eog)
    finally:
        await base.close()


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print a table or JSON."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--node-threads", type=int, default=None, help="threads per node (default: node's)")
    p.add_argument("--baseline-threads", type=int, default=os.cpu_count() or 2)
    p.add_argument("--chunk-size", type=int, default=None, help="gateway prefill chunk size")
    p.add_argument("--token-flush-ms", type=int, default=DEFAULT_TOKEN_FLUSH_MS,
                   help="the gateway's --token-flush-ms (0: every token sent as it comes)")
    args = p.parse_args(argv)

    model = bundled_model_path()
    tok = ModelTokenizer(model)
    prompt = tok.encode_chat(MESSAGES)
    mesh = asyncio.run(_measure(model, prompt, args, tok.eog_ids))
    n = mesh["completion_tokens"]
    base = {"ttft_ms": mesh["baseline_ttft_ms"], "decode_tok_s": mesh["baseline_decode_tok_s"]}
    out = {
        "runs": args.runs,
        "prompt_tokens": len(prompt),
        "completion_tokens": n,
        "node_threads": args.node_threads,
        "baseline_threads": args.baseline_threads,
        "token_flush_ms": args.token_flush_ms,
        "baseline_ttft_ms": round(base["ttft_ms"], 2),
        "baseline_decode_tok_s": round(base["decode_tok_s"], 2),
        "gateway_ttft_ms": round(mesh["ttft_ms"], 2),
        "gateway_decode_tok_s": round(mesh["decode_tok_s"], 2),
        "ttft_overhead_ms": round(mesh["ttft_ms"] - base["ttft_ms"], 2),
        "decode_ratio": round(mesh["decode_tok_s"] / base["decode_tok_s"], 3),
        # the same route driven without the gateway: what the gateway itself costs
        "route_ttft_ms": round(mesh["route_ttft_ms"], 2),
        "route_decode_tok_s": round(mesh["route_decode_tok_s"], 2),
        "gateway_vs_route_decode": round(mesh["decode_tok_s"] / mesh["route_decode_tok_s"], 3),
        # each run's gateway decode over the baseline measured right after it: the spread
        "decode_ratio_per_run": mesh["run_ratios"],
    }
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k:>24}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
