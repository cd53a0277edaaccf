"""What the exact KV profile costs: speed of the shard engine and quality of the model, against
the default profile, in the same run.

    .venv/bin/python bench/kv_profile.py [--runs 5] [--threads 2] [--json]

- speed: the whole bundled model in nodes.llama_engine.LlamaShardEngine (what a node runs),
  once per profile, runs alternating between the two engines: a `--prompt`-token prefill in
  one session, then `--steps` greedy decode steps; medians of prefill and decode tok/s;
- quality: single-process llama.cpp (llama_cpp.Llama, the same configuration per profile)
  teacher-forced over the first `--nll-tokens` tokens of a fixed English text (the docstrings
  of Python's argparse and statistics modules, which change only with Python): the mean
  negative log-likelihood per token (nats) of each next token, and how often the two
  profiles' greedy choices agree along the text.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from artifacts.bundled import bundled_model_path  # noqa: E402
from nodes.llama_engine import LlamaShardEngine  # noqa: E402
from schemas.capability import KV_PROFILES as PROFILES  # noqa: E402

LOAD = {"default": {}, "exact": {"flash_attn": True, "type_k": 8}}  # GGML_TYPE_Q8_0


def time_engine(engine: LlamaShardEngine, n_prompt: int, steps: int, run: int) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s) of one session: a random prompt, then greedy steps."""
    sid = f"bench-{run}"
    rng = np.random.default_rng(run)
    engine.open_session(sid)
    try:
        t0 = time.perf_counter()
        out = engine.forward(sid, 0, token_ids=rng.integers(0, engine.n_vocab, n_prompt, dtype=np.int32))
        prefill = n_prompt / (time.perf_counter() - t0)
        token = out.token.token_id
        t0 = time.perf_counter()
        for pos in range(n_prompt, n_prompt + steps):
            token = engine.forward(sid, pos, token_ids=np.array([token], dtype=np.int32)).token.token_id
        return prefill, steps / (time.perf_counter() - t0)
    finally:
        engine.close_session(sid)


def speed(model: Path, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    engines = {p: LlamaShardEngine(model, 0, 30, n_ctx=1024, max_sessions=1, n_threads=args.threads,
                                   kv_profile=p, measure=False) for p in PROFILES}
    try:
        got: dict[str, list[tuple[float, float]]] = {p: [] for p in PROFILES}
        time_engine(engines["default"], 32, 8, 99)  # warm-up
        time_engine(engines["exact"], 32, 8, 99)
        for run in range(args.runs):
            for p in (PROFILES if run % 2 == 0 else PROFILES[::-1]):
                got[p].append(time_engine(engines[p], args.prompt, args.steps, run))
        return {p: {"prefill_tok_s": round(statistics.median(r[0] for r in got[p]), 1),
                    "decode_tok_s": round(statistics.median(r[1] for r in got[p]), 1),
                    "decode_tok_s_runs": [round(r[1], 1) for r in got[p]]} for p in PROFILES}
    finally:
        for e in engines.values():
            e.close()


def quality(model: Path, args: argparse.Namespace) -> dict[str, Any]:
    import llama_cpp

    text = f"{argparse.__doc__}\n{statistics.__doc__}"
    nll: dict[str, float] = {}
    greedy: dict[str, np.ndarray] = {}
    for p in PROFILES:
        llm = llama_cpp.Llama(model_path=str(model), n_ctx=1024, n_threads=args.threads, logits_all=True,
                              verbose=False, **LOAD[p])
        try:
            ids = llm.tokenize(text.encode(), add_bos=True)[:args.nll_tokens + 1]
            llm.eval(ids)
            logits = np.asarray(llm.scores[:len(ids) - 1], dtype=np.float64)
        finally:
            llm.close()
        top = logits.max(axis=1, keepdims=True)
        logz = np.log(np.exp(logits - top).sum(axis=1)) + top[:, 0]
        nll[p] = float(np.mean(logz - logits[np.arange(len(ids) - 1), ids[1:]]))
        greedy[p] = logits.argmax(axis=1)
    return {"nll_tokens": args.nll_tokens, "mean_nll": {p: round(v, 4) for p, v in nll.items()},
            "nll_delta": round(nll["exact"] - nll["default"], 4),
            "greedy_agreement": round(float(np.mean(greedy["exact"] == greedy["default"])), 4)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt", type=int, default=256, help="prefill tokens per run")
    p.add_argument("--steps", type=int, default=128, help="decode steps per run")
    p.add_argument("--nll-tokens", type=int, default=400)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    model = bundled_model_path()
    report = {"threads": args.threads, "speed": speed(model, args), "quality": quality(model, args)}
    s = report["speed"]
    report["exact_over_default"] = {k: round(s["exact"][k] / s["default"][k], 3)
                                    for k in ("prefill_tok_s", "decode_tok_s")}
    print(json.dumps(report, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
