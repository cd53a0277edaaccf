"""Does llama.cpp's batched prefill of generated tokens reproduce their step-by-step decode?

A restart's replay must rebuild the lost route's KV bit for bit (docs/benchmarks.md, "Node
loss"). This probe measures, per llama.cpp configuration, on the bundled model and a real
chat prompt:

- `stepwise`: the prompt in one call, then N greedy decode steps (one row per call), then M
  more greedy tokens (the reference continuation);
- `batched`: the same prompt in another sequence of the same context, then the N generated
  tokens as prefill calls of `chunk` rows (logits on the last row only, as the shard engine
  asks), then M greedy tokens.

It prints the max |logit diff| of the last replayed row against the decode step that
produced the same position, whether the next token and the M continuation tokens are equal, and the time of the N replay
rows done both ways (median over `--repeats`, alternating). `--layers` also compares the
per-layer activations of the last replayed row through the graph eval callback and names the
first tensor that differs. Each configuration runs in a process of its own (some settings
are read once, when libggml loads).

    .venv/bin/python bench/replay_exactness.py [--json] [--tokens 64] [--more 32] [--only fa_c32,...]
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import json
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

STORY = "Tell me a long story about a lighthouse keeper and a storm."
NOTES = (
    "The keeper's log, page by page: the lamp was trimmed at dusk, the glass was cleaned, the "
    "oil was measured and the clockwork was wound; the wind came from the west at first and "
    "then from the north, the barometer fell all afternoon, and two boats came in late. "
)
LAYER_TENSORS = re.compile(r"^(attn_norm|Qcur|Kcur|Vcur|kqv_out|attn_out|ffn_inp|ffn_norm|ffn_out|l_out)-\d+$|^result_")


@dataclass(frozen=True, slots=True)
class Config:
    """One llama.cpp setting to try (defaults: the shard engine's)."""

    name: str
    note: str
    flash_attn: bool = False
    n_threads: int = 2
    n_ubatch: int = 512
    chunk: int = 0  # rows per replay call; 0: all N in one call
    type_k: int = 1  # GGML_TYPE_F16 (0: F32, 8: Q8_0)
    type_v: int = 1
    use_extra_bufts: bool = True
    long_prompt: bool = False  # a prompt long enough that the replay crosses n_kv 512
    env: dict[str, str] = field(default_factory=dict)


CONFIGS = [
    Config("default", "flash attention off, 2 threads, n_ubatch 512, f16 KV (the shard engine)"),
    Config("no_extra_bufts", "use_extra_bufts=false (no weight repacking)", use_extra_bufts=False),
    Config("tiled_mm_off", "GGML_CPU_TILED_MM=0", env={"GGML_CPU_TILED_MM": "0"}),
    Config("fusion_off", "GGML_CPU_DISABLE_FUSION=1", env={"GGML_CPU_DISABLE_FUSION": "1"}),
    Config("threads1", "n_threads 1", n_threads=1),
    Config("kv_f32", "f32 K and V cache", type_k=0, type_v=0),
    Config("c32", "replay in calls of 32 rows", chunk=32),
    Config("ubatch1", "n_ubatch 1 (llama.cpp splits the call into one-row micro-batches)", n_ubatch=1),
    Config("fa", "flash attention on, the N rows in one call", flash_attn=True),
    Config("fa_c32", "flash attention on, replay in calls of 32 rows", flash_attn=True, chunk=32),
    Config("fa_c63", "flash attention on, replay in calls of 63+1 rows", flash_attn=True, chunk=63),
    Config("fa_ub32", "flash attention on, n_ubatch 32 (one call, llama.cpp splits it)", flash_attn=True,
           n_ubatch=32),
    Config("fa_c32_t1", "flash attention on, calls of 32 rows, 1 thread", flash_attn=True, chunk=32, n_threads=1),
    Config("fa_c32_f32", "flash attention on, calls of 32 rows, f32 KV", flash_attn=True, chunk=32, type_k=0, type_v=0),
    Config("fa_c32_long", "flash attention on, calls of 32 rows, replay crosses n_kv 512", flash_attn=True,
           chunk=32, long_prompt=True),
    Config("fa_c32_long_t1", "as fa_c32_long on 1 thread", flash_attn=True, chunk=32, long_prompt=True,
           n_threads=1),
    Config("fa_q8", "flash attention on, q8_0 K and V (neither the tiled nor the split-KV kernel), one call",
           flash_attn=True, type_k=8, type_v=8),
    Config("fa_q8_long", "as fa_q8, replay crosses n_kv 512", flash_attn=True, type_k=8, type_v=8, long_prompt=True),
    Config("fa_kq8", "flash attention on, q8_0 K and f16 V, one call", flash_attn=True, type_k=8),
    Config("fa_kq8_long", "as fa_kq8, replay crosses n_kv 512", flash_attn=True, type_k=8, long_prompt=True),
    Config("default_long", "flash attention off, replay crosses n_kv 512", long_prompt=True),
]


# -- the child: one configuration ------------------------------------------------------------


class LayerTap:
    """Copies the last token's row of named f32 graph tensors while `armed` (cb_eval)."""

    _TYPE, _NE, _NAME = 0, 16, 16 + 8 * 4 * 2 + 4 + 64 + 4 + 8 * 10 + 8 + 8 + 8

    def __init__(self) -> None:
        from nodes.llama_ffi import EvalCallback, ggml_base

        self._lib = ggml_base()
        self.armed = False
        self.n_tokens = 1
        self.rows: list[tuple[str, np.ndarray]] = []
        self.callback = EvalCallback(self._on_eval)

    def _on_eval(self, t: int, ask: bool, _ud: int) -> bool:
        if not self.armed:
            return False
        name = ctypes.string_at(t + self._NAME).decode(errors="replace")
        if ask:
            return bool(LAYER_TENSORS.match(name))
        if ctypes.c_int32.from_address(t + self._TYPE).value != 0:  # f32 only
            return True
        ne = [ctypes.c_int64.from_address(t + self._NE + 8 * i).value for i in range(4)]
        dims = [d for d in ne if d != 1] or [1]
        if self.n_tokens > 1 and dims[-1] != self.n_tokens:
            return True  # the token is not the outermost dimension (attention scores)
        n = int(np.prod(ne))
        buf = np.empty(n, dtype=np.float32)
        self._lib.ggml_backend_tensor_get(t, buf.ctypes.data, 0, n * 4)
        self.rows.append((name, buf[n - n // self.n_tokens:].copy()))
        return True


class Probe:
    """One context with sequences 0 (stepwise), 1 (batched replay) and 2 (timing)."""

    def __init__(self, cfg: Config, model_path: Path, layers: bool) -> None:
        from nodes.llama_engine import prepare_llama_runtime

        ll = self.ll = prepare_llama_runtime()
        mp = ll.llama_model_default_params()
        mp.n_gpu_layers = 0
        mp.use_extra_bufts = cfg.use_extra_bufts
        self.model = ll.llama_model_load_from_file(str(model_path).encode(), mp)
        cp = ll.llama_context_default_params()
        cp.n_seq_max = 3
        cp.n_ctx = 2048 * 3
        cp.kv_unified = False  # a KV stream per sequence, as the shard engine
        cp.n_batch = 512
        cp.n_ubatch = cfg.n_ubatch
        cp.n_threads = cp.n_threads_batch = cfg.n_threads
        cp.no_perf = True
        cp.flash_attn_type = ll.LLAMA_FLASH_ATTN_TYPE_ENABLED if cfg.flash_attn else ll.LLAMA_FLASH_ATTN_TYPE_DISABLED
        cp.type_k, cp.type_v = cfg.type_k, cfg.type_v
        self.tap = LayerTap() if layers else None
        if self.tap is not None:
            cp.cb_eval = ctypes.cast(self.tap.callback, ll.ggml_backend_sched_eval_callback)
        self.ctx = ll.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create the context")
        self.mem = ll.llama_get_memory(self.ctx)
        self.n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(self.model))
        self.batch = ll.llama_batch_init(512, 0, 1)

    def run(self, tokens: list[int], pos: int, seq: int) -> np.ndarray:
        """One llama_decode of `tokens` at `pos` in `seq`; the last row's logits."""
        b, n = self.batch, len(tokens)
        for i, tok in enumerate(tokens):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos + i, 1, int(i == n - 1)
            b.seq_id[i][0] = seq
        b.n_tokens = n
        if self.tap is not None:
            self.tap.n_tokens = n
        rc = self.ll.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        ptr = self.ll.llama_get_logits_ith(self.ctx, n - 1)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()

    def clear(self, seq: int, from_pos: int = -1) -> None:
        self.ll.llama_memory_seq_rm(self.mem, seq, from_pos, -1)


def chunks(n: int, size: int) -> list[tuple[int, int]]:
    """[0, n) in calls of `size` rows; the last row never alone (as the shard engine cuts)."""
    if size <= 0 or size >= n:
        return [(0, n)]
    cuts = [*range(0, n, size), n]
    if cuts[-1] - cuts[-2] == 1:
        cuts[-2] -= 1
    return list(itertools.pairwise(cuts))


def prompt_ids(model_path: Path, long: bool) -> list[int]:
    from gateway.tokenizer import ModelTokenizer

    tok = ModelTokenizer(model_path)
    text = STORY if not long else "Here are my notes.\n" + NOTES * 7 + "\n" + STORY
    try:
        return tok.encode_chat([{"role": "user", "content": text}])
    finally:
        tok.close()


def child(cfg: Config, n_gen: int, n_more: int, repeats: int, layers: bool) -> dict[str, Any]:
    from artifacts.bundled import bundled_model_path

    path = bundled_model_path()
    prompt = prompt_ids(path, cfg.long_prompt)
    p = Probe(cfg, path, layers)
    P = len(prompt)
    # stepwise reference in sequence 0
    logits = p.run(prompt, 0, 0)
    gen: list[int] = []
    for i in range(n_gen):
        gen.append(int(np.argmax(logits)))
        if p.tap is not None and i == n_gen - 1:
            p.tap.armed, p.tap.rows = True, []
        logits = p.run([gen[-1]], P + i, 0)
        if p.tap is not None:
            p.tap.armed = False
    step_rows = p.tap.rows if p.tap is not None else []
    step_last = logits
    step_more: list[int] = []
    for i in range(n_more):
        step_more.append(int(np.argmax(logits)))
        logits = p.run([step_more[-1]], P + n_gen + i, 0)
    # batched replay in sequence 1
    p.run(prompt, 0, 1)
    plan = chunks(n_gen, cfg.chunk)
    for k, (a, b) in enumerate(plan):
        if p.tap is not None and k == len(plan) - 1:
            p.tap.armed, p.tap.rows = True, []
        logits = p.run(gen[a:b], P + a, 1)
        if p.tap is not None:
            p.tap.armed = False
    batch_rows = p.tap.rows if p.tap is not None else []
    batch_last = logits
    batch_more: list[int] = []
    for i in range(n_more):
        batch_more.append(int(np.argmax(logits)))
        logits = p.run([batch_more[-1]], P + n_gen + i, 1)
    out: dict[str, Any] = {
        **asdict(cfg), "prompt_tokens": P, "tokens": n_gen, "more": n_more,
        "max_abs_logit_diff": float(np.abs(step_last - batch_last).max()),
        "next_token_equal": int(np.argmax(step_last)) == int(np.argmax(batch_last)),
        "continuation_equal": step_more == batch_more,
        "continuation_parts_at": next((i for i, (x, y) in enumerate(zip(step_more, batch_more, strict=True))
                                       if x != y), None),
    }
    if layers:
        out["layers"] = compare_rows(step_rows, batch_rows)
    if repeats:
        out.update(timing(p, prompt, gen, plan, repeats))
    return out


def compare_rows(step: list[tuple[str, np.ndarray]], batch: list[tuple[str, np.ndarray]]) -> dict[str, Any]:
    """Per tensor name (first occurrence in graph order): max |diff| of the last token's row."""
    first_s = dict(reversed(step))
    first_b = dict(reversed(batch))
    names = [n for n, _ in step if n in first_b and first_s[n].shape == first_b[n].shape]
    seen: list[str] = []
    for n in names:
        if n not in seen:
            seen.append(n)
    diffs = {n: float(np.abs(first_s[n] - first_b[n]).max()) for n in seen}
    first = next((n for n in seen if diffs[n] > 0), None)
    return {"first_differing": first, "compared": len(seen),
            "layer0": {n: d for n, d in diffs.items() if n.endswith("-0")},
            "l_out": {n: d for n, d in diffs.items() if n.startswith("l_out-")}}


def timing(p: Probe, prompt: list[int], gen: list[int], plan: list[tuple[int, int]], repeats: int) -> dict[str, Any]:
    """Median seconds of the N replay rows as N one-row calls and as the planned calls."""
    P = len(prompt)
    p.run(prompt, 0, 2)
    step_s, batch_s = [], []
    for _ in range(repeats):
        p.clear(2, P)
        t0 = time.perf_counter()
        for i, tok in enumerate(gen):
            p.run([tok], P + i, 2)
        step_s.append(time.perf_counter() - t0)
        p.clear(2, P)
        t0 = time.perf_counter()
        for a, b in plan:
            p.run(gen[a:b], P + a, 2)
        batch_s.append(time.perf_counter() - t0)
    s, b = statistics.median(step_s), statistics.median(batch_s)
    return {"stepwise_ms": round(s * 1e3, 1), "batched_ms": round(b * 1e3, 1), "speedup": round(s / b, 2)}


# -- the parent: one process per configuration ------------------------------------------------


def run_config(cfg: Config, args: argparse.Namespace) -> dict[str, Any]:
    env = {**os.environ, **cfg.env, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, __file__, "--child", cfg.name, "--tokens", str(args.tokens), "--more", str(args.more),
           "--repeats", str(args.repeats)] + (["--layers"] if args.layers else [])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {**asdict(cfg), "error": (proc.stderr.strip().splitlines() or ["no output"])[-1]}
    return json.loads(lines[-1])


def table(results: list[dict[str, Any]]) -> str:
    head = ("config", "max|dlogit|", "next tok", f"+{results[0].get('more', '')} equal",
            "stepwise ms", "batched ms", "note")
    rows = [head]
    for r in results:
        if "error" in r:
            rows.append((r["name"], "error", "", "", "", "", r["error"]))
            continue
        rows.append((r["name"], f"{r['max_abs_logit_diff']:.3g}", str(r["next_token_equal"]),
                     "yes" if r["continuation_equal"] else f"no (at {r['continuation_parts_at']})",
                     str(r.get("stepwise_ms", "")), str(r.get("batched_ms", "")), r["note"]))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--tokens", type=int, default=64, help="generated tokens replayed")
    ap.add_argument("--more", type=int, default=32, help="greedy tokens compared after the replay")
    ap.add_argument("--repeats", type=int, default=3, help="timing repeats (0: no timing)")
    ap.add_argument("--only", default="", help="comma-separated configuration names")
    ap.add_argument("--layers", action="store_true", help="compare per-layer activations (eval callback)")
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    by_name = {c.name: c for c in CONFIGS}
    if args.child:
        print(json.dumps(child(by_name[args.child], args.tokens, args.more, args.repeats, args.layers)))
        return
    names = [n for n in args.only.split(",") if n] or list(by_name)
    results = []
    for n in names:
        results.append(run_config(by_name[n], args))
        if not args.json:
            print(f"{n}: done", file=sys.stderr)
    if args.json:
        print(json.dumps({"results": results}, indent=1))
    else:
        print(table(results))
        for r in results:
            if "layers" in r:
                print(f"{r['name']}: first differing tensor {r['layers']['first_differing']}; layer 0 "
                      + ", ".join(f"{k} {v:.3g}" for k, v in r["layers"]["layer0"].items()))


if __name__ == "__main__":
    main()
