"""The figures behind replay validation's tolerances (docs/validation.md).

    python bench/validation_tolerance.py [--json] [--tokens 32]

On the bundled model, one chat prompt, --tokens greedy tokens from llama.cpp whole:
1. `torch_*`: the PyTorch reference fed the same tokens (teacher-forced): the largest and the
   median |logprob difference| per token, and the largest gap between a token's logprob and
   PyTorch's own best at that position (a near-tie PyTorch would break the other way);
2. `split_*`: llama.cpp as two shards [0, 15) + [15, 30), the hidden rows handed over in
   numpy: the first position whose token differs from the whole model's and the largest
   |logprob difference| before it, with no noise (the baseline: expected exactly 0) and with
   nodes.faults.perturb_rows noise of sigma x RMS on the rows between the shards.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from artifacts.bundled import bundled_model_path  # noqa: E402
from nodes.engine_factory import load_engine  # noqa: E402
from nodes.faults import perturb_rows  # noqa: E402
from nodes.sampling import log_softmax  # noqa: E402

PROMPT = b"<|im_start|>user\nWrite a short poem about the sea and the mountains.<|im_end|>\n<|im_start|>assistant\n"
SIGMAS = (0.0, 0.001, 0.01, 0.05)


def _prompt(path: Path) -> np.ndarray:
    import llama_cpp

    tok = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    return np.asarray(tok.tokenize(PROMPT, special=True), dtype=np.int32)


def _greedy(first_logits: np.ndarray, start: int, n: int,
            step: Callable[[int, int], np.ndarray]) -> tuple[list[int], np.ndarray]:
    """n greedy tokens from `first_logits`; step(position, token) -> the next logits."""
    out, ids, lps = first_logits, [], []
    for i in range(n):
        lp = log_softmax(out)
        t = int(np.argmax(lp))
        ids.append(t)
        lps.append(lp[t])
        out = step(start + i, t)
    return ids, np.asarray(lps)


def whole_greedy(path: Path, prompt: np.ndarray, n: int) -> tuple[list[int], np.ndarray]:
    e = load_engine("llama.cpp", path, 0, 30, n_ctx=512)
    e.open_session("s")
    first = e.forward("s", 0, token_ids=prompt, want_logits=True).logits
    out = _greedy(first, len(prompt), n, lambda pos, t: e.forward(
        "s", pos, token_ids=np.asarray([t], np.int32), want_logits=True).logits)
    e.close()
    return out


def torch_forced(path: Path, prompt: np.ndarray, ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    e = load_engine("torch", path, 0, 30, n_ctx=512)
    e.open_session("s")
    out = e.forward("s", 0, token_ids=prompt, want_logits=True)
    lps, gaps = [], []
    for i, t in enumerate(ids):
        lp = log_softmax(out.logits)
        lps.append(lp[t])
        gaps.append(lp.max() - lp[t])
        out = e.forward("s", len(prompt) + i, token_ids=np.asarray([t], np.int32), want_logits=True)
    e.close()
    return np.asarray(lps), np.asarray(gaps)


def split_greedy(path: Path, prompt: np.ndarray, n: int, sigma: float) -> tuple[list[int], np.ndarray]:
    head, tail = load_engine("llama.cpp", path, 0, 15, n_ctx=512), load_engine("llama.cpp", path, 15, 30, n_ctx=512)
    head.open_session("s")
    tail.open_session("s")
    rng = np.random.default_rng(0)

    def hop(rows: np.ndarray) -> np.ndarray:
        return perturb_rows(rows, sigma, rng) if sigma else rows

    def step(pos: int, t: int) -> np.ndarray:
        rows = head.forward("s", pos, token_ids=np.asarray([t], np.int32)).hidden
        return tail.forward("s", pos, hidden=hop(rows), want_logits=True).logits

    first = tail.forward("s", 0, hidden=hop(head.forward("s", 0, token_ids=prompt).hidden), want_logits=True).logits
    out = _greedy(first, len(prompt), n, step)
    head.close()
    tail.close()
    return out


def measure(n: int) -> dict[str, Any]:
    path = bundled_model_path()
    prompt = _prompt(path)
    ids, lps = whole_greedy(path, prompt, n)
    out: dict[str, Any] = {"tokens": n, "prompt_tokens": len(prompt)}
    t_lps, gaps = torch_forced(path, prompt, ids)
    d = np.abs(t_lps - lps)
    out |= {"torch_max_abs_logprob_diff": float(d.max()), "torch_median_abs_logprob_diff": float(np.median(d)),
            "torch_max_gap_to_its_best": float(gaps.max())}
    for sigma in SIGMAS:
        s_ids, s_lps = split_greedy(path, prompt, n, sigma)
        first = next((i for i in range(n) if s_ids[i] != ids[i]), None)
        upto = n if first is None else first
        key = f"split_sigma_{sigma:g}"
        out[f"{key}_first_token_diff"] = first
        out[f"{key}_max_abs_logprob_diff"] = float(np.abs(s_lps[:upto] - lps[:upto]).max()) if upto else None
        out[f"{key}_first_logprob_diff"] = float(abs(s_lps[0] - lps[0]))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true")
    p.add_argument("--tokens", type=int, default=32)
    args = p.parse_args(argv)
    out = measure(args.tokens)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for k, v in out.items():
            print(f"{k:44} {v:.4g}" if isinstance(v, float) else f"{k:44} {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
