"""The economics and trust plane's costs: how fast the Work Ledger folds events in, and what
replay validation costs users in aggregate tok/s.

    python bench/ledger.py [--json] [--events 50000] [--skip-validation]
        [--concurrency 8] [--requests 6] [--max-tokens 64] [--rounds 2]

1. **Fold rate.** `pure_events_per_s`: tracker/ledger.py's apply_event over --events
   synthetic node_work events, each after the tracker's route participation and the gateway's
   validation event that vouch for it (3 x --events events: schema, subject and vouch checks
   included), no I/O.
   `stream_events_per_s`: the real consumer (tracker/ledger_service.py's LedgerConsumer on a
   real nats-server): the events are first stored in MESH_AUDIT (not timed), then the clock
   runs from the consumer's start until it has counted all of them (durable fetches, folding,
   the ledger written to its key-value bucket, acknowledgements). Target: >= 20,000/s.
2. **Validation cost.** A `meshnet up`-style mesh (bench/mesh.py: two shards, one replica, so
   replays run on the validator's llama.cpp reference: there is no disjoint route) and
   `meshnet validator` (its defaults: 1 thread, nice 10). --concurrency clients each stream
   --requests greedy chat completions, as in bench/concurrency.py. Each round runs the gateway
   at --validate-rate 0 and at 0.05, and at 1 (every session replayed, the worst case), in an
   alternating order; `cost_*` = 1 - aggregate tok/s with validation / without, medians over
   rounds. Target at 0.05: <= 5 %. `replays_*` counts the verdicts published meanwhile.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from artifacts.bundled import bundled_model_path  # noqa: E402
from bench.concurrency import run_mesh_level  # noqa: E402
from bench.mesh import local_mesh, spawn, stop_all  # noqa: E402
from bus import subjects  # noqa: E402
from bus.client import Bus  # noqa: E402
from bus.server import NatsServer  # noqa: E402
from schemas.audit import NodeWork, RouteParticipation, ValidationEvent, ValidationVerdict  # noqa: E402
from schemas.ledger import LedgerState  # noqa: E402
from schemas.route import Hop  # noqa: E402
from schemas.sampling import SamplingParams  # noqa: E402
from tracker.ledger import apply_event  # noqa: E402
from tracker.ledger_service import LedgerConsumer  # noqa: E402

NODES = ("bench-a", "bench-b", "bench-c", "bench-d")


def _event(i: int) -> tuple[str, dict[str, Any]]:
    node = NODES[i % len(NODES)]
    e = NodeWork(source=node, node_id=node, session_id=f"s{i}", route_id=f"r{i}", model_revision="bench",
                 layer_start=0, layer_end=15, prefill_tokens=40, decode_tokens=64, active_param_bytes=50_000_000)
    return subjects.audit("node_work", subjects.publisher("node", node)), e.model_dump(mode="json")


def _vouch(i: int) -> RouteParticipation:
    """The tracker's participation event that makes work event `i` count."""
    return RouteParticipation(source="tracker", session_id=f"s{i}", route_id=f"r{i}", model="bench",
                              model_revision="bench", cache_abi="bench", node_id=NODES[i % len(NODES)],
                              layer_start=0, layer_end=15, hop_index=0, n_hops=2, n_ctx=2048)


def _count(i: int) -> ValidationEvent:
    """The gateway's record of session `i`: the tokens its hop may be paid for."""
    hop = Hop(node_id=NODES[i % len(NODES)], activation_url="http://127.0.0.1:9", layer_start=0, layer_end=15)
    return ValidationEvent(source="gateway", session_id=f"s{i}", route_id=f"r{i}", model="bench", model_revision="bench",
                           cache_abi="bench", hops=[hop], sampling=SamplingParams(), prompt_tokens=40, output_tokens=64)


def pure_fold(n: int) -> float:
    """Events per second folded: each work event after the tracker's participation and the
    gateway's count that vouch for it."""
    events = []
    for i in range(n):
        events += [(subjects.audit("route_participation", "tracker"), _vouch(i).model_dump(mode="json")),
                   (subjects.audit("validation", "gateway"), _count(i).model_dump(mode="json")), _event(i)]
    state = LedgerState()
    t0 = time.perf_counter()
    for seq, (subject, e) in enumerate(events, 1):
        apply_event(state, seq, e, subject)
    elapsed = time.perf_counter() - t0
    assert state.events == n, state.events
    return len(events) / elapsed


async def stream_fold(n: int, store: Path) -> dict[str, float]:
    async with NatsServer.start(store_dir=store) as srv:
        buses = {node: await Bus.connect(srv.url, role="node", node_id=node, name=node) for node in NODES}
        try:
            await buses[NODES[0]].ensure_audit_stream()
            tracker = await Bus.connect(srv.url, role="tracker", name="bench-tracker")
            gateway = await Bus.connect(srv.url, role="gateway", name="bench-gateway")
            t0 = time.perf_counter()
            for start in range(0, n, 1000):
                await asyncio.gather(*(tracker.publish_audit(_vouch(i)) for i in range(start, min(n, start + 1000))))
                await asyncio.gather(*(gateway.publish_audit(_count(i)) for i in range(start, min(n, start + 1000))))
                await asyncio.gather(*(
                    buses[NODES[i % len(NODES)]].publish_audit(NodeWork.model_validate(_event(i)[1]))
                    for i in range(start, min(n, start + 1000))))
            publish_s = time.perf_counter() - t0
            consumer = LedgerConsumer(tracker, owner=f"bench-{uuid.uuid4().hex[:6]}", batch=1024, idle_s=0.2)
            t0 = time.perf_counter()
            task = asyncio.create_task(consumer.run())
            while consumer.state.events < n:
                await asyncio.sleep(0.005)
                if task.done():
                    task.result()
            fold_s = time.perf_counter() - t0
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await tracker.close()
            await gateway.close()
        finally:
            for b in buses.values():
                await b.close()
    return {"stream_events_per_s": 3 * n / fold_s, "stream_publish_events_per_s": 3 * n / publish_s,
            "stream_rounds": consumer.rounds}


async def _level(mesh_url: str, model_id: str, args: argparse.Namespace) -> float:
    wall, results = await run_mesh_level(mesh_url, model_id, args.concurrency, args.requests, args.max_tokens, 600.0)
    bad = [r for r in results if r.error is not None]
    if bad:
        raise RuntimeError(f"{len(bad)} request(s) failed: {bad[0].error}")
    return sum(r.tokens for r in results) / wall


async def validation_cost(args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    model = bundled_model_path()
    rates = (0.0, 0.05, 1.0)
    tps: dict[float, list[float]] = {r: [] for r in rates}
    replays: dict[float, list[int]] = {r: [] for r in rates}
    for rnd in range(args.rounds):
        order = rates if rnd % 2 == 0 else tuple(reversed(rates))
        for rate in order:
            run_logs = logs / f"r{rnd}-{rate}"
            run_logs.mkdir()
            async with local_mesh(model, logs=run_logs, gateway_args=["--validate-rate", str(rate)],
                                  composite=True) as mesh:
                validator = spawn(run_logs / "validator.log", "validator", "--model", str(model),
                                  "--nats", mesh.nats_url, "--log-level", "WARNING")
                try:
                    monitor = await Bus.connect(mesh.nats_url, role="monitor", name="bench-monitor")
                    seen = 0
                    async with monitor.subscribe(subjects.audit(subjects.VERDICT_KIND, "validator"),
                                                 ValidationVerdict) as verdicts:
                        async def count() -> None:
                            nonlocal seen
                            async for _ in verdicts:
                                seen += 1
                        counter = asyncio.create_task(count())
                        await _level(mesh.url, mesh.model_id, args)  # warm-up (page cache, first routes)
                        value = await _level(mesh.url, mesh.model_id, args)
                        await asyncio.sleep(1.0)
                        counter.cancel()
                    await monitor.close()
                finally:
                    stop_all([validator])
            tps[rate].append(value)
            replays[rate].append(seen)
            print(f"  round {rnd} rate {rate:g}: {value:.1f} tok/s aggregate, {seen} replay verdict(s)",
                  file=sys.stderr, flush=True)
    base = statistics.median(tps[0.0])
    out: dict[str, Any] = {"aggregate_tps_no_validation": base}
    for rate, key in ((0.05, "0_05"), (1.0, "1")):
        med = statistics.median(tps[rate])
        out[f"aggregate_tps_rate_{key}"] = med
        out[f"cost_rate_{key}"] = 1.0 - med / base
        out[f"replays_rate_{key}"] = sum(replays[rate])
    out["runs_tps"] = {str(r): v for r, v in tps.items()}
    return out


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="meshnet-bench-ledger-") as tmp:
        out: dict[str, Any] = {"events": args.events, "pure_events_per_s": pure_fold(args.events)}
        print(f"pure fold: {out['pure_events_per_s']:.0f} events/s", file=sys.stderr, flush=True)
        out |= await stream_fold(args.events, Path(tmp) / "js")
        out["stream_vs_pure"] = out["stream_events_per_s"] / out["pure_events_per_s"]
        out["stream_vs_target"] = out["stream_events_per_s"] / 20_000
        print(f"consumer: {out['stream_events_per_s']:.0f} events/s ({out['stream_vs_pure']:.2f}x the pure fold, "
              f"{out['stream_vs_target']:.2f}x the target)", file=sys.stderr, flush=True)
        if not args.skip_validation:
            out |= await validation_cost(args, Path(tmp))
        out["target_events_per_s"] = 20_000
        out["target_cost_rate_0_05"] = 0.05
        out["config"] = {k: getattr(args, k) for k in ("concurrency", "requests", "max_tokens", "rounds")}
        return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true")
    p.add_argument("--events", type=int, default=50_000)
    p.add_argument("--skip-validation", action="store_true", help="only the fold rates")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--requests", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    out = asyncio.run(bench(args))
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for k, v in out.items():
            print(f"{k:32} {v:.4g}" if isinstance(v, float) else f"{k:32} {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
