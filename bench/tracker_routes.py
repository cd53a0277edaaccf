"""Time route selection over 1,000 and 10,000 simulated nodes (several models, realistic overlap).

    python bench/tracker_routes.py [--json] [--decisions N] [--seed S]

Prints p50/p99 per decision (select_route over a prebuilt index, with a live free-slot map),
and the index build time that the tracker pays when the registry changes. Target: p99 < 10 ms
at 10,000 nodes.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from schemas.route import RouteError, RoutePolicy, RouteRequest
from tracker.routing import build_index, select_route
from tracker.views import NodeView

# (model, n_layer, shard layouts as boundary lists)
MODELS = [
    ("smol-135m", 30, [[0, 30], [0, 15, 30], [0, 10, 20, 30]]),
    ("llama-8b", 32, [[0, 16, 32], [0, 8, 16, 24, 32], [0, 12, 32]]),
    ("qwen-32b", 64, [[0, 16, 32, 48, 64], [0, 20, 40, 64], [0, 32, 64]]),
    ("llama-70b", 80, [[0, 20, 40, 60, 80], [0, 16, 32, 48, 64, 80], [0, 10, 30, 50, 80]]),
]
ABI = "llama.cpp/f16/kv-unified"


def simulate(n_nodes: int, rng: random.Random) -> list[NodeView]:
    """Nodes spread over models and shard layouts; some stale revisions/ABIs, some busy or full."""
    nodes: list[NodeView] = []
    weights = [0.2, 0.3, 0.25, 0.25]
    for i in range(n_nodes):
        model, n_layer, layouts = rng.choices(MODELS, weights)[0]
        bounds = rng.choice(layouts)
        k = rng.randrange(len(bounds) - 1)
        start, end = bounds[k], bounds[k + 1]
        stale = rng.random() < 0.05
        base_tps = 4000.0 / (end - start)  # fewer layers -> faster shard
        nodes.append(
            NodeView(
                node_id=f"node-{i:05d}",
                activation_url=f"http://10.0.{i // 250}.{i % 250}:7100",
                model=model,
                model_revision=f"{model}-rev0" if stale else f"{model}-rev1",
                cache_abi="torch/f32" if rng.random() < 0.03 else ABI,
                start=start,
                end=end,
                n_layer=n_layer,
                hidden_size=4096,
                n_ctx=rng.choice([2048, 4096, 8192]),
                decode_tps=base_tps * rng.uniform(0.3, 1.3),
                load=rng.random() * 0.9,
                queue_depth=rng.choice([0, 0, 0, 1, 2]),
                peer_rtt_ms={f"node-{j:05d}": rng.uniform(0.2, 40.0) for j in rng.sample(range(n_nodes), 16)},
                free_slots=rng.choice([0, 1, 2, 4, 8]),
                max_sessions=8,
            )
        )
    return nodes


def requests(nodes: list[NodeView], n: int, rng: random.Random) -> list[RouteRequest]:
    """Mostly public requests by model name; some private (allow lists of ~40 nodes)."""
    by_model: dict[str, list[str]] = {}
    for v in nodes:
        by_model.setdefault(v.model, []).append(v.node_id)
    out = []
    for _ in range(n):
        model = rng.choice(MODELS)[0]
        if rng.random() < 0.1:
            allow = rng.sample(by_model[model], min(40, len(by_model[model])))
            policy = RoutePolicy(kind="private", allow_nodes=allow)
        else:
            policy = RoutePolicy()
        out.append(RouteRequest(model=model, policy=policy, prompt_tokens=rng.choice([0, 500, 3000])))
    return out


def run(n_nodes: int, decisions: int, seed: int) -> dict[str, float]:
    """Build the index once, then time `decisions` route selections."""
    rng = random.Random(seed)
    nodes = simulate(n_nodes, rng)
    live = {v.node_id: v.free_slots for v in nodes}
    t0 = time.perf_counter()
    index = build_index(nodes)
    build_ms = (time.perf_counter() - t0) * 1e3
    reqs = requests(nodes, decisions, rng)
    times: list[float] = []
    errors = 0
    for i, req in enumerate(reqs):
        t = time.perf_counter()
        got = select_route(index, req, session_id=f"s{i}", route_id=f"r{i}", live=live)
        times.append((time.perf_counter() - t) * 1e3)
        errors += isinstance(got, RouteError)
    times.sort()
    return {
        "p50_ms": round(statistics.median(times), 4),
        "p99_ms": round(times[min(len(times) - 1, int(len(times) * 0.99))], 4),
        "max_ms": round(times[-1], 4),
        "build_index_ms": round(build_ms, 2),
        "decisions": decisions,
        "refused": errors,
    }


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; --json prints one object keyed by node count."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--decisions", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--nodes", type=int, nargs="*", default=[1000, 10000])
    args = parser.parse_args(argv)
    results = {str(n): run(n, args.decisions, args.seed) for n in args.nodes}
    if args.json:
        print(json.dumps(results))
        return 0
    print(f"{'nodes':>7} {'p50 ms':>9} {'p99 ms':>9} {'max ms':>9} {'index build ms':>15} {'refused':>8}")
    for n, r in results.items():
        print(
            f"{n:>7} {r['p50_ms']:>9.3f} {r['p99_ms']:>9.3f} {r['max_ms']:>9.3f} "
            f"{r['build_index_ms']:>15.1f} {r['refused']:>5}/{r['decisions']}"
        )
    worst = results.get("10000")
    if worst is not None:
        verdict = "meets" if worst["p99_ms"] < 10.0 else "MISSES"
        print(f"p99 at 10,000 nodes: {worst['p99_ms']:.3f} ms ({verdict} the 10 ms target)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
