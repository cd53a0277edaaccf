"""What the pinned llama.cpp does with DeepSeek-V4 (`deepseek4`) at a layer boundary, measured.

    .venv/bin/python bench/deepseek4_probe.py [--json] [--keep DIR]

Writes a random-weight 4-layer `deepseek4` GGUF with the `gguf` package (tiny widths, the
real tensor names, V4-Flash's layer kinds: compress ratios 0, 4, 128, 4 and hash-routed
layers 0-1) and measures, each risky step in a child process of its own (llama.cpp aborts
or dies of SIGFPE on some of them, and the probe reports that instead of dying):

    decode    the whole model loads and decodes greedy tokens; its n_embd, n_embd_inp and
              n_embd_out (4·n_embd: hyper-connections)
    boundary  which per-layer tensors the graph names (`l_last-<il>`, no `l_out-<il>`) and
              their shape; the captured rows of the last layer, put through the output
              head in numpy, give llama.cpp's logits (so the capture is the whole
              boundary); `llama_set_embeddings_layer_inp` hands out the mean of the 4 streams
    inject    the boundary after layer 1 fed into a shard file of layers [2, 4) through
              `batch.embd`, n_embd wide (stream mean) and 4·n_embd wide, against the
              whole model's logits
    hash      the whole model fed its own token embeddings through `batch.embd` instead
              of token ids: the hash-routed layers route differently (control: the same
              model with no hash layers)
    context   context creation for a shard file of every layer range [a, b)
    cache     llama.cpp's cache buffer sizes at two context lengths, against the cache
              formula docs/deepseek-v4-flash.md applies to V4-Flash at 128K

Findings and the decision are in docs/deepseek-v4-flash.md. No timings: nothing here is a
benchmark.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import subprocess
import sys
import tempfile
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

ARCH = "deepseek4"
RATIOS = (0, 4, 128, 4)  # per layer: raw sliding-window only, CSA (ratio 4), HCA (ratio 128)
HASH_LAYERS = 2  # layers [0, 2) pick experts by token id (V4-Flash: [0, 3))
CUT = 2  # the boundary the inject step crosses: shard [0, 2) | shard [2, 4)
PROMPT = 24
N_GREEDY = 8
TIMEOUT_S = 300.0
CACHE_CTX = 4096  # long enough that the ratio-4 caches outgrow llama.cpp's 256-cell padding
N_UBATCH = 64
# hyper-connection mixing weights are scaled up so that the Sinkhorn-normalized stream mixing is
# far from uniform, as in a trained model; with tiny random weights it averages the 4 streams
# and an n_embd-wide mean would pass for the boundary
HC_GAIN = 15.0


@dataclass(frozen=True, slots=True)
class Dims:
    """The tiny model's widths (V4-Flash's in comments)."""

    n_embd: int = 64  # 4096
    n_head: int = 4  # 64
    head_dim: int = 64  # 512: one K=V head per layer; llama.cpp rotates K in blocks of 64
    n_rot: int = 16  # 64
    q_lora: int = 32  # 1024
    o_groups: int = 2  # 8
    o_lora: int = 16  # 1024
    hc: int = 4  # 4 hyper-connection streams
    n_expert: int = 4  # 256
    n_expert_used: int = 2  # 6
    n_ff_exp: int = 32  # 2048
    idx_heads: int = 2  # 64 lightning-indexer heads
    idx_dim: int = 64  # 128
    n_swa: int = 8  # 128
    n_vocab: int = 320  # 129280
    eps: float = 1e-6


D = Dims()


def weight(name: str, *shape: int, seed: int = 0) -> np.ndarray:
    """A random tensor named by its ORIGINAL name (numpy shape = reversed ggml ne), so a shard
    file of layers [a, b) holds exactly the whole model's weights for those layers."""
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    return (rng.standard_normal(shape) * 0.2).astype(np.float32)


def layer_tensors(il: int, ratio: int, hashed: bool) -> dict[str, np.ndarray]:
    """Every tensor llama.cpp's deepseek4 loader asks for in layer `il` (load_arch_tensors)."""
    e, hd, hc_dim, mix = D.n_embd, D.head_dim, D.hc * D.n_embd, (2 + D.hc) * D.hc
    shapes: dict[str, tuple[int, ...]] = {
        "attn_norm.weight": (e,), "attn_sinks.weight": (D.n_head,),
        "attn_q_a.weight": (D.q_lora, e), "attn_q_a_norm.weight": (D.q_lora,),
        "attn_q_b.weight": (D.n_head * hd, D.q_lora),
        "attn_kv.weight": (hd, e), "attn_kv_a_norm.weight": (hd,),
        "attn_output_a.weight": (D.o_lora * D.o_groups, D.n_head * hd // D.o_groups),
        "attn_output_b.weight": (e, D.o_groups * D.o_lora),
        "hc_attn_fn.weight": (mix, hc_dim), "hc_attn_base.weight": (mix,), "hc_attn_scale.weight": (3,),
        "hc_ffn_fn.weight": (mix, hc_dim), "hc_ffn_base.weight": (mix,), "hc_ffn_scale.weight": (3,),
        "ffn_gate_inp.weight": (D.n_expert, e), "ffn_norm.weight": (e,),
        "ffn_gate_exps.weight": (D.n_expert, D.n_ff_exp, e), "ffn_up_exps.weight": (D.n_expert, D.n_ff_exp, e),
        "ffn_down_exps.weight": (D.n_expert, e, D.n_ff_exp),
        "ffn_gate_shexp.weight": (D.n_ff_exp, e), "ffn_up_shexp.weight": (D.n_ff_exp, e),
        "ffn_down_shexp.weight": (e, D.n_ff_exp),
    }
    if ratio:  # the compressor of a CSA (4, overlapping: twice as wide) or HCA (128) layer
        c = 2 * hd if ratio == 4 else hd
        shapes |= {"attn_compressor_kv.weight": (c, e), "attn_compressor_gate.weight": (c, e),
                   "attn_compressor_ape.weight": (ratio, c), "attn_compressor_norm.weight": (hd,)}
    if ratio == 4:  # the lightning indexer picks which compressed blocks a query reads
        i2 = 2 * D.idx_dim
        shapes |= {"indexer.proj.weight": (D.idx_heads, e), "indexer.attn_q_b.weight": (D.idx_heads * D.idx_dim, D.q_lora),
                   "indexer_compressor_kv.weight": (i2, e), "indexer_compressor_gate.weight": (i2, e),
                   "indexer_compressor_ape.weight": (ratio, i2), "indexer_compressor_norm.weight": (D.idx_dim,)}
    if not hashed:
        shapes["exp_probs_b.bias"] = (D.n_expert,)
    out = {k: weight(f"blk.{il}.{k}", *s) + (1.0 if "norm" in k else 0.0) for k, s in shapes.items()}
    for k in ("hc_attn_base.weight", "hc_attn_scale.weight", "hc_ffn_base.weight", "hc_ffn_scale.weight"):
        out[k] *= HC_GAIN
    if hashed:  # token id -> the n_expert_used experts it runs (int32 [n_vocab, n_expert_used])
        rng = np.random.default_rng(il)
        out["ffn_gate_tid2eid.weight"] = np.stack(
            [rng.choice(D.n_expert, D.n_expert_used, replace=False) for _ in range(D.n_vocab)]).astype(np.int32)
    return out


def shared_tensors() -> dict[str, np.ndarray]:
    """Embedding, the hyper-connection output head, final norm and LM head."""
    e = D.n_embd
    return {"token_embd.weight": weight("token_embd.weight", D.n_vocab, e),
            "output_hc_fn.weight": weight("output_hc_fn.weight", D.hc, D.hc * e),
            "output_hc_base.weight": weight("output_hc_base.weight", D.hc),
            "output_hc_scale.weight": weight("output_hc_scale.weight", 1),
            "output_norm.weight": 1 + weight("output_norm.weight", e),
            "output.weight": weight("output.weight", D.n_vocab, e)}


def write_model(path: Path, start: int = 0, end: int = len(RATIOS), *, hash_layers: int = HASH_LAYERS) -> Path:
    """Layers [start, end) of the probe model as a GGUF (renumbered from 0, as a shard file is)."""
    import gguf

    ratios = list(RATIOS[start:end])
    n = end - start
    w = gguf.GGUFWriter(str(path), arch=ARCH)  # the `gguf` package here predates deepseek4: raw keys
    kv: dict[str, Any] = {
        "context_length": CACHE_CTX, "embedding_length": D.n_embd, "block_count": n,
        "attention.head_count": D.n_head, "attention.head_count_kv": 1,
        "attention.key_length": D.head_dim, "attention.value_length": D.head_dim,
        "rope.dimension_count": D.n_rot, "rope.freq_base": 10000.0,
        "attention.layer_norm_rms_epsilon": D.eps, "attention.q_lora_rank": D.q_lora,
        "attention.sliding_window": D.n_swa,
        "expert_count": D.n_expert, "expert_used_count": D.n_expert_used,
        "expert_feed_forward_length": D.n_ff_exp, "expert_shared_count": 1,
        "expert_weights_scale": 1.5, "expert_weights_norm": True, "expert_gating_func": 4,  # sqrt(softplus)
        "swiglu_clamp_exp": [10.0] * n, "swiglu_clamp_shexp": [10.0] * n,
        "attention.indexer.head_count": D.idx_heads, "attention.indexer.key_length": D.idx_dim,
        "attention.indexer.top_k": 4,
        "attention.output_group_count": D.o_groups, "attention.output_lora_rank": D.o_lora,
        "attention.compress_ratios": ratios, "attention.compress_rope_freq_base": 160000.0,
        "hyper_connection.count": D.hc, "hyper_connection.sinkhorn_iterations": 20,
        "hyper_connection.epsilon": 1e-6,
        "hash_layer_count": max(0, hash_layers - start), "embedding_length_out": D.hc * D.n_embd,
    }
    for key, value in kv.items():
        name = f"{ARCH}.{key}"
        if isinstance(value, list):
            w.add_array(name, value)
        elif isinstance(value, bool):
            w.add_bool(name, value)
        elif isinstance(value, float):
            w.add_float32(name, value)
        else:
            w.add_uint32(name, value)
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    tokens += [f"t{i}" for i in range(D.n_vocab - len(tokens))]
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * D.n_vocab)
    w.add_token_types([2, 3, 3, *([6] * 256), *([1] * (D.n_vocab - 259))])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for name, t in shared_tensors().items():
        w.add_tensor(name, t)
    for il in range(start, end):
        for name, t in layer_tensors(il, RATIOS[il], il < hash_layers).items():
            w.add_tensor(f"blk.{il - start}.{name}", t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def prompt() -> list[int]:
    return [259 + (i * 37) % (D.n_vocab - 259) for i in range(PROMPT)]


# --- the numpy side of the output head (build_hc_head + result_norm + result_output) ---------


def rms_norm(x: np.ndarray) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + D.eps)


def head_logits(boundary: np.ndarray) -> np.ndarray:
    """[T, hc·n_embd] rows after the last layer -> [T, n_vocab] logits, as the graph computes them."""
    s = shared_tensors()
    x = boundary.reshape(-1, D.hc, D.n_embd)  # ggml [n_embd, hc, T]
    mixes = rms_norm(boundary) @ s["output_hc_fn.weight"].T  # [T, hc]
    pre = 1 / (1 + np.exp(-(mixes * s["output_hc_scale.weight"] + s["output_hc_base.weight"]))) + 1e-6
    h = np.einsum("the,th->te", x, pre)  # the weighted sum of the streams
    return (rms_norm(h) * s["output_norm.weight"]) @ s["output.weight"].T


# --- child steps: each runs llama.cpp in its own process --------------------------------------


class Recorder:
    """A cb_eval callback that notes every `l_*`/`layer_inp*` tensor's name and shape and copies
    the tensors named in `want` (f32) into numpy."""

    def __init__(self, want: set[str]) -> None:
        from nodes.llama_ffi import _NE_OFFSET, EvalCallback, ggml_base, tensor_name

        self.want, self.seen, self.rows = want, {}, {}
        self._pattern = re.compile(r"^(l_\w+|layer_inp)-\d+$")  # one per layer, not its views
        self._ne, self._name, self._lib = _NE_OFFSET, tensor_name, ggml_base()
        self.callback = EvalCallback(self._on_eval)

    def _on_eval(self, t: int, ask: bool, _ud: int) -> bool:
        name = self._name(t).decode()
        if ask:
            if self._pattern.match(name):
                self.seen[name] = [int(v) for v in (ctypes.c_int64 * 4).from_address(t + self._ne)]
            return name in self.want
        if name in self.want:
            nbytes = self._lib.ggml_nbytes(t)
            buf = np.empty(nbytes // 4, np.float32)
            self._lib.ggml_backend_tensor_get(t, buf.ctypes.data, 0, nbytes)
            self.rows[name] = buf
        return True


class Llama:
    """One model and one context of the pinned llama.cpp, 1 thread."""

    def __init__(self, path: Path, *, cb: Recorder | None = None, n_ctx: int = 256, swa_full: bool = True) -> None:
        from nodes.llama_ffi import import_llama_cpp

        self.ll = ll = import_llama_cpp()
        ll.llama_backend_init()
        self.model = ll.llama_model_load_from_file(str(path).encode(), ll.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        cp = ll.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = n_ctx, N_UBATCH, N_UBATCH, 1
        cp.n_threads = cp.n_threads_batch = 1
        cp.swa_full = swa_full  # llama.cpp's default (true) sizes every sliding-window cache to n_ctx
        if cb is not None:
            cp.cb_eval = cb.callback
        self.ctx = ll.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(self.model))

    def widths(self) -> dict[str, int]:
        ll = self.ll
        return {"n_embd": ll.llama_model_n_embd(self.model), "n_embd_inp": ll.llama_model_n_embd_inp(self.model),
                "n_embd_out": ll.llama_model_n_embd_out(self.model), "n_layer": ll.llama_model_n_layer(self.model)}

    def decode(self, pos: int, *, ids: list[int] | None = None, embd: np.ndarray | None = None) -> np.ndarray:
        """One batch at positions pos.. (ids, or embd rows [T, width] of any width), every row an
        output: its [T, n_vocab] logits."""
        ll = self.ll
        n = len(ids) if ids is not None else len(embd)  # type: ignore[arg-type]
        batch = ll.llama_batch_init(n, 0 if embd is None else embd.shape[1], 1)
        try:
            if embd is None:
                for i, t in enumerate(ids or []):
                    batch.token[i] = t
            else:
                np.ctypeslib.as_array(batch.embd, shape=(embd.size,))[:] = embd.ravel()
            for i in range(n):
                batch.pos[i], batch.n_seq_id[i], batch.seq_id[i][0], batch.logits[i] = pos + i, 1, 0, 1
            batch.n_tokens = n
            if ll.llama_decode(self.ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
        finally:
            ll.llama_batch_free(batch)
        return np.stack([np.ctypeslib.as_array(ll.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,)).copy()
                         for i in range(n)])


def step_decode(model: Path, swa_full: str = "1", n_ctx: str = "256") -> dict[str, Any]:
    m = Llama(model, swa_full=swa_full == "1", n_ctx=int(n_ctx))
    logits = m.decode(0, ids=prompt())
    tokens, pos = [], PROMPT
    for _ in range(N_GREEDY):
        tokens.append(int(np.argmax(logits[-1])))
        logits = m.decode(pos, ids=tokens[-1:])
        pos += 1
    return {**m.widths(), "tokens": tokens}


def step_boundary(model: Path, out: str) -> dict[str, Any]:
    from nodes.llama_ffi import layer_input_api

    n = len(RATIOS)
    cut_name, head_name, last_name = f"l_last-{CUT - 1}", f"l_last-{n - 2}", f"l_last-{n - 1}"
    rec = Recorder({cut_name, head_name, last_name})
    m = Llama(model, cb=rec)
    set_inp, get_inp = layer_input_api()  # type: ignore[misc]
    set_inp(m.ctx, CUT, True)
    logits = m.decode(0, ids=prompt())
    mean = np.ctypeslib.as_array((ctypes.c_float * (PROMPT * D.n_embd)).from_address(get_inp(m.ctx, CUT)))
    cut = rec.rows[cut_name].reshape(PROMPT, D.hc * D.n_embd)
    np.save(Path(out) / "boundary.npy", cut)
    np.save(Path(out) / "logits.npy", logits)
    np.save(Path(out) / "head_boundary.npy", rec.rows[head_name])
    stream_mean = cut.reshape(PROMPT, D.hc, D.n_embd).mean(axis=1)
    return {
        "tensors": dict(sorted(rec.seen.items(), key=lambda kv: (kv[0].split("-")[0], int(kv[0].split("-")[-1])))),
        "l_out_names": sorted(k for k in rec.seen if k.startswith("l_out")),
        "head_from_capture_max_abs_diff": float(np.max(np.abs(head_logits(rec.rows[last_name].reshape(PROMPT, -1))
                                                              - logits))),
        "layer_inp_vs_stream_mean_max_abs_diff": float(np.max(np.abs(mean.reshape(PROMPT, D.n_embd) - stream_mean))),
        "streams_differ_max_abs": float(np.max(np.abs(cut.reshape(PROMPT, D.hc, D.n_embd) - stream_mean[:, None]))),
    }


def step_inject(tail: Path, out: str) -> dict[str, Any]:
    cut, whole = np.load(Path(out) / "boundary.npy"), np.load(Path(out) / "logits.npy")
    res: dict[str, Any] = {}
    for label, rows in (("n_embd_stream_mean", cut.reshape(PROMPT, D.hc, D.n_embd).mean(axis=1)),
                        ("hc_times_n_embd", cut)):
        m = Llama(tail)  # a fresh context each time: both start at position 0
        got = m.decode(0, embd=np.ascontiguousarray(rows, np.float32))
        res[label] = {"row_width": int(rows.shape[1]), "max_abs_logit_diff": float(np.max(np.abs(got - whole))),
                      "argmax_equal": int(np.sum(got.argmax(1) == whole.argmax(1)))}
        res["tail_widths"] = m.widths()
    res["rows"] = PROMPT
    return res


def step_head(head: Path, out: str) -> dict[str, Any]:
    """A shard file of layers [0, n-1) fed token ids: its l_last against the whole model's."""
    name = f"l_last-{len(RATIOS) - 2}"
    rec = Recorder({name})
    Llama(head, cb=rec).decode(0, ids=prompt())
    return {"max_abs_diff": float(np.max(np.abs(rec.rows[name] - np.load(Path(out) / "head_boundary.npy"))))}


def step_hash(model: Path) -> dict[str, Any]:
    ids = prompt()
    m = Llama(model)
    by_id = m.decode(0, ids=ids)
    m2 = Llama(model)
    by_embd = m2.decode(0, embd=shared_tensors()["token_embd.weight"][ids])
    return {"max_abs_logit_diff": float(np.max(np.abs(by_id - by_embd))),
            "argmax_equal": int(np.sum(by_id.argmax(1) == by_embd.argmax(1))), "rows": len(ids)}


def step_context(model: Path) -> dict[str, Any]:
    return Llama(model).widths()


STEPS = {"decode": step_decode, "boundary": step_boundary, "inject": step_inject, "head": step_head, "hash": step_hash,
         "context": step_context}


# --- the parent: one child per step ----------------------------------------------------------


def run_child(step: str, *args: Path | str) -> dict[str, Any]:
    """Run a step in a child process: its JSON, or how it died, and llama.cpp's cache log lines."""
    root = str(Path(__file__).resolve().parents[1])  # the child imports nodes.llama_ffi from here
    cmd = [sys.executable, __file__, "--step", step, *map(str, args)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, check=False, cwd=root,
                              env={**os.environ, "PYTHONPATH": root})
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"timed out after {TIMEOUT_S:.0f} s"}
    # llama.cpp's own account of each cache it allocates (MiB, 2 decimals)
    mib = [float(m) for m in re.findall(r"(?:llama_kv_cache: size|state buffer size) =\s+([\d.]+) MiB", done.stderr)]
    if done.returncode == 0 and done.stdout.strip():
        return {"ok": True, **json.loads(done.stdout.strip().splitlines()[-1]), "cache_mib": mib}
    lines = [ln.strip() for ln in done.stderr.splitlines() if ln.strip()]
    last = next((ln for ln in reversed(lines) if re.search(r"GGML_ASSERT|error|exception|failed", ln, re.I)),
                lines[-1] if lines else "")
    how = f"killed by signal {-done.returncode}" if done.returncode < 0 else f"exit code {done.returncode}"
    return {"ok": False, "returncode": done.returncode, "error": f"{how}: {last[:300]}"}


def cache_bytes(ratios: list[int], n_ctx: int, *, head_dim: int, idx_dim: int, n_swa: int, n_ubatch: int,
                swa_full: bool, kv_bytes: int = 2) -> dict[str, int]:
    """Cache bytes of one sequence in llama.cpp's deepseek4 memory (llama-kv-cache-dsv4.cpp, f16 K):
    every layer a K-only sliding-window cache (n_ctx rows when swa_full, else window + ubatch);
    a CSA layer a compressed K cache of n_ctx/4 rows and an indexer K cache as long; an HCA layer
    n_ctx/128 rows; compressor states in f32. Row counts are padded to 256 as llama.cpp does."""
    def pad(x: int) -> int:
        return -(-x // 256) * 256

    def comp(r: int) -> int:
        return pad(max(1, -(-n_ctx // r)))

    csa, hca = ratios.count(4), ratios.count(128)
    window = pad(n_ctx) if swa_full else pad(min(n_ctx, n_swa + n_ubatch))
    out = {"raw_swa": len(ratios) * window * head_dim * kv_bytes,
           "csa": csa * comp(4) * head_dim * kv_bytes, "indexer": csa * comp(4) * idx_dim * kv_bytes,
           "hca": hca * comp(128) * head_dim * kv_bytes,
           # kv + score planes of f32 state rows: CSA 8 x 2·head, indexer 8 x 2·idx, HCA 128 x head
           "states": 2 * 4 * (csa * 8 * 2 * head_dim + csa * 8 * 2 * idx_dim + hca * 128 * head_dim)}
    out["total"] = sum(out.values())
    return out


def measure(keep: Path | None) -> dict[str, Any]:
    work = keep or Path(tempfile.mkdtemp(prefix="ds4probe-"))
    work.mkdir(parents=True, exist_ok=True)
    n = len(RATIOS)
    whole = write_model(work / "whole.gguf")
    report: dict[str, Any] = {"ratios": list(RATIOS), "hash_layers": HASH_LAYERS, "cut": CUT, "dims": asdict(D)}
    report["decode"] = run_child("decode", whole)
    report["boundary"] = run_child("boundary", whole, work)
    if report["boundary"]["ok"]:
        report["inject"] = run_child("inject", write_model(work / f"tail-{CUT}-{n}.gguf", CUT, n), work)
        report["head"] = run_child("head", write_model(work / f"head-0-{n - 1}.gguf", 0, n - 1), work)
    report["hash"] = run_child("hash", whole)
    report["hash_control"] = run_child("hash", write_model(work / "nohash.gguf", hash_layers=0))
    report["context"] = {}
    for a in range(n):
        for b in range(a + 1, n + 1):
            path = whole if (a, b) == (0, n) else write_model(work / f"shard-{a}-{b}.gguf", a, b)
            got = run_child("context", path)
            report["context"][f"{a}-{b}"] = {"ratios": list(RATIOS[a:b]), "ok": got["ok"],
                                             "error": got.get("error", ""), "returncode": got.get("returncode", 0)}
    report["cache"] = {}
    for swa_full in (True, False):  # the same greedy tokens both ways: a short window cache is safe
        got = run_child("decode", whole, "1" if swa_full else "0", str(CACHE_CTX))
        formula = cache_bytes(list(RATIOS), CACHE_CTX, head_dim=D.head_dim, idx_dim=D.idx_dim, n_swa=D.n_swa,
                              n_ubatch=N_UBATCH, swa_full=swa_full)
        report["cache"][f"swa_full={swa_full}"] = {
            "n_ctx": CACHE_CTX, "ok": got["ok"], "tokens": got.get("tokens"), "llama_mib": got.get("cache_mib", []),
            "llama_total_mib": round(sum(got.get("cache_mib", [])), 2),
            "formula_total_mib": round(formula["total"] / 2**20, 2), "formula_bytes": formula}
    report["work_dir"] = str(work)
    return report


def summary(r: dict[str, Any]) -> str:
    lines = [f"deepseek4 probe: 4 layers, compress ratios {r['ratios']}, hash-routed layers [0, {r['hash_layers']})"]
    d = r["decode"]
    lines.append(f"  decode    {'ok' if d['ok'] else 'FAILS'}: " + (
        f"n_embd {d['n_embd']}, n_embd_inp {d['n_embd_inp']}, n_embd_out {d['n_embd_out']}, "
        f"{len(d['tokens'])} greedy tokens {d['tokens']}" if d["ok"] else d["error"]))
    b = r["boundary"]
    if b["ok"]:
        shapes = {k: v for k, v in b["tensors"].items() if k.startswith("l_last")}
        lines.append(f"  boundary  graph names {sorted(shapes)} with ne {next(iter(shapes.values()))}; "
                     f"l_out-* named: {b['l_out_names'] or 'none'}")
        lines.append(f"            output head in numpy from captured l_last-{len(r['ratios']) - 1}: max |logit diff| "
                     f"{b['head_from_capture_max_abs_diff']:.2e}")
        lines.append(f"            llama_set_embeddings_layer_inp({r['cut']}) = mean of the 4 streams "
                     f"(max |diff| {b['layer_inp_vs_stream_mean_max_abs_diff']:.2e}); streams differ from their "
                     f"mean by up to {b['streams_differ_max_abs']:.3f}")
    else:
        lines.append(f"  boundary  FAILS: {b['error']}")
    if "inject" in r:
        i = r["inject"]
        if i["ok"]:
            lines.append(f"  inject    shard [{r['cut']}, 4) n_embd_inp {i['tail_widths']['n_embd_inp']}:")
            for k in ("n_embd_stream_mean", "hc_times_n_embd"):
                lines.append(f"            batch.embd {i[k]['row_width']:4d} wide: max |logit diff| "
                             f"{i[k]['max_abs_logit_diff']:.3f}, argmax equal {i[k]['argmax_equal']}/{i['rows']}")
        else:
            lines.append(f"  inject    FAILS: {i['error']}")
    if "head" in r:
        h = r["head"]
        lines.append(f"  head      shard file [0, {len(r['ratios']) - 1}) fed token ids: l_last against the whole model's: "
                     + (f"max |diff| {h['max_abs_diff']:.2e}" if h["ok"] else f"FAILS: {h['error']}"))
    for key, label in (("hash", f"hash [0, {r['hash_layers']})"), ("hash_control", "no hash layers")):
        h = r[key]
        lines.append(f"  hash      {label:15s} ids vs own embeddings via batch.embd: " + (
            f"max |logit diff| {h['max_abs_logit_diff']:.3f}, argmax equal {h['argmax_equal']}/{h['rows']}"
            if h["ok"] else f"FAILS: {h['error']}"))
    for rng, c in r["context"].items():
        lines.append(f"  context   shard [{rng.replace('-', ', ')}) ratios {c['ratios']}: "
                     + ("ok" if c["ok"] else c["error"]))
    for label, c in r["cache"].items():
        lines.append(f"  cache     n_ctx {c['n_ctx']}, {label}: llama.cpp allocates {c['llama_total_mib']} MiB "
                     f"({' + '.join(map(str, c['llama_mib']))}), the formula {c['formula_total_mib']} MiB; "
                     f"greedy tokens {c['tokens']}")
    return "\n".join(lines)


def main() -> int:
    if sys.argv[1:2] == ["--step"]:
        step, model, *rest = sys.argv[2:]
        print(json.dumps(STEPS[step](Path(model), *rest)), flush=True)
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print the measurements as one JSON object")
    p.add_argument("--keep", type=Path, help="write the GGUFs and captured rows here (default: a temp dir)")
    a = p.parse_args()
    report = measure(a.keep)
    print(json.dumps(report, indent=2) if a.json else summary(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
