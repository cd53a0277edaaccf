"""Whole model (plain llama.cpp) vs the same model as a 2-way split of the shard engine.

One process, one run, same n_threads: prefill of a 512-token prompt and greedy decode,
repeated; prints medians and ratios (split tok/s ÷ whole tok/s). `--json` prints one JSON
object instead. Also measures how much CPU an idle engine burns after a forward.

    .venv/bin/python bench/shard_split.py --repeats 5 --json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from artifacts.bundled import resolve_model
from artifacts.shard_file import read_model_info
from nodes.llama_engine import LlamaShardEngine, prepare_llama_runtime


def _cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def idle_cpu_fraction(seconds: float = 1.0) -> float:
    """CPU seconds this process burns per wall second while nothing is running."""
    c0, t0 = _cpu_seconds(), time.perf_counter()
    time.sleep(seconds)
    return (_cpu_seconds() - c0) / (time.perf_counter() - t0)


def _last_logits(llm) -> np.ndarray:
    import llama_cpp

    return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))


def run_whole(llm, prompt: list[int], n_decode: int) -> tuple[float, float, np.ndarray, list[int]]:
    """(prefill s, decode s, prompt logits, greedy tokens) for plain llama.cpp."""
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(prompt)
    t_prefill = time.perf_counter() - t0
    logits = _last_logits(llm).copy()
    tokens = []
    t0 = time.perf_counter()
    for _ in range(n_decode):
        tok = int(np.argmax(_last_logits(llm)))
        tokens.append(tok)
        llm.eval([tok])
    return t_prefill, time.perf_counter() - t0, logits, tokens


def run_split(head, tail, prompt: list[int], n_decode: int, sid: str) -> tuple[float, float, np.ndarray, list[int]]:
    """The same work shard after shard (no network)."""
    head.open_session(sid)
    tail.open_session(sid)
    try:
        ids = np.asarray(prompt, dtype=np.int32)
        t0 = time.perf_counter()
        out = tail.forward(sid, 0, hidden=head.forward(sid, 0, token_ids=ids).hidden, want_logits=True)
        t_prefill = time.perf_counter() - t0
        logits, tokens, pos = out.logits, [], len(prompt)
        tok = out.token.token_id
        t0 = time.perf_counter()
        for _ in range(n_decode):
            tokens.append(tok)
            hidden = head.forward(sid, pos, token_ids=np.asarray([tok], dtype=np.int32)).hidden
            tok = tail.forward(sid, pos, hidden=hidden).token.token_id
            pos += 1
        return t_prefill, time.perf_counter() - t0, logits, tokens
    finally:
        head.close_session(sid)
        tail.close_session(sid)


def _stage(conn, model: str, start: int, end: int, threads: int, n_ctx: int) -> None:
    """One shard in its own process, driven over a pipe: open, forward, close, stop (None)."""
    from nodes.llama_engine import LlamaShardEngine

    engine = LlamaShardEngine(model, start, end, n_ctx=n_ctx, max_sessions=1, n_threads=threads, measure=False)
    conn.send("ready")
    while (msg := conn.recv()) is not None:
        op, sid, *rest = msg
        if op == "open":
            engine.open_session(sid)
        elif op == "close":
            engine.close_session(sid)
        else:
            pos, payload = rest
            kind = "token_ids" if engine.layers.is_head else "hidden"
            out = engine.forward(sid, pos, **{kind: payload})
            conn.send(out.hidden if out.hidden is not None else out.token.token_id)
    engine.close()


def run_colocated(model: Path, cut: int, n_layer: int, threads: int, prompt: list[int], n_decode: int,
                  repeats: int) -> tuple[float, float]:
    """Median (prefill tok/s, decode tok/s) of the split run as two co-located processes."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    n_ctx = len(prompt) + n_decode + 16
    pipes, procs = [], []
    for a, b in ((0, cut), (cut, n_layer)):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_stage, args=(child, str(model), a, b, threads, n_ctx), daemon=True)
        proc.start()
        pipes.append(parent)
        procs.append(proc)

    def hop(sid: str, pos: int, ids: np.ndarray) -> int:
        pipes[0].send(("fwd", sid, pos, ids))
        pipes[1].send(("fwd", sid, pos, pipes[0].recv()))
        return pipes[1].recv()

    try:
        for conn in pipes:
            conn.recv()
        prefill, decode = [], []
        for r in range(repeats):
            sid = f"colo-{r}"
            for conn in pipes:
                conn.send(("open", sid))
            t0 = time.perf_counter()
            tok = hop(sid, 0, np.asarray(prompt, dtype=np.int32))
            prefill.append(len(prompt) / (time.perf_counter() - t0))
            t0 = time.perf_counter()
            for i in range(n_decode):
                tok = hop(sid, len(prompt) + i, np.asarray([tok], dtype=np.int32))
            decode.append(n_decode / (time.perf_counter() - t0))
            for conn in pipes:
                conn.send(("close", sid))
        return statistics.median(prefill), statistics.median(decode)
    finally:
        for conn in pipes:
            conn.send(None)
        for proc in procs:
            proc.join(timeout=30)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print its figures."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="GGUF path (default: the bundled SmolLM2)")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--cut", type=int, default=None, help="layer where the split is cut (default: middle)")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--colocated", action="store_true",
                   help="also run the split as two processes on this machine (pipes, no network)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    prepare_llama_runtime()
    from llama_cpp import Llama

    model = resolve_model(args.model)
    n_ctx = args.prompt_tokens + args.decode_tokens + 16
    llm = Llama(str(model), n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=args.threads,
                n_threads_batch=args.threads, logits_all=False, verbose=False)
    n_layer = read_model_info(model).n_layer  # whatever the architecture
    cut = args.cut or n_layer // 2
    opts = dict(n_ctx=n_ctx, max_sessions=1, n_threads=args.threads, measure=False)
    head = LlamaShardEngine(model, 0, cut, **opts)
    tail = LlamaShardEngine(model, cut, n_layer, **opts)
    rng = np.random.default_rng(0)
    prompt = [int(x) for x in rng.integers(100, 40000, args.prompt_tokens)]
    prompt[0] = llm.token_bos()

    rows = []
    for i in range(args.repeats):  # alternate the order so drifting load hits both alike
        if i % 2:
            s = run_split(head, tail, prompt, args.decode_tokens, f"bench-{i}")
            w = run_whole(llm, prompt, args.decode_tokens)
        else:
            w = run_whole(llm, prompt, args.decode_tokens)
            s = run_split(head, tail, prompt, args.decode_tokens, f"bench-{i}")
        rows.append((w, s))
    w_pf = statistics.median(args.prompt_tokens / r[0][0] for r in rows)
    s_pf = statistics.median(args.prompt_tokens / r[1][0] for r in rows)
    w_dec = statistics.median(args.decode_tokens / r[0][1] for r in rows)
    s_dec = statistics.median(args.decode_tokens / r[1][1] for r in rows)
    prefill_ratios = [r[0][0] / r[1][0] for r in rows]
    decode_ratios = [r[0][1] / r[1][1] for r in rows]
    (_, _, w_logits, w_tokens), (_, _, s_logits, s_tokens) = rows[0]
    result = {
        "model": model.name,
        "n_threads": args.threads,
        "cut": cut,
        "repeats": args.repeats,
        "prompt_tokens": args.prompt_tokens,
        "decode_tokens": args.decode_tokens,
        "whole_prefill_tps": round(w_pf, 1),
        "split_prefill_tps": round(s_pf, 1),
        "whole_decode_tps": round(w_dec, 1),
        "split_decode_tps": round(s_dec, 1),
        "prefill_ratio": round(statistics.median(prefill_ratios), 3),
        "decode_ratio": round(statistics.median(decode_ratios), 3),
        "prefill_ratios": [round(x, 3) for x in prefill_ratios],
        "decode_ratios": [round(x, 3) for x in decode_ratios],
        "max_abs_logit_diff": float(np.abs(w_logits - s_logits).max()),
        "greedy_tokens_equal": w_tokens == s_tokens,
        "prefill_ratio_best": round(min(r[0][0] for r in rows) / min(r[1][0] for r in rows), 3),
        "decode_ratio_best": round(min(r[0][1] for r in rows) / min(r[1][1] for r in rows), 3),
        "idle_cpu_fraction": round(idle_cpu_fraction(), 4),
        "gomp_spincount": os.environ.get("GOMP_SPINCOUNT", ""),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", ""),
    }
    head.close()
    tail.close()
    llm.close()
    if args.colocated:
        c_pf, c_dec = run_colocated(model, cut, n_layer, args.threads, prompt, args.decode_tokens, args.repeats)
        result["colocated_prefill_tps"] = round(c_pf, 1)
        result["colocated_decode_tps"] = round(c_dec, 1)
        result["colocated_prefill_ratio"] = round(c_pf / w_pf, 3)
        result["colocated_decode_ratio"] = round(c_dec / w_dec, 3)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"model {result['model']}, {args.threads} threads, split [0,{cut}) + [{cut},{n_layer}), "
              f"{args.repeats} repeats (medians)")
        print(f"prefill {args.prompt_tokens} tokens: whole {w_pf:.1f} tok/s, split {s_pf:.1f} tok/s, "
              f"ratio {result['prefill_ratio']:.3f}")
        print(f"decode {args.decode_tokens} tokens: whole {w_dec:.1f} tok/s, split {s_dec:.1f} tok/s, "
              f"ratio {result['decode_ratio']:.3f}")
        print(f"max |logit diff| {result['max_abs_logit_diff']:.2e}, greedy tokens equal: "
              f"{result['greedy_tokens_equal']}")
        print(f"best-of ratios: prefill {result['prefill_ratio_best']:.3f}, decode {result['decode_ratio_best']:.3f}")
        print(f"idle CPU after work: {100 * result['idle_cpu_fraction']:.1f}% of one core "
              f"(GOMP_SPINCOUNT={result['gomp_spincount']})")
        if args.colocated:
            print(f"two co-located processes: prefill {result['colocated_prefill_tps']} tok/s "
                  f"({result['colocated_prefill_ratio']:.3f}x), decode {result['colocated_decode_tps']} tok/s "
                  f"({result['colocated_decode_ratio']:.3f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
