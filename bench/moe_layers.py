"""Per-layer prefill and decode cost of a mixture-of-experts layer against a dense one.

    python bench/moe_layers.py [--json] [--repeats 5]

Writes two random-weight llama GGUFs of the same shape (tests/fixtures/tiny_gguf.py): one
dense, one Mixtral-style with `--experts` experts of which `--used` run per token, each
expert's FFN as wide as the dense FFN. Runs each whole in the shard engine, in this process,
alternating, and reports medians per layer: prefill ms per token, decode ms per token, and
the weight bytes one token touches per layer (dense: every tensor; MoE: attention, router and
the used experts' share, as the Capability Report gives it: artifacts/shard_file.py
`shard_weights`). The ratios say how far a layer count is from a layer's cost, which is why the
tracker routes by each shard's measured speed (its Capability Report and heartbeats) and, where
a shard has not measured yet, by its active bytes, never by how many layers it holds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from artifacts.gguf_header import read_header
from artifacts.shard_file import shard_weights
from nodes.llama_engine import LlamaShardEngine, prepare_llama_runtime
from tests.fixtures.tiny_gguf import write_tiny_model


def active_bytes_per_layer(path: Path) -> float:
    """Weight bytes one token reads in an average layer (experts: expert_used_count of them)."""
    h = read_header(path)
    n_layer = int(h.get("llama.block_count"))
    return shard_weights(h, 0, n_layer).active_bytes / n_layer


def time_model(path: Path, prompt: list[int], n_decode: int, threads: int) -> tuple[float, float]:
    """(prefill s, decode s) of one run of the whole model."""
    e = LlamaShardEngine(path, 0, int(read_header(path).get("llama.block_count")), n_ctx=len(prompt) + n_decode + 8,
                         max_sessions=1, n_threads=threads, measure=False)
    try:
        e.open_session("b")
        t0 = time.perf_counter()
        out = e.forward("b", 0, token_ids=np.asarray(prompt, np.int32), want_logits=True)
        t_prefill = time.perf_counter() - t0
        tok, pos = int(np.argmax(out.logits)), len(prompt)
        t0 = time.perf_counter()
        for _ in range(n_decode):
            out = e.forward("b", pos, token_ids=np.asarray([tok], np.int32), want_logits=True)
            tok, pos = int(np.argmax(out.logits)), pos + 1
        return t_prefill, time.perf_counter() - t0
    finally:
        e.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--ff", type=int, default=1536)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--used", type=int, default=2)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--decode", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    prepare_llama_runtime()
    with tempfile.TemporaryDirectory() as d:
        shape = {"n_layer": a.layers, "n_embd": a.width, "n_head": 8, "n_head_kv": 2, "n_ff": a.ff,
                 "n_vocab": 1024}
        dense = write_tiny_model(Path(d) / "dense.gguf", "llama", **shape)
        moe = write_tiny_model(Path(d) / "moe.gguf", "llama", n_expert=a.experts, n_expert_used=a.used, **shape)
        prompt = [1 + (i * 7919) % 1000 for i in range(a.prompt)]
        runs: dict[str, list[tuple[float, float]]] = {"dense": [], "moe": []}
        for _ in range(a.repeats):  # alternate, so the machine's drift lands on both
            for name, path in (("dense", dense), ("moe", moe)):
                runs[name].append(time_model(path, prompt, a.decode, a.threads))
        per_layer = {}
        for name, path in (("dense", dense), ("moe", moe)):
            pf = statistics.median(r[0] for r in runs[name]) / a.prompt / a.layers * 1e3
            dc = statistics.median(r[1] for r in runs[name]) / a.decode / a.layers * 1e3
            per_layer[name] = {"prefill_ms_per_token": pf, "decode_ms_per_token": dc,
                               "active_bytes_per_token": active_bytes_per_layer(path)}
    result = {
        "shape": {**shape, "experts": a.experts, "used": a.used}, "repeats": a.repeats, "per_layer": per_layer,
        "moe_over_dense": {k: per_layer["moe"][k] / per_layer["dense"][k] for k in per_layer["dense"]},
    }
    if a.json:
        print(json.dumps(result, indent=2))
    else:
        for name, v in per_layer.items():
            print(f"{name:>5}: prefill {v['prefill_ms_per_token']:.4f} ms/token/layer, decode "
                  f"{v['decode_ms_per_token']:.4f} ms/token/layer, {v['active_bytes_per_token'] / 1e6:.2f} MB "
                  "of weights per token per layer")
        r = result["moe_over_dense"]
        print(f"MoE / dense per layer: prefill {r['prefill_ms_per_token']:.2f}x, decode "
              f"{r['decode_ms_per_token']:.2f}x, active bytes {r['active_bytes_per_token']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
