"""Replica balance at start: do co-located replicas that start together share the sessions?

    .venv/bin/python bench/replica_balance.py [--meshes 3] [--clients 8] [--kv-profile exact|default] [--json]

Starts `--meshes` fresh meshes one after another, each of 4 node processes started together
(2 replicas of each half of the bundled model, bench.mesh.local_mesh), reads every node's
Capability Report (its self-measured decode and prefill tok/s) before any request, then sends
`--clients` concurrent greedy requests and counts the sessions each node holds 2 s later.

Reported per mesh: each node's measured decode / prefill tok/s, the spread of decode tok/s
between the two replicas of a range (max / min), and the sessions per node; overall, how many
ranges were split evenly (clients / 2 each) and the largest share one replica took. The
tracker prices a hop by its measured speed (docs/control-plane.md, "Route selection"), so a
replica that measured itself while its neighbours loaded looked slow, or like a straggler,
and the other replica took every session (docs/benchmarks.md, "Balanced replicas").
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from artifacts.bundled import bundled_model_path  # noqa: E402
from bench.failover import SHARDS, Stream, messages_for, node_url, run_stream, wait_node_urls  # noqa: E402
from bench.mesh import local_mesh  # noqa: E402
from bench.report import print_report  # noqa: E402
from schemas.capability import KV_PROFILES  # noqa: E402


async def one_mesh(model: Path, clients: int, node_args: list[str]) -> dict[str, Any]:
    logs = Path(tempfile.mkdtemp(prefix="meshnet-bench-balance-"))
    async with local_mesh(model, logs=logs, shards=SHARDS, node_args=node_args) as mesh:
        async with aiohttp.ClientSession() as http:
            await wait_node_urls(mesh, len(SHARDS))
            caps = []
            for i in range(len(SHARDS)):
                async with http.get(f"{node_url(mesh, i)}/v1/capability") as resp:
                    c = await resp.json()
                caps.append((c["decode_tokens_per_second"], c["prefill_tokens_per_second"]))
            streams = [Stream(f"bal-{c}", c) for c in range(clients)]
            tasks = [asyncio.create_task(run_stream(http, mesh.url, mesh.model_id, s, messages_for(c), 48))
                     for c, s in enumerate(streams)]
            await asyncio.sleep(2.0)
            sessions = []
            for i in range(len(SHARDS)):
                async with http.get(f"{node_url(mesh, i)}/v1/sessions") as resp:
                    sessions.append((await resp.json())["live_sessions"])
            await asyncio.gather(*tasks)
    ranges = sorted(set(SHARDS))
    spread = [max(caps[i][0] for i in range(len(SHARDS)) if SHARDS[i] == r)
              / max(1e-9, min(caps[i][0] for i in range(len(SHARDS)) if SHARDS[i] == r)) for r in ranges]
    return {"decode_prefill_tps": caps, "decode_spread": [round(x, 2) for x in spread], "sessions": sessions,
            "failed": sum(1 for s in streams if s.error is not None)}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    model = Path(args.model) if args.model else bundled_model_path()
    node_args = [f"--kv-profile={args.kv_profile}", *args.node_arg]
    meshes = []
    for k in range(args.meshes):
        meshes.append(await one_mesh(model, args.clients, node_args))
        print(f"[balance] mesh {k + 1}/{args.meshes}: {meshes[-1]}", file=sys.stderr)
    shares = [n for m in meshes for n in m["sessions"]]
    even = sum(1 for m in meshes for r in sorted(set(SHARDS))
               if {m["sessions"][i] for i in range(len(SHARDS)) if SHARDS[i] == r} == {args.clients // 2})
    return {"meshes": meshes, "ranges_split_evenly": even, "ranges": args.meshes * len(set(SHARDS)),
            "largest_share": max(shares) if shares else None,
            "max_decode_spread": max(x for m in meshes for x in m["decode_spread"])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--meshes", type=int, default=3)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--kv-profile", choices=KV_PROFILES, default="exact")  # a node's own default
    p.add_argument("--model", default=None)
    p.add_argument("--node-arg", action="append", default=[], metavar="ARG")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    report = asyncio.run(run(args))
    print_report(report, as_json=args.json, width=20, skip=("meshes",))
    return 0 if all(m["failed"] == 0 for m in report["meshes"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
