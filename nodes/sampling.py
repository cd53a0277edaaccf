"""The tail's token choice: greedy, temperature and top_p sampling from one row of logits.

Pure numpy. A seeded session draws the token at position p from a generator seeded with
(seed, p), so the same seed gives the same token at the same position however the prompt
was chunked or the session restarted; an unseeded one uses its own random generator. Logprobs are those of the model's own
distribution (log-softmax of the raw logits), whatever the temperature.
"""

from __future__ import annotations

import numpy as np

from nodes.engine import TokenChoice
from schemas.sampling import SamplingParams


def session_rng(sampling: SamplingParams) -> np.random.Generator:
    """The per-session random generator: seeded when the session asks for a seed."""
    return np.random.default_rng(sampling.seed)


def token_rng(sampling: SamplingParams, position: int, rng: np.random.Generator) -> np.random.Generator:
    """The generator that draws the token at `position`: from (seed, position) when seeded."""
    if sampling.seed is None:
        return rng
    return np.random.default_rng((sampling.seed, position))


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Numerically stable log-softmax of a [vocab] row, in float64."""
    x = logits.astype(np.float64)
    x = x - x.max()
    return x - np.log(np.exp(x).sum())


def nucleus_probs(logits: np.ndarray, temperature: float, top_p: float) -> np.ndarray:
    """Probabilities after temperature scaling and top_p truncation (renormalized)."""
    probs = np.exp(log_softmax(logits / temperature))
    if top_p >= 1.0:
        return probs
    order = np.argsort(-probs, kind="stable")
    cum = np.cumsum(probs[order])
    keep = int(np.searchsorted(cum, top_p, side="left")) + 1  # smallest prefix with mass >= top_p
    out = np.zeros_like(probs)
    out[order[:keep]] = probs[order[:keep]]
    return out / out.sum()


def choose_token(
    logits: np.ndarray, sampling: SamplingParams, rng: np.random.Generator
) -> TokenChoice:
    """Pick one token from a [vocab] row of logits with the session's sampling parameters."""
    if sampling.greedy:
        token = int(logits.argmax())  # the method: half the cost of np.argmax on a cold cache
    else:
        probs = nucleus_probs(logits, sampling.temperature, sampling.top_p)
        token = int(rng.choice(probs.shape[0], p=probs))
    choice = TokenChoice(token_id=token)
    if sampling.logprobs or sampling.top_logprobs:
        lp = log_softmax(logits)
        choice.logprob = float(lp[token])
        if sampling.top_logprobs:
            top = np.argsort(-lp, kind="stable")[: sampling.top_logprobs]
            choice.top_logprobs = [(int(i), float(lp[i])) for i in top]
    return choice
