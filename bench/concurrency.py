"""Many users at once: aggregate tok/s of C streaming clients through the mesh vs. llama.cpp
decoding C sequences as one batch.

    python bench/concurrency.py [--json] [--levels 1,4,8,16] [--requests 4] [--max-tokens 128]
        [--node-arg=--kv-memory=2G ...] [--gateway-arg=--max-queue=64 ...] [--baseline-only]

Starts a `meshnet up`-style mesh (bench/mesh.py: nats-server, tracker, two `meshnet node`
processes [0,15) and [15,30) of the bundled model, the `meshnet gateway` process) and loads
the baseline: single-process llama.cpp, the whole model, on as many threads as a node uses,
on one thread of its own. For each concurrency level C, one after the other, with a settle
pause between (every other level in the reverse order, so the VM's drift lands on both):

1. the mesh: C clients, each streaming --requests chat completions one after another
   (SSE, temperature 0, --max-tokens each, every request with a prompt of its own);
2. the baseline: --requests rounds, each prefilling the same C chat-templated prompts
   (the gateway's token ids) and then decoding the C sequences as ONE llama_decode batch
   per step (one seq id each, greedy argmax per sequence, --max-tokens tokens each, end of
   generation ignored).

Per level: aggregate_tps = completion tokens of all requests / the level's wall time (the
clients' first request start to the last one's end, so it includes every prefill and TTFT);
baseline_aggregate_tps = C * tokens per round / (prefill + decode time), summed over rounds,
and `ratio` = aggregate_tps / baseline_aggregate_tps (end to end, prefill in both);
baseline_decode_only_tps = C * (tokens - 1) / decode time (the first token comes from the
prefill). TTFT is request start → first content chunk; a stream's decode tok/s is
(tokens - 1) / (last content chunk - first content chunk). `errors` counts non-200 answers,
error chunks and failed connections; `http_503` counts the 503s among them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import orjson

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from artifacts.bundled import bundled_model_path  # noqa: E402
from bench.mesh import local_mesh  # noqa: E402
from nodes.llama_engine import prepare_llama_runtime  # noqa: E402

SYSTEM = (
    "You are a careful assistant. You answer with plain text, no markdown. When asked to "
    "count, you write every number, separated by commas, and you never skip a number. "
    "You do not add commentary before or after the list."
)
N_BATCH = 512  # baseline prefill tokens per llama_decode (a node's n_batch)
MAX_ERROR_SAMPLES = 5
WARMUP_TOKENS = 16


def messages_for(k: int) -> list[dict[str, str]]:
    """The k-th request's chat: a count to 500 (long enough not to end within the token
    budget), behind a ticket number of its own, so no two requests (or sessions) share a
    prompt past the chat template's first tokens."""
    return [
        {"role": "system", "content": f"Ticket {4001 + 7 * k}. {SYSTEM}"},
        {"role": "user", "content": "Count from 1 to 500, separated by commas."},
    ]


# -- the mesh side ---------------------------------------------------------------------------


@dataclass(slots=True)
class RequestResult:
    """One streamed completion as the client saw it (times in seconds from its start)."""

    status: int
    tokens: int = 0
    ttft: float | None = None
    first: float = 0.0
    last: float = 0.0
    error: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None

    @property
    def stream_tps(self) -> float | None:
        """(tokens - 1) / (last - first content chunk); None when it cannot be measured."""
        if not self.ok or self.tokens < 2 or self.last <= self.first:
            return None
        return (self.tokens - 1) / (self.last - self.first)


def _error_of(status: int, body: Any) -> dict[str, Any]:
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict):
        return {"status": status, "code": None, "message": str(body)[:200]}
    return {"status": status, "code": err.get("code"), "message": str(err.get("message"))[:200]}


async def one_request(http: aiohttp.ClientSession, url: str, model: str, messages: list[dict[str, str]],
                      max_tokens: int) -> RequestResult:
    """Stream one chat completion; HTTP errors and error chunks are returned, not raised."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    try:
        async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
            if resp.status != 200:
                raw = await resp.read()
                try:
                    parsed: Any = orjson.loads(raw)
                except orjson.JSONDecodeError:
                    parsed = raw.decode("utf-8", "replace")
                return RequestResult(resp.status, error=_error_of(resp.status, parsed))
            out = RequestResult(200)
            async for line in resp.content:
                if not line.startswith(b"data: {"):
                    continue
                chunk = orjson.loads(line[6:])
                if "error" in chunk:
                    out.error = _error_of(200, chunk)
                    continue
                if chunk.get("usage"):
                    out.tokens = int(chunk["usage"]["completion_tokens"])
                if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                    now = time.perf_counter() - t0
                    if out.ttft is None:
                        out.ttft = out.first = now
                    out.last = now
            if out.error is None and not out.tokens:
                out.error = {"status": 200, "code": "incomplete_stream", "message": "no usage chunk"}
            return out
    except (aiohttp.ClientError, TimeoutError) as exc:
        return RequestResult(0, error={"status": 0, "code": type(exc).__name__, "message": str(exc)[:200]})


async def run_mesh_level(url: str, model: str, concurrency: int, requests: int, max_tokens: int,
                         timeout_s: float) -> tuple[float, list[RequestResult]]:
    """C clients, each sending `requests` requests one after another: (wall s, results)."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as http:

        async def client(i: int) -> list[RequestResult]:
            return [await one_request(http, url, model, messages_for(i * requests + j), max_tokens)
                    for j in range(requests)]

        t0 = time.perf_counter()
        per_client = await asyncio.gather(*(client(i) for i in range(concurrency)))
        wall = time.perf_counter() - t0
    return wall, [r for rs in per_client for r in rs]


def _nearest_rank(values: list[float], q: float) -> float | None:
    """The q-quantile by nearest rank (p99 of fewer than 100 samples is their maximum)."""
    if not values:
        return None
    xs = sorted(values)
    return xs[max(0, math.ceil(q * len(xs)) - 1)]


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 1)


def summarize_mesh(concurrency: int, wall: float, results: list[RequestResult]) -> dict[str, Any]:
    """A level's mesh figures (see the module docstring)."""
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    rates = [r.stream_tps for r in ok if r.stream_tps is not None]
    failed = [r for r in results if not r.ok]
    tokens = sum(r.tokens for r in ok)
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "completed": len(ok),
        "completion_tokens": tokens,
        "completion_tokens_min": min((r.tokens for r in ok), default=0),
        "wall_s": round(wall, 3),
        "aggregate_tps": round(tokens / wall, 2),
        "ttft_p50_ms": _ms(statistics.median(ttfts) if ttfts else None),
        "ttft_p99_ms": _ms(_nearest_rank(ttfts, 0.99)),
        "stream_tps_min": round(min(rates), 2) if rates else None,
        "stream_tps_median": round(statistics.median(rates), 2) if rates else None,
        "errors": len(failed),
        "http_503": sum(1 for r in failed if r.status == 503),
        "error_samples": [r.error for r in failed[:MAX_ERROR_SAMPLES]],
    }


# -- the baseline: one llama.cpp batch of C sequences per step --------------------------------


@dataclass(slots=True)
class BaselineRound:
    prefill_s: float
    decode_s: float
    tokens: np.ndarray  # [C, n_tokens] greedy token ids, end of generation ignored


class BatchedBaseline:
    """The whole model in this process; every llama.cpp call runs on one thread of its own
    (libgomp keeps one worker pool per calling thread, so one thread keeps it to one pool)."""

    def __init__(self, model: Path, threads: int, kv_unified: bool) -> None:
        self.path = model
        self.threads = threads
        self.kv_unified = kv_unified
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="baseline")
        self.stopping = threading.Event()
        self.ll: Any = None
        self.model: Any = None

    async def _run(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def load(self) -> None:
        await self._run(self._load)

    def _load(self) -> None:
        self.ll = ll = prepare_llama_runtime()
        mparams = ll.llama_model_default_params()
        mparams.n_gpu_layers = 0
        self.model = ll.llama_model_load_from_file(str(self.path).encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {self.path}")
        self.n_vocab = int(ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(self.model)))

    async def run_level(self, rounds: list[list[list[int]]], n_tokens: int) -> list[BaselineRound]:
        """For each round's C prompts: prefill them, then decode all C as one batch per step."""
        return await self._run(self._run_level, rounds, n_tokens)

    def _run_level(self, rounds: list[list[list[int]]], n_tokens: int) -> list[BaselineRound]:
        ll = self.ll
        n_seq = len(rounds[0])
        longest = max(len(p) for prompts in rounds for p in prompts)
        cparams = ll.llama_context_default_params()
        cparams.n_ctx = n_seq * 256 * math.ceil((longest + n_tokens + 1) / 256)
        cparams.n_batch = cparams.n_ubatch = N_BATCH
        cparams.n_seq_max = n_seq
        cparams.kv_unified = self.kv_unified
        cparams.n_threads = cparams.n_threads_batch = self.threads
        cparams.flash_attn_type = ll.LLAMA_FLASH_ATTN_TYPE_DISABLED  # as a node's default
        cparams.no_perf = True
        ctx = ll.llama_init_from_model(self.model, cparams)
        if not ctx:
            raise RuntimeError(f"llama.cpp could not create a context for {n_seq} sequences")
        batch = ll.llama_batch_init(max(N_BATCH, n_seq), 0, 1)
        try:
            out = []
            for prompts in rounds:
                ll.llama_memory_clear(ll.llama_get_memory(ctx), True)
                out.append(self._round(ctx, batch, prompts, n_tokens))
            return out
        finally:
            ll.llama_batch_free(batch)
            ll.llama_free(ctx)

    def _decode(self, ctx: Any, batch: Any, n: int) -> None:
        batch.n_tokens = n
        rc = self.ll.llama_decode(ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def _round(self, ctx: Any, batch: Any, prompts: list[list[int]], n_tokens: int) -> BaselineRound:
        ll, n_seq = self.ll, len(prompts)
        cap = max(N_BATCH, n_seq)
        token = np.ctypeslib.as_array(batch.token, shape=(cap,))
        pos = np.ctypeslib.as_array(batch.pos, shape=(cap,))
        logits = np.ctypeslib.as_array(batch.logits, shape=(cap,))
        np.ctypeslib.as_array(batch.n_seq_id, shape=(cap,))[:] = 1
        rows = [(s, p, t) for s, prompt in enumerate(prompts) for p, t in enumerate(prompt)]
        last = np.zeros(n_seq, dtype=np.int32)
        t0 = time.perf_counter()
        # prefill: the C prompts packed into batches of N_BATCH tokens, logits at each prompt's end
        for lo in range(0, len(rows), N_BATCH):
            chunk = rows[lo : lo + N_BATCH]
            ends = []
            for k, (s, p, t) in enumerate(chunk):
                token[k], pos[k] = t, p
                batch.seq_id[k][0] = s
                logits[k] = p == len(prompts[s]) - 1
                if logits[k]:
                    ends.append((k, s))
            self._decode(ctx, batch, len(chunk))
            for k, s in ends:
                row = np.ctypeslib.as_array(ll.llama_get_logits_ith(ctx, k), shape=(self.n_vocab,))
                last[s] = int(row.argmax())
        t_prefill = time.perf_counter()
        # decode: one row per sequence, every row's logits, argmax per sequence
        for s in range(n_seq):
            batch.seq_id[s][0] = s
        logits[:n_seq] = 1
        pos[:n_seq] = [len(p) for p in prompts]
        tokens = np.zeros((n_seq, n_tokens), dtype=np.int32)
        tokens[:, 0] = last
        for step in range(1, n_tokens):
            if self.stopping.is_set():
                raise RuntimeError("baseline stopped")
            token[:n_seq] = tokens[:, step - 1]
            self._decode(ctx, batch, n_seq)
            out = np.ctypeslib.as_array(ll.llama_get_logits(ctx), shape=(n_seq, self.n_vocab))
            tokens[:, step] = out.argmax(axis=1)
            pos[:n_seq] += 1
        t_end = time.perf_counter()
        return BaselineRound(t_prefill - t0, t_end - t_prefill, tokens)

    async def close(self) -> None:
        self.stopping.set()
        if self.model is not None:
            await self._run(self.ll.llama_model_free, self.model)
            self.model = None
        self.pool.shutdown(wait=True)


def summarize_baseline(rounds: list[BaselineRound], n_seq: int, n_tokens: int,
                       eog: frozenset[int]) -> dict[str, Any]:
    """A level's baseline figures: end to end (prefill included) and decode only."""
    eog_ids = np.fromiter(eog, dtype=np.int32)
    prefill = sum(r.prefill_s for r in rounds)
    decode = sum(r.decode_s for r in rounds)
    return {
        "baseline_aggregate_tps": round(len(rounds) * n_seq * n_tokens / (prefill + decode), 2),
        "baseline_decode_only_tps": round(len(rounds) * n_seq * (n_tokens - 1) / decode, 2),
        "baseline_prefill_ms": round(statistics.median(r.prefill_s for r in rounds) * 1e3, 1),
        # sequences whose greedy output holds an end-of-generation token (the mesh stops there)
        "baseline_eog_sequences": sum(int(np.isin(r.tokens, eog_ids).any(axis=1).sum()) for r in rounds),
    }


# -- the run ----------------------------------------------------------------------------------


async def measure(args: argparse.Namespace, model: Path, prompts: list[list[int]],
                  eog: frozenset[int], threads: int) -> list[dict[str, Any]]:
    """Every level: the mesh and the baseline, one after the other (never at once)."""
    base = BatchedBaseline(model, threads, kv_unified=args.baseline_kv == "unified")
    levels: list[dict[str, Any]] = []
    logs = Path(tempfile.mkdtemp(prefix="meshnet-bench-concurrency-"))
    try:
        await base.load()
        async with contextlib.AsyncExitStack() as stack:
            mesh = None
            if not args.baseline_only:
                mesh = await stack.enter_async_context(local_mesh(
                    model, logs=logs, node_args=args.node_arg, gateway_args=args.gateway_arg,
                    tracker_args=args.tracker_arg, composite=True))
                _progress(f"mesh up (logs in {logs}); warming up")
                await run_mesh_level(mesh.url, mesh.model_id, 1, 1, WARMUP_TOKENS, args.request_timeout)
            await base.run_level([[prompts[0]]], WARMUP_TOKENS)
            for i, c in enumerate(args.levels):
                rounds = [[prompts[k * args.requests + j] for k in range(c)] for j in range(args.requests)]
                row: dict[str, Any] = {"concurrency": c}
                for part in ("mesh", "baseline")[:: -1 if i % 2 else 1]:
                    await asyncio.sleep(args.settle)
                    if part == "baseline":
                        row.update(summarize_baseline(await base.run_level(rounds, args.max_tokens),
                                                      c, args.max_tokens, eog))
                    elif mesh is not None:
                        wall, results = await run_mesh_level(mesh.url, mesh.model_id, c, args.requests,
                                                             args.max_tokens, args.request_timeout)
                        row.update(summarize_mesh(c, wall, results))
                if "aggregate_tps" in row:
                    row["ratio"] = round(row["aggregate_tps"] / row["baseline_aggregate_tps"], 3)
                levels.append(_ordered(row))
                _progress(f"C={c} done")
    finally:
        await base.close()
    shutil.rmtree(logs, ignore_errors=True)  # kept when the run failed
    return levels


KEY_ORDER = ("concurrency", "aggregate_tps", "baseline_aggregate_tps", "ratio", "baseline_decode_only_tps",
             "ttft_p50_ms", "ttft_p99_ms", "stream_tps_min", "stream_tps_median", "errors", "http_503")


def _ordered(row: dict[str, Any]) -> dict[str, Any]:
    return {**{k: row[k] for k in KEY_ORDER if k in row}, **row}


def _progress(text: str) -> None:
    print(f"[concurrency] {text}", file=sys.stderr, flush=True)


def _git_commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return sha + ("-dirty" if dirty else "")


def _node_threads(node_args: list[str]) -> int:
    """Threads a node's decode uses: its --threads, else the node's default (all cores)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--threads", type=int, default=None)
    known, _ = p.parse_known_args(node_args)
    return known.threads or os.cpu_count() or 1


def print_table(out: dict[str, Any]) -> None:
    """The levels as a readable table, then the run's metadata."""
    cols = [("C", "concurrency", 3), ("mesh tok/s", "aggregate_tps", 10),
            ("base tok/s", "baseline_aggregate_tps", 10), ("ratio", "ratio", 6),
            ("base decode", "baseline_decode_only_tps", 11), ("ttft p50", "ttft_p50_ms", 9),
            ("ttft p99", "ttft_p99_ms", 9), ("stream min", "stream_tps_min", 10),
            ("stream med", "stream_tps_median", 10), ("errors", "errors", 6), ("503s", "http_503", 5),
            ("done/sent", None, 9)]
    print("  ".join(f"{h:>{w}}" for h, _, w in cols))
    for lv in out["levels"]:
        cells = []
        for _, key, w in cols:
            v = f"{lv.get('completed', '-')}/{lv.get('requests', '-')}" if key is None else lv.get(key)
            cells.append(f"{'-' if v is None else v:>{w}}")
        print("  ".join(cells))
    for lv in out["levels"]:
        for e in lv.get("error_samples", []):
            print(f"  C={lv['concurrency']}: {e['status']} {e['code']}: {e['message']}")
    meta = {k: v for k, v in out.items() if k != "levels"}
    print("  " + ", ".join(f"{k}={v}" for k, v in meta.items()))


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print a table or JSON."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--levels", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 8, 16],
                   help="concurrency levels, comma-separated (default 1,4,8,16)")
    p.add_argument("--requests", type=int, default=4, help="requests per client, one after another")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--node-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for every `meshnet node` (repeat; e.g. --node-arg=--threads=1)")
    p.add_argument("--gateway-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for `meshnet gateway` (repeat)")
    p.add_argument("--tracker-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for `meshnet tracker` (repeat)")
    p.add_argument("--baseline-threads", type=int, default=None,
                   help="baseline llama.cpp threads (default: a node's, from --node-arg=--threads or all cores)")
    p.add_argument("--baseline-kv", choices=("split", "unified"), default="split",
                   help="baseline KV cache: one stream per sequence (split) or one shared (unified)")
    p.add_argument("--baseline-only", action="store_true", help="measure the baseline alone (no mesh)")
    p.add_argument("--settle", type=float, default=2.0, help="idle seconds before each measured part")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    args = p.parse_args(argv)
    if min(args.levels) < 1 or args.requests < 1 or args.max_tokens < 2:
        p.error("levels and --requests must be >= 1, --max-tokens >= 2")

    prepare_llama_runtime()  # before anything else loads llama.cpp: the nodes' short OpenMP idle spin
    from gateway.tokenizer import ModelTokenizer

    model = bundled_model_path()
    tok = ModelTokenizer(model)
    prompts = [tok.encode_chat(messages_for(k)) for k in range(max(args.levels) * args.requests)]
    threads = args.baseline_threads or _node_threads(args.node_arg)
    try:
        levels = _run_interruptible(measure(args, model, prompts, tok.eog_ids, threads))
    except (KeyboardInterrupt, asyncio.CancelledError):
        _progress("interrupted; every process it started is stopped")
        return 130
    out = {
        "levels": levels,
        "model": tok.name,
        "model_path": str(model),
        "requests_per_client": args.requests,
        "max_tokens": args.max_tokens,
        "prompt_tokens": [min(len(x) for x in prompts), max(len(x) for x in prompts)],
        "node_threads": _node_threads(args.node_arg),
        "baseline_threads": threads,
        "baseline_kv": args.baseline_kv,
        "ratio_uses": "baseline_aggregate_tps (prefill included)",
        "node_args": args.node_arg,
        "gateway_args": args.gateway_arg,
        "cpu_count": os.cpu_count(),
        "git_commit": _git_commit(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    if args.json:
        print(json.dumps(out))
    else:
        print_table(out)
    return 0


def _run_interruptible(coro: Any) -> Any:
    """asyncio.run, with SIGTERM and SIGHUP cancelling the run as Ctrl-C does, so every
    process the run started is stopped on the way out."""

    async def runner() -> Any:
        task = asyncio.ensure_future(coro)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGHUP):
            loop.add_signal_handler(sig, task.cancel)
        return await task

    return asyncio.run(runner())


if __name__ == "__main__":
    sys.exit(main())
