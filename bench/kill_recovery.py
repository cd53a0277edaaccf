"""One kill, measured closely: how long the streams a SIGKILL cut wait for their next token.

    .venv/bin/python bench/kill_recovery.py [--kill head|tail] [--runs 3] [--kv-profile exact|default]
        [--crowd] [--after-tokens N] [--json]

Each run starts a fresh mesh of 4 node processes (2 replicas of each half of the bundled
model, bench.mesh.local_mesh) and `--clients` greedy streams; after `--after` seconds it
SIGKILLs the replica of the chosen half that holds the most sessions (it is not started
again). A cut stream's recovery is the time from the kill to the first `decode` event of its
Generation Telemetry after its `restarting` one (its first token on the new route). Reported
per run: the sessions per node before the kill, the recoveries (ms, sorted), failures, and the
CPU steal over the 3 s after the kill (bench/cpu_steal.py: time the host gave other guests);
overall the median of each run's slowest recovery and the mean of all. bench/failover.py is
the soak (many kills, restarts); this one isolates a single kill, for A/B runs of the hop
scheduler (docs/benchmarks.md, "Rebuilds first").

`--crowd` puts every stream on the replica that is killed: the other replica of that half is
killed before the streams start and started again, as after an earlier kill in the soak (the
kills that cut all 8 streams there). Each recovery is then also held against the issue's
target, 1 s plus single-process llama.cpp's prefill of that stream's prompt and generated
tokens (the baseline, measured in the same run after the meshes stop): `within_target`.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from artifacts.bundled import bundled_model_path  # noqa: E402
from bench.cpu_steal import CpuSampler  # noqa: E402
from bench.failover import (  # noqa: E402
    RECOVERY_SLACK_MS,
    SHARDS,
    STEAL_WINDOW_S,
    Reference,
    Stream,
    messages_for,
    node_proc_index,
    node_url,
    run_stream,
    wait_node_urls,
)
from bench.mesh import local_mesh, spawn  # noqa: E402
from bench.report import print_report  # noqa: E402
from gateway.tokenizer import ModelTokenizer  # noqa: E402
from schemas.capability import KV_PROFILES  # noqa: E402

CROWD_AWAY_S = 3.5  # a killed node is out of new routes once its heartbeats stop (3 s)


async def decoded(streams: list[Stream], tasks: list[asyncio.Task[None]], args: argparse.Namespace) -> None:
    """Wait `--after` seconds, or with `--after-tokens` until every stream has that many tokens
    (runs then rebuild the same histories whatever the mesh's speed)."""
    if args.after_tokens is None:
        await asyncio.sleep(args.after)
        return
    async with asyncio.timeout(120):
        while any(len(s.arrivals) < args.after_tokens for s in streams):
            if any(t.done() for t in tasks):
                raise RuntimeError("a stream ended before --after-tokens tokens")
            await asyncio.sleep(0.005)


async def one_run(model: Path, args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    logs = Path(tempfile.mkdtemp(prefix="meshnet-bench-kill-"))
    node_args = [f"--kv-profile={args.kv_profile}", *args.node_arg]
    async with local_mesh(model, logs=logs, shards=SHARDS, node_args=node_args) as mesh:
        async with aiohttp.ClientSession() as http:
            await wait_node_urls(mesh, len(SHARDS))
            half = [i for i in range(len(SHARDS)) if (SHARDS[i][0] > 0) == (args.kill == "tail")]
            if args.crowd:  # the other replica is away while the streams are routed, then back
                spare = half[1]
                gone = mesh.procs[node_proc_index(spare)]
                gone.kill()
                gone.wait()
                await asyncio.sleep(CROWD_AWAY_S)  # the tracker has left it out
            streams = [Stream(f"kill-{c}", c) for c in range(args.clients)]
            tasks = [asyncio.create_task(run_stream(http, mesh.url, mesh.model_id, s, messages_for(c),
                                                    args.max_tokens)) for c, s in enumerate(streams)]
            if args.crowd:
                mesh.procs[node_proc_index(spare)] = spawn(logs / f"node-{spare}.log", "node", *gone.args[4:])
            await decoded(streams, tasks, args)
            counts = []
            for i in range(len(SHARDS)):
                async with http.get(f"{node_url(mesh, i)}/v1/sessions") as resp:
                    counts.append((await resp.json())["live_sessions"])
            victim = max(half, key=lambda i: counts[i])
            proc = mesh.procs[node_proc_index(victim)]
            cpu = CpuSampler()
            sampling_done = asyncio.Event()
            sampler = asyncio.create_task(cpu.run(sampling_done))
            proc.kill()
            proc.wait()
            wall_kill, killed_at = time.time(), time.monotonic()
            await asyncio.gather(*tasks)
            sampling_done.set()
            await sampler
    recoveries = []
    for s in streams:
        events = [e for e in s.events if e["ts"] >= wall_kill - 0.05]
        start = next((k for k, e in enumerate(events) if e.get("phase") == "restarting"), None)
        if start is None:
            continue
        first = next((e for e in events[start:] if e.get("phase") == "decode"), None)
        if first is not None:
            history = len(prompts[s.prompt]) + events[start].get("generated_tokens", 0)
            recoveries.append((round((first["ts"] - wall_kill) * 1e3), history))
    recoveries.sort()
    return {"sessions_before": counts, "killed": victim, "recovery_ms": [ms for ms, _ in recoveries],
            "cpu_steal_pct": cpu.steal_pct(killed_at, killed_at + STEAL_WINDOW_S),
            "histories": [n for _, n in recoveries],
            "failed": sum(1 for s in streams if s.error is not None), "logs": str(logs)}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    model = Path(args.model) if args.model else bundled_model_path()
    tok = ModelTokenizer(model)
    prompts = [tok.encode_chat(messages_for(c)) for c in range(args.clients)]
    runs = []
    for k in range(args.runs):
        runs.append(await one_run(model, args, prompts))
        print(f"[kill] run {k + 1}/{args.runs}: {runs[-1]}", file=sys.stderr)
    ref = Reference(model, args.kv_profile)  # the baseline, with the meshes gone
    reprefill = {n: ref.prefill_ms(n, prompts[0], prompts[0][-1]) for r in runs for n in r["histories"]}
    for r in runs:
        r["target_ms"] = [round(RECOVERY_SLACK_MS + reprefill[n]) for n in r["histories"]]
    slowest = [max(r["recovery_ms"]) for r in runs if r["recovery_ms"]]
    every = [ms for r in runs for ms in r["recovery_ms"]]
    over = [ms - t for r in runs for ms, t in zip(r["recovery_ms"], r["target_ms"], strict=True)]
    return {"kill": args.kill, "kv_profile": args.kv_profile, "crowd": args.crowd, "runs": runs,
            "slowest_recovery_ms_median": statistics.median(slowest) if slowest else None,
            "recovery_ms_mean": round(statistics.fmean(every)) if every else None,
            "within_target": f"{sum(1 for o in over if o <= 0)} of {len(over)}",
            "most_over_target_ms": max(over, default=None),
            "streams_failed": sum(r["failed"] for r in runs)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kill", choices=("head", "tail"), default="tail")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--after", type=float, default=7.0, help="seconds of decoding before the kill")
    p.add_argument("--after-tokens", type=int, default=None, metavar="N",
                   help="kill once every stream has N tokens instead (the same histories on any mesh)")
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--kv-profile", choices=KV_PROFILES, default="exact")  # a node's own default
    p.add_argument("--crowd", action="store_true",
                   help="every stream on the killed replica (its twin is away while they are routed)")
    p.add_argument("--model", default=None)
    p.add_argument("--node-arg", action="append", default=[], metavar="ARG")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    report = asyncio.run(run(args))
    print_report(report, as_json=args.json, width=28, skip=("runs",))
    return 0 if report["streams_failed"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
