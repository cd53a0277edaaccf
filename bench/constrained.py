"""What an output constraint costs: the mask per token, and decode through a mesh with and without.

    python bench/constrained.py [--json] [--runs 5] [--max-tokens 64]

1. **The mask alone**, on the bundled model's vocabulary (49,152 tokens): each step asks the
   llguidance matcher for its bitmask, turns it into a bool per token and masks a row of
   logits (what the tail's TokenSampler does), then consumes a token the mask allows. Median
   and p95 per token, for `json_object` and for a schema with required keys, an enum and an
   array, beside the baseline of the same row's unconstrained greedy choice.
2. **Through the mesh**: a 2-hop mesh (`meshnet up`-style processes, bench/mesh.py) answers the
   same chat greedily, unconstrained and with `response_format` json_schema, in alternating
   order; decode tok/s (tokens - 1 over the time from first to last streamed chunk), medians,
   and their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from artifacts.bundled import bundled_model_path  # noqa: E402
from artifacts.vocab_file import materialize_vocabulary  # noqa: E402
from bench.mesh import local_mesh  # noqa: E402
from bench.report import print_report  # noqa: E402
from nodes.sampling import TokenSampler, session_rng  # noqa: E402
from nodes.token_constraint import TokenConstraint  # noqa: E402
from schemas.output_constraint import OutputConstraint  # noqa: E402
from schemas.sampling import SamplingParams  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "colours": {"type": "array", "items": {"enum": ["red", "green", "blue"]}}},
    "required": ["name", "age", "colours"], "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "Describe three people as JSON: name, age and favourite colours."}]


def mask_cost(constraint: OutputConstraint | None, vocab: str, steps: int, seed: int = 0) -> list[float]:
    """Seconds per token of TokenSampler.choose over random logits (`constraint` None: no mask)."""
    rng = np.random.default_rng(seed)
    params = SamplingParams(temperature=0, constraint=constraint)
    sampler = TokenSampler(params, TokenConstraint(constraint, vocab) if constraint is not None else None)
    times = []
    n_vocab = 49152
    for _ in range(steps):
        logits = rng.standard_normal(n_vocab).astype(np.float32)
        t = time.perf_counter()
        sampler.choose(logits, session_rng(params))
        times.append(time.perf_counter() - t)
        if sampler.constraint is not None and not sampler.constraint.allowed()[:n_vocab].any():
            break  # the grammar is complete: only an end-of-generation token is left
    return times


async def stream_tokens(http: aiohttp.ClientSession, url: str, model: str, max_tokens: int,
                        response_format: dict[str, Any] | None) -> tuple[int, float]:
    """(content chunks, seconds from the first to the last) of one streamed greedy chat."""
    body: dict[str, Any] = {"model": model, "messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0,
                            "stream": True}
    if response_format is not None:
        body["response_format"] = response_format
    times: list[float] = []
    async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{resp.status}: {await resp.text()}")
        async for raw in resp.content:
            line = raw.decode().strip()
            if line.startswith("data: {") and '"content"' in line:
                times.append(time.perf_counter())
    return len(times), (times[-1] - times[0]) if len(times) > 1 else 0.0


async def through_mesh(runs: int, max_tokens: int) -> dict[str, Any]:
    fmt = {"type": "json_schema", "json_schema": {"name": "people", "schema": SCHEMA}}
    with tempfile.TemporaryDirectory() as logs:
        async with local_mesh(bundled_model_path(), logs=Path(logs), node_args=["--threads", "1"]) as mesh, \
                aiohttp.ClientSession() as http:
            plain: list[float] = []
            constrained: list[float] = []
            for i in range(runs + 1):
                order = [(None, plain), (fmt, constrained)]
                for f, into in order if i % 2 else order[::-1]:
                    n, secs = await stream_tokens(http, mesh.url, mesh.model_id, max_tokens, f)
                    if i and n > 1:  # the first round warms up
                        into.append((n - 1) / secs)
    p, c = statistics.median(plain), statistics.median(constrained)
    return {"decode_tps_plain": round(p, 1), "decode_tps_constrained": round(c, 1),
            "constrained_over_plain": round(c / p, 3), "runs": runs}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=400, help="tokens per mask measurement")
    args = ap.parse_args(argv)
    vocab = str(materialize_vocabulary(bundled_model_path()))
    report: dict[str, Any] = {}
    base = mask_cost(None, vocab, args.steps)
    for name, c in (("json_object", OutputConstraint(kind="json_object")),
                    ("json_schema", OutputConstraint(kind="json_schema", schema_text=json.dumps(SCHEMA)))):
        t = mask_cost(c, vocab, args.steps)
        report[f"choose_us_{name}"] = {"median": round(1e6 * statistics.median(t), 1),
                                       "p95": round(1e6 * float(np.percentile(t, 95)), 1), "tokens": len(t)}
    report["choose_us_unconstrained"] = {"median": round(1e6 * statistics.median(base), 1),
                                         "p95": round(1e6 * float(np.percentile(base, 95)), 1)}
    report["mask_overhead_us_json_schema"] = round(
        report["choose_us_json_schema"]["median"] - report["choose_us_unconstrained"]["median"], 1)
    report["mesh"] = asyncio.run(through_mesh(args.runs, args.max_tokens))
    print_report(report, as_json=args.json, width=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
