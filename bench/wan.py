"""Decode and prefill across an emulated WAN: every node behind a delaying relay (bench/relay.py).

    python -m bench.wan [--json] [--quick] [--rtt-ms 0,20,50] [--hops 2,3] [--concurrency 8,32]
                        [--rate-mbit 50] [--prompt 2000] [--ttft-runs 3] [--chunk 64]
                        [--decode 32] [--runs 1]

For each hop count and RTT it starts nats-server, a tracker and one `meshnet node` per hop, each
node reached only through its own relay (one-way delay RTT/2, announced with --advertise), and
reports: stream_tps (one greedy stream decoding as the gateway does, one Decode Run: the head
drives the loop), floor_tps (1 / (hops x one-way delay + summed hop compute): one token goes
once round the route, head to tail and straight back, the best one stream can do with this
route's compute, measured during the same run: each token's result names every hop's compute,
and the floor takes the mean of their sums, as stream_tps is a mean over the same tokens), aggregate_tps_c<N> (N streams at once), added_ms_per_token (against
RTT 0 in the same run), ttft_ms (the median over --ttft-runs prompts of --prompt tokens, in
frames of --chunk tokens, through relays capped at --rate-mbit)
and errors; then the ratios the WAN targets use. With --runs N it measures every setting N times,
round after round (so the machine's drift lands on every setting), takes each round's ratios
against that round's RTT 0, and reports per setting the median of each figure and ratio over the
rounds, with each round's figures under "runs".
Figures taken on a loaded machine are only good as ratios against RTT 0 of the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import aiohttp
import numpy as np

from artifacts.bundled import resolve_model
from artifacts.revision import model_revision
from bench.cli_args import parse_with_quick
from bench.relay import DelayRelay
from bench.route import LAYOUTS, hop_ranges, open_route, spawn_nodes, start_tracker, stop_processes
from bus import runloop
from bus.cli_args import number, number_list
from bus.client import Bus
from bus.server import NatsServer, free_port
from gateway.route_client import RouteClient
from schemas.frames import DEFAULT_CHUNK_SIZE, DEFAULT_WINDOW


async def far_nodes(nats: NatsServer, model: Path, hops: int, delay_s: float, rate_mbit: float | None,
                    args: argparse.Namespace) -> tuple[list[asyncio.subprocess.Process], list[str], list[DelayRelay]]:
    """One node per hop, each behind its own relay."""
    procs, ids, relays = [], [], []
    for layers in hop_ranges(model, hops, args.layout):
        port = free_port()
        relay = DelayRelay("127.0.0.1", port, delay_s, rate_mbit)
        await relay.start()
        relays.append(relay)
        node_args = argparse.Namespace(**{**vars(args), "node_arg": [
            "--port", str(port), "--advertise", f"http://127.0.0.1:{relay.port}", "--max-sessions", "64",
            *args.node_extra]})
        proc, [(node_id, _)] = await spawn_nodes(nats, model, [layers], node_args)  # a far node: a process each
        procs.append(proc)
        ids.append(node_id)
    return procs, ids, relays


def add_node_arguments(p: argparse.ArgumentParser) -> None:
    """The flags far_nodes reads: every node's threads, wire dtype, compression, and more."""
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--layout", default="compute", choices=LAYOUTS,
                   help="cut the model where each hop costs about the same per token (as meshnet up), "
                        "or at equal layer counts (the layout before 2026-12-05)")
    p.add_argument("--wire-dtype", default="f32", choices=["f32", "f16", "bf16"])
    p.add_argument("--compression", default="none", choices=["none", "zstd"])
    p.add_argument("--node-extra", action="append", default=[], metavar="ARG",
                   help="one more `meshnet node` argument for every node (repeat it; for A/B runs, "
                        "e.g. --node-extra=--evidence-mb=0)")


async def stream(http: aiohttp.ClientSession, bus: Bus, model: str, ids: list[str], prompt: list[int],
                 steps: int, chunk: int | None = None) -> tuple[float, float, float, list[int]]:
    """One greedy stream: (seconds of a `steps`-token Decode Run, the mean over its tokens of
    the summed hop compute ms (every token's result names every hop), prefill seconds, tokens).
    `chunk`: prompt tokens per prefill frame (None: the gateway's choice for the route's URLs)."""
    session = await open_route(bus, model, ids)
    async with RouteClient(session, http, bus=bus, chunk_size=chunk) as rc:
        t0 = time.monotonic()
        first = await rc.prefill(prompt)
        prefill_s = time.monotonic() - t0
        tokens, computes = [first.token_id], []
        if steps == 1:
            return 0.0, 0.0, prefill_s, tokens
        t0 = time.monotonic()
        async for r in rc.decode_run(tokens[-1], steps):
            tokens.append(r.token_id)
            computes.append(sum(t.compute_ms for t in r.timings))
        return time.monotonic() - t0, statistics.fmean(computes), prefill_s, tokens


async def one_config(model: Path, hops: int, rtt_ms: float, args: argparse.Namespace) -> dict[str, object]:
    prompt = np.random.default_rng(0).integers(100, 40000, size=args.prompt).tolist()
    out: dict[str, object] = {"hops": hops, "layers": hop_ranges(model, hops, args.layout),
                              "rtt_ms": rtt_ms, "wire_dtype": args.wire_dtype,
                              "compression": args.compression, "rate_mbit": args.rate_mbit,
                              "prompt_tokens": args.prompt, "errors": 0}
    async with NatsServer.start() as nats:
        tracker = await start_tracker(nats)
        user, password = nats.credentials("gateway")
        bus = await Bus.connect(nats.url, role="gateway", user=user, password=password, name="bench-wan")
        procs: list[asyncio.subprocess.Process] = [tracker]
        relays: list[DelayRelay] = []
        try:
            procs_n, ids, relays = await far_nodes(nats, model, hops, rtt_ms / 2e3, None, args)
            procs += procs_n
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=5.0)
            async with aiohttp.ClientSession(timeout=timeout) as http:
                name = model_revision(model)
                await stream(http, bus, name, ids, prompt[:16], 2)  # warm-up
                decode_s, compute_ms, _, out["tokens"] = await stream(http, bus, name, ids, prompt[:16], args.decode)
                out["stream_tps"] = args.decode / decode_s
                out["hop_compute_ms"] = compute_ms
                out["floor_tps"] = 1e3 / (hops * rtt_ms / 2 + compute_ms)
                for c in args.concurrency:
                    t0 = time.monotonic()
                    results = await asyncio.gather(
                        *(stream(http, bus, name, ids, prompt[:16], args.decode) for _ in range(c)),
                        return_exceptions=True)
                    wall = time.monotonic() - t0
                    ok = [r for r in results if not isinstance(r, BaseException)]
                    out["errors"] = int(out["errors"]) + len(results) - len(ok)  # type: ignore[arg-type]
                    samples = out.setdefault("error_samples", [])
                    samples += [f"c{c}: {type(r).__name__}: {r}"[:300]  # type: ignore[union-attr]
                                for r in results if isinstance(r, BaseException)][:3 - len(samples)]
                    out[f"aggregate_tps_c{c}"] = len(ok) * args.decode / wall
            procs_r, ids_r, relays_r = await far_nodes(nats, model, hops, rtt_ms / 2e3, args.rate_mbit, args)
            procs += procs_r
            relays += relays_r
            async with aiohttp.ClientSession(timeout=timeout) as http:
                ttfts = []
                for k in range(args.ttft_runs):  # a new prompt each time: nothing of one is cached for the next
                    other = np.random.default_rng(k + 1).integers(100, 40000, size=args.prompt).tolist()
                    _, _, prefill_s, _ = await stream(http, bus, name, ids_r, other, 1, args.chunk)
                    ttfts.append(prefill_s * 1e3)
                out["ttft_ms"] = statistics.median(ttfts)
                out["ttft_ms_runs"] = [round(t, 1) for t in ttfts]
        finally:
            await stop_processes(procs, 20)
            for r in relays:
                await r.close()
            await bus.close()
    return out


def ratios(rows: list[dict[str, object]]) -> None:
    """Add added latency and the ratios against RTT 0 (same hop count, same run)."""
    for row in rows:
        base = next((r for r in rows if r["hops"] == row["hops"] and r["rtt_ms"] == 0), None)
        row["stream_vs_floor"] = float(row["stream_tps"]) / float(row["floor_tps"])  # type: ignore[arg-type]
        if base is None:
            continue
        added = 1e3 / float(row["stream_tps"]) - 1e3 / float(base["stream_tps"])  # type: ignore[arg-type]
        row["added_ms_per_token"] = added
        one_way = float(row["rtt_ms"]) / 2  # type: ignore[arg-type]
        row["added_vs_hops_x_one_way"] = added / (int(row["hops"]) * one_way) if one_way else None  # type: ignore[call-overload]
        for key in [k for k in row if k.startswith("aggregate_tps_c")]:
            row[f"{key}_vs_rtt0"] = float(row[key]) / float(base[key])  # type: ignore[arg-type]


def medians(rounds: list[list[dict[str, object]]]) -> list[dict[str, object]]:
    """One row per setting: the median over the rounds of each figure (rounds' rows in the same
    order), each round's figures under "runs" (pure)."""
    out = []
    for i, first in enumerate(rounds[0]):
        rows = [r[i] for r in rounds]
        row: dict[str, object] = {k: v for k, v in first.items() if not isinstance(v, float)}
        for key in [k for k, v in first.items() if isinstance(v, float)]:
            values = [float(r[key]) for r in rows if isinstance(r.get(key), float)]  # type: ignore[arg-type]
            row[key] = statistics.median(values) if values else None
        row["errors"] = sum(int(r["errors"]) for r in rows)  # type: ignore[call-overload]
        row["error_samples"] = [e for r in rows for e in r.get("error_samples", [])][:3]  # type: ignore[attr-defined]
        if len(rows) > 1:
            row["runs"] = [{k: v for k, v in r.items() if k not in ("tokens", "error_samples")} for r in rows]
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true")
    p.add_argument("--quick", action="store_true",
                   help="RTT 0 and 20 ms, 2 hops, c2, short prompt (flags given still win)")
    p.add_argument("--model", default=None)
    p.add_argument("--rtt-ms", type=number_list(0), default="0,20,50")
    p.add_argument("--hops", type=number_list(1, 30, integer=True), default="2,3")
    p.add_argument("--concurrency", type=number_list(1, integer=True), default="8,32")
    p.add_argument("--rate-mbit", type=number(0), default=50.0, help="the relays' cap for ttft_ms (0: no cap)")
    p.add_argument("--prompt", type=number(1, integer=True), default=2000)
    p.add_argument("--chunk", type=number(1, integer=True), default=DEFAULT_CHUNK_SIZE,
                   help="prompt tokens per prefill frame for ttft_ms: the relays listen on loopback, where "
                        "the gateway would take the hops for one machine's and send 512, but they stand for "
                        "machines apart")
    p.add_argument("--ttft-runs", type=number(1, integer=True), default=3,
                   help="prompts timed for ttft_ms, one after another; their median is reported")
    p.add_argument("--decode", type=number(2, integer=True), default=32)
    p.add_argument("--runs", type=number(1, integer=True), default=1, help="rounds over every setting; medians are reported")
    add_node_arguments(p)
    quick = {"rtt_ms": "0,20", "hops": "2", "concurrency": "2", "prompt": 128, "decode": 8, "ttft_runs": 1}
    args = parse_with_quick(p, argv, quick)
    args.rate_mbit = args.rate_mbit or None
    args.batch_threads, args.window, args.node_env = 0, DEFAULT_WINDOW, []
    model = resolve_model(args.model)
    rounds = []
    for _ in range(args.runs):
        rows = [runloop.run(one_config(model, h, r, args)) for h in args.hops for r in args.rtt_ms]
        ratios(rows)
        rounds.append(rows)
    rows = medians(rounds)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        for row in rows:
            print(" ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
                           if k not in ("runs", "tokens")))
    return 0 if all(r["errors"] == 0 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
