"""`meshnet audit MODEL.gguf [--json]`: what this runtime can do with a GGUF, measured here.

    architecture   arch, layers, width, heads, vocabulary, experts
    artifact       whether every tensor's bytes are in the file (a cut-short download is not)
    whole model    loads the whole model with the shard engine and decodes 8 greedy tokens
    layer ranges   whether a distributed layer boundary is supported: the max |logit diff|
                   and the greedy tokens of a 2-way split against the whole model, at two
                   cuts; or the reason it is not
    capability     the Capability Report's cache ABI and KV bytes per token
    weights        the bytes of the model's layers and what one token reads of them (a MoE
                   token runs only expert_used_count of expert_count experts; the tracker
                   prices an unmeasured hop by it)

Each inference check runs in a child process (`--probe`), so a model that makes llama.cpp
abort (a GGML_ASSERT) is reported as a failed check with llama.cpp's last words, not a crash
of the audit. Exit code 0 when the whole model runs, 1 when it does not or the artifact is
incomplete, 2 on bad usage.
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from pydantic import BaseModel, Field

from artifacts.gguf_header import GGUFFormatError, read_header
from artifacts.shard_file import read_model_info, shard_weights
from schemas.capability import usual_kv_profile

N_TOKENS = 8  # greedy tokens each inference check decodes
PROMPT_LEN = 16
PROBE_TIMEOUT_S = 900.0
EXACT = 1e-3  # the most |logit diff| a supported boundary may show


class ArtifactCheck(BaseModel):
    complete: bool
    file_bytes: int
    tensors: int
    problems: list[str] = Field(default_factory=list)  # what is missing or cut short


class WholeModelCheck(BaseModel):
    ok: bool
    tokens: list[int] = Field(default_factory=list)
    seconds: float = 0.0
    cache_abi: str = ""
    kv_bytes_per_token: int = 0
    error: str = ""


class CutCheck(BaseModel):
    cut: int
    ok: bool
    max_abs_diff: float | None = None
    tokens_equal: bool = False
    error: str = ""


class LayerRangeCheck(BaseModel):
    supported: bool
    reason: str = ""  # why not, when not
    cuts: list[CutCheck] = Field(default_factory=list)


class AuditReport(BaseModel):
    path: str
    arch: str
    name: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_vocab: int
    experts: int
    experts_used: int
    # the whole model's Capability Report weight fields, from the header (shard_weights): its
    # layers' bytes, and the bytes one token reads of them
    param_bytes: int = 0
    active_param_bytes_per_token: int = 0
    artifact: ArtifactCheck
    whole_model: WholeModelCheck
    layer_ranges: LayerRangeCheck
    verdict: str


# --- pure decisions -------------------------------------------------------------------------


def audit_cuts(n_layer: int) -> list[int]:
    """Two boundaries to test: about a third and two thirds in (fewer for tiny models)."""
    return sorted({c for c in (n_layer // 3, (2 * n_layer) // 3) if 0 < c < n_layer})


def probe_prompt(n_vocab: int) -> list[int]:
    """A fixed prompt of ids spread over the vocabulary (no tokenizer needed)."""
    return [1 + (i * 7919) % max(1, n_vocab - 1) for i in range(PROMPT_LEN)]


def verdict(artifact: ArtifactCheck, whole: WholeModelCheck, ranges: LayerRangeCheck) -> str:
    if not artifact.complete:
        return "incomplete artifact: fetch the missing bytes first"
    if not whole.ok:
        return "llama.cpp cannot run this file as a whole model here"
    if not ranges.supported:
        return "runs on one node only (a node may serve it whole); layer ranges are not supported"
    if all(c.ok and c.tokens_equal and (c.max_abs_diff or 0.0) <= EXACT for c in ranges.cuts):
        return "ready to split across nodes: every boundary tested is exact"
    return "layer ranges claimed but NOT exact here: do not split this model"


def check_artifact(path: Path) -> ArtifactCheck:
    """Every tensor's bytes within the file, every layer with tensors, an embedding."""
    size = path.stat().st_size
    try:
        h = read_header(path)
    except GGUFFormatError as exc:
        return ArtifactCheck(complete=False, file_bytes=size, tensors=0, problems=[str(exc)])
    problems = h.past_end(size)
    arch = str(h.get("general.architecture", ""))
    n_layer = int(h.get(f"{arch}.block_count", 0) or 0)
    layers = {int(n.split(".")[1]) for n in h.tensors if n.startswith("blk.") and n.split(".")[1].isdigit()}
    problems += [f"layer {i} has no tensors" for i in range(n_layer) if i not in layers]
    if "token_embd.weight" not in h.tensors:
        problems.append("no token_embd.weight")
    if len(problems) > 20:
        problems = [*problems[:20], f"... and {len(problems) - 20} more"]
    return ArtifactCheck(complete=not problems, file_bytes=size, tensors=len(h.tensors), problems=problems)


# --- the inference probes (each in its own child process) -----------------------------------


def _greedy(engines: list, prompt: list[int], n: int) -> tuple[np.ndarray, list[int]]:
    """Prompt logits and `n` greedy tokens through `engines` in order (a route in one process)."""
    for e in engines:
        e.open_session("audit")

    def step(ids: list[int], pos: int) -> np.ndarray:
        rows: np.ndarray = np.asarray(ids, np.int32)
        out = None
        for e in engines:
            out = e.forward("audit", pos, token_ids=rows if e is engines[0] else None,
                            hidden=None if e is engines[0] else rows, want_logits=True)
            if out.hidden is not None:
                rows = out.hidden
        assert out is not None and out.logits is not None
        return np.asarray(out.logits, np.float32).copy()

    logits = step(prompt, 0)
    first, tokens, pos = logits, [], len(prompt)
    for _ in range(n):
        tok = int(np.argmax(logits))
        tokens.append(tok)
        logits = step([tok], pos)
        pos += 1
    return first, tokens


def _probe(kind: str, path: str, cuts: list[int], n_tokens: int = N_TOKENS) -> dict[str, object]:
    """"whole": the whole model's greedy tokens and capability; "cut": the route through the
    boundaries `cuts` (2-way, 3-way ...) against the whole model."""
    from nodes.llama_engine import LlamaShardEngine, prepare_llama_runtime

    prepare_llama_runtime()
    info = read_model_info(path)
    prompt = probe_prompt(info.n_vocab)
    opts = {"n_ctx": 256, "max_sessions": 1, "measure": False,
            "kv_profile": usual_kv_profile(info.head_dim)}  # as a node runs it
    whole = LlamaShardEngine(path, 0, info.n_layer, **opts)
    try:
        t0 = time.perf_counter()
        logits, tokens = _greedy([whole], prompt, n_tokens)
        seconds = time.perf_counter() - t0
        cap = whole.capability()
    finally:
        whole.close()
    if kind == "whole":
        return {"tokens": tokens, "seconds": seconds, "cache_abi": cap.cache_abi,
                "kv_bytes_per_token": cap.cache_bytes_per_token}
    bounds = [0, *cuts, info.n_layer]
    engines = [LlamaShardEngine(path, a, b, **opts) for a, b in itertools.pairwise(bounds)]
    try:
        split_logits, split_tokens = _greedy(engines, prompt, n_tokens)
    finally:
        for e in engines:
            e.close()
    return {"max_abs_diff": float(np.max(np.abs(split_logits - logits))), "tokens_equal": split_tokens == tokens,
            "tokens": split_tokens, "whole_tokens": tokens}


def run_probe(kind: str, path: Path, cuts: list[int] | tuple[int, ...] = (),
              n_tokens: int = N_TOKENS) -> tuple[dict[str, object] | None, str]:
    """Run one probe in a child process: (its result, "") or (None, what went wrong)."""
    cmd = [sys.executable, "-m", "meshnet.audit", "--probe", kind, str(path),
           ",".join(map(str, cuts)), str(n_tokens)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {PROBE_TIMEOUT_S:.0f} s"
    if done.returncode == 0:
        try:
            return json.loads(done.stdout.strip().splitlines()[-1]), ""
        except (ValueError, IndexError):
            pass
    lines = [ln for ln in (done.stderr or "").splitlines() if ln.strip()]
    last = next((ln for ln in reversed(lines) if "GGML_ASSERT" in ln or "Error" in ln or "error" in ln),
                lines[-1] if lines else "")
    how = f"killed by signal {-done.returncode}" if done.returncode < 0 else f"exit code {done.returncode}"
    return None, f"{how}: {last.strip()[:400]}" if last else how


# --- the audit ------------------------------------------------------------------------------


def audit(path: Path, *, progress=None) -> AuditReport:  # type: ignore[no-untyped-def]
    """Measure what this runtime can do with the GGUF at `path`."""
    say = progress or (lambda _msg: None)
    info = read_model_info(path)
    weights = shard_weights(read_header(path), 0, info.n_layer)
    artifact = check_artifact(path)
    whole = WholeModelCheck(ok=False, error="not run: the artifact is incomplete")
    if artifact.complete:
        say("whole model: loading and decoding 8 tokens")
        got, err = run_probe("whole", path)
        whole = WholeModelCheck(ok=True, **got) if got is not None else WholeModelCheck(ok=False, error=err)  # type: ignore[arg-type]
    if not info.splittable:
        ranges = LayerRangeCheck(supported=False, reason=info.reason)
    elif not whole.ok:
        ranges = LayerRangeCheck(supported=False, reason="the whole model does not run, so no boundary was tested")
    else:
        cuts = []
        for c in audit_cuts(info.n_layer):
            say(f"layer ranges: split at layer {c} against the whole model")
            got, err = run_probe("cut", path, [c])
            cuts.append(CutCheck(cut=c, ok=True, max_abs_diff=got["max_abs_diff"],  # type: ignore[arg-type]
                                 tokens_equal=got["tokens_equal"]) if got is not None
                        else CutCheck(cut=c, ok=False, error=err))
        ranges = LayerRangeCheck(supported=True, cuts=cuts)
    return AuditReport(
        path=str(path), arch=info.arch, name=info.name, n_layer=info.n_layer, n_embd=info.n_embd,
        n_head=info.n_head, n_head_kv=info.n_head_kv, n_vocab=info.n_vocab, experts=info.expert_count,
        experts_used=info.expert_used_count, param_bytes=weights.param_bytes,
        active_param_bytes_per_token=weights.active_bytes, artifact=artifact, whole_model=whole, layer_ranges=ranges,
        verdict=verdict(artifact, whole, ranges),
    )


def render(r: AuditReport) -> str:
    """The report as a terminal page."""
    moe = f"{r.experts} experts, {r.experts_used} per token" if r.experts else "dense"
    lines = [f"meshnet audit: {r.path}",
             f"  architecture   {r.arch}: {r.n_layer} layers, width {r.n_embd}, {r.n_head} heads / "
             f"{r.n_head_kv} KV heads, vocabulary {r.n_vocab}, {moe}"]
    a = r.artifact
    lines.append(f"  artifact       {'complete' if a.complete else 'INCOMPLETE'}: {a.tensors} tensors, "
                 f"{a.file_bytes / 1e6:.1f} MB" + ("" if a.complete else f"; {'; '.join(a.problems[:3])}"))
    w = r.whole_model
    if w.ok:
        lines.append(f"  whole model    runs: {len(w.tokens)} greedy tokens in {w.seconds:.2f} s "
                     f"(prompt of {PROMPT_LEN} included) {w.tokens}")
    else:
        lines.append(f"  whole model    FAILS: {w.error}")
    lr = r.layer_ranges
    if not lr.supported:
        lines.append(f"  layer ranges   not supported: {lr.reason}")
    for c in lr.cuts:
        if c.ok:
            lines.append(f"  layer ranges   cut at {c.cut}: max |logit diff| {c.max_abs_diff:.3g}, "
                         f"{N_TOKENS} greedy tokens {'equal' if c.tokens_equal else 'DIFFER'}")
        else:
            lines.append(f"  layer ranges   cut at {c.cut}: FAILS: {c.error}")
    if w.ok:
        lines.append(f"  capability     cache ABI {w.cache_abi}, KV {w.kv_bytes_per_token:,} bytes per token")
    share = r.active_param_bytes_per_token / r.param_bytes if r.param_bytes else 1.0
    lines.append(f"  weights        {r.param_bytes:,} bytes in the layers, {r.active_param_bytes_per_token:,} of them "
                 f"read per token ({share:.0%})")
    lines.append(f"  verdict        {r.verdict}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--probe"]:
        kind, path = args[1], args[2]
        cuts = [int(c) for c in args[3].split(",") if c]
        print(json.dumps(_probe(kind, path, cuts, int(args[4]))), flush=True)
        return 0
    p = argparse.ArgumentParser(prog="meshnet audit", description=__doc__.split("\n\n")[0])
    p.add_argument("model", type=Path, help="a GGUF file")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    a = p.parse_args(args)
    if not a.model.is_file():
        print(f"meshnet audit: no such file: {a.model}", file=sys.stderr)
        return 2
    try:
        report = audit(a.model, progress=None if a.json else lambda m: print(f"[audit] {m}", file=sys.stderr,
                                                                              flush=True))
    except GGUFFormatError as exc:
        print(f"meshnet audit: not a GGUF file this runtime can read: {exc}", file=sys.stderr)
        return 1
    print(report.model_dump_json(indent=2) if a.json else render(report))
    return 0 if report.artifact.complete and report.whole_model.ok else 1


if __name__ == "__main__":
    sys.exit(main())
