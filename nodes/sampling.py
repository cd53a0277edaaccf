"""The tail's token choice from one row of logits: the penalties and logit_bias first, then the
output constraint's mask, then greedy, or top_k, min_p, temperature and top_p in the session's
order (SamplingParams.order, from llama-server's `samplers`; by default top_k and min_p on the
model's own probabilities, temperature, then top_p), each on the candidates the earlier ones
left, as llama.cpp's sampler chain, and a draw. A session whose choice depends on what it
generated before (penalties, a constraint) keeps a TokenSampler on the tail.

Pure numpy. A seeded session draws the token at position p from a generator seeded with
(seed, p), so the same seed gives the same token at the same position however the prompt
was chunked or the session restarted; an unseeded one uses its own random generator. Logprobs are those of the model's own
distribution (log-softmax of the raw logits), whatever the temperature.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Protocol

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


def logsumexp(logits: np.ndarray) -> float:
    """log(sum(exp(logits))) of a [vocab] row: one float32 exp pass summed in float64 (a tenth
    of log_softmax's float64 cost; a logprob is asked of every validated token)."""
    m = float(logits.max())
    return m + math.log(float(np.exp(logits - np.float32(m), dtype=np.float32).sum(dtype=np.float64)))


def token_logprob(logits: np.ndarray, token: int) -> float:
    """The model's logprob of one token (as `log_softmax(logits)[token]`, without the row)."""
    return float(logits[token]) - logsumexp(logits)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Log-softmax of a [vocab] row, in float64; entry t equals token_logprob(logits, t)."""
    return logits.astype(np.float64) - logsumexp(logits)


def _log_softmax64(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x = x - x.max()
    return x - np.log(np.exp(x).sum())


def nucleus_probs(logits: np.ndarray, temperature: float, top_p: float) -> np.ndarray:
    """Probabilities after temperature scaling and top_p truncation (renormalized). A temperature
    so small that the scaled row overflows float32 (below ~1e-37: `1e-40` is a valid request)
    gives its limit, the likeliest tokens alone: softmax of inf was NaN, and the draw then
    picked token 0 (the bundled model's end of text: an empty answer)."""
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        scaled = logits / temperature
    if not np.isfinite(scaled.max()):
        probs = (logits == logits.max()).astype(np.float64)
        return probs / probs.sum()
    probs = np.exp(_log_softmax64(scaled))  # the draw's arithmetic, unchanged
    if top_p >= 1.0:
        return probs
    order = np.argsort(-probs, kind="stable")
    cum = np.cumsum(probs[order])
    keep = int(np.searchsorted(cum, top_p, side="left")) + 1  # smallest prefix with mass >= top_p
    out = np.zeros_like(probs)
    out[order[:keep]] = probs[order[:keep]]
    return out / out.sum()


def draw(probs: np.ndarray, rng: np.random.Generator) -> int:
    """`rng.choice(len(probs), p=probs)`, the same token for the same generator state (numpy's
    own steps: the normalized cumulative sum searched for one uniform draw), without choice's
    checks of `p`, which cost as much again (tests/test_shard_sampling.py compares the two)."""
    cdf = probs.cumsum()
    cdf /= cdf[-1]
    return int(cdf.searchsorted(rng.random(), side="right"))


def _cut(row: np.ndarray, stage: str, sampling: SamplingParams) -> None:
    """Drop (set to -inf, in place) the tokens one cut stage drops from `row`, judged on the
    candidates earlier stages left (llama.cpp's top_k, min_p and top_p samplers)."""
    if stage == "top_k" and sampling.top_k and sampling.top_k < row.shape[0]:
        cut = np.partition(row, -sampling.top_k)[-sampling.top_k]
        row[row < cut] = -np.inf
    elif stage == "min_p" and sampling.min_p > 0.0:  # p >= min_p x p_max  <=>  logit >= max + ln(min_p)
        row[row < row.max() + np.float32(math.log(sampling.min_p))] = -np.inf
    elif stage == "top_p" and sampling.top_p < 1.0:  # the smallest prefix with mass >= top_p, of the survivors
        probs = np.exp(_log_softmax64(row))
        order = np.argsort(-probs, kind="stable")
        keep = int(np.searchsorted(np.cumsum(probs[order]), sampling.top_p, side="left")) + 1
        row[order[keep:]] = -np.inf


def _cuts_anything(stages: tuple[str, ...], sampling: SamplingParams) -> bool:
    on = {"top_k": bool(sampling.top_k), "min_p": sampling.min_p > 0.0, "top_p": sampling.top_p < 1.0}
    return any(on.get(s, False) for s in stages)


def shaped_logits(logits: np.ndarray, sampling: SamplingParams, *, penalty: Mapping[int, float] | None = None,
                  allowed: np.ndarray | None = None) -> np.ndarray:
    """The row the choice is made from (pure): `logits` less each token's `penalty`, plus the
    logit bias, with the tokens outside `allowed` (a bool per token: the output constraint's
    mask), and those the stages the order puts before temperature drop (top_k, min_p, top_p,
    judged on the biased, untempered row), at -inf. The row itself when none is asked for: the
    usual path copies nothing."""
    untempered = sampling.untempered
    if not (sampling.logit_bias or penalty or allowed is not None or _cuts_anything(untempered, sampling)):
        return logits
    out = logits.astype(np.float32, copy=True)
    for token, amount in (penalty or {}).items():
        out[token] -= amount
    for token, bias in sampling.logit_bias:
        if 0 <= token < out.shape[0]:
            out[token] += bias
    if allowed is not None:
        n = min(len(allowed), out.shape[0])
        out[:n][~allowed[:n]] = -np.inf
        out[n:] = -np.inf
    for stage in untempered:
        _cut(out, stage, sampling)
    return out


def tempered_probs(shaped: np.ndarray, sampling: SamplingParams) -> np.ndarray:
    """The probabilities a token is drawn from (pure): `shaped` (shaped_logits) at the session's
    temperature, less what the stages after temperature drop, judged on the tempered row and
    the candidates earlier stages left, renormalized. A last top_p is nucleus_probs' own."""
    tempered = sampling.tempered
    last_top_p = sampling.top_p if tempered[-1:] == ("top_p",) else 1.0
    between = tempered[:-1] if tempered[-1:] == ("top_p",) else tempered
    if not _cuts_anything(between, sampling):
        return nucleus_probs(shaped, sampling.temperature, last_top_p)
    with np.errstate(over="ignore"):
        scaled = shaped / sampling.temperature
    if not np.isfinite(scaled.max()):  # a temperature too small for float32: the likeliest tokens alone
        return nucleus_probs(shaped, sampling.temperature, 1.0)
    for stage in between:
        _cut(scaled, stage, sampling)
    return nucleus_probs(scaled, 1.0, last_top_p)


def choose_token(
    logits: np.ndarray, sampling: SamplingParams, rng: np.random.Generator, shaped: np.ndarray | None = None
) -> TokenChoice:
    """Pick one token from a [vocab] row of logits with the session's sampling parameters
    (logprobs stay the model's own, before any bias or cut); `shaped`: the row to choose from,
    when a TokenSampler shaped it."""
    if shaped is None:
        shaped = shaped_logits(logits, sampling)
    if sampling.greedy:
        token = int(shaped.argmax())  # the method: half the cost of np.argmax on a cold cache
    else:
        token = draw(tempered_probs(shaped, sampling), rng)
    choice = TokenChoice(token_id=token)
    if sampling.top_logprobs:
        lp = log_softmax(logits)
        choice.logprob = float(lp[token])
        top = np.argsort(-lp, kind="stable")[: sampling.top_logprobs]
        choice.top_logprobs = [(int(i), float(lp[i])) for i in top]
    elif sampling.logprobs:
        choice.logprob = token_logprob(logits, token)
    return choice


class TokenSampler:
    """One session's token choice on the tail when it depends on what the session generated:
    OpenAI's presence and frequency penalties over its generated tokens, and its output
    constraint (`constraint`: made from the session's OutputConstraint). It starts from the
    tokens the session generated on earlier routes (`sampling.generated`, a restart)."""

    def __init__(self, sampling: SamplingParams, constraint: Constraint | None = None) -> None:
        self.sampling = sampling
        self.constraint = constraint
        self.counts: dict[int, int] = {}
        for token in sampling.generated:
            self.consume(token)

    def penalty(self) -> dict[int, float]:
        """Each generated token's penalty: presence_penalty once, plus frequency_penalty per time."""
        s = self.sampling
        if not (s.presence_penalty or s.frequency_penalty):
            return {}
        return {t: s.presence_penalty + s.frequency_penalty * n for t, n in self.counts.items()}

    def shape(self, logits: np.ndarray) -> np.ndarray:
        """The row the next choice is made from."""
        allowed = self.constraint.allowed() if self.constraint is not None else None
        return shaped_logits(logits, self.sampling, penalty=self.penalty(), allowed=allowed)

    def choose(self, logits: np.ndarray, rng: np.random.Generator) -> TokenChoice:
        """Choose the next token, and count it as generated."""
        choice = choose_token(logits, self.sampling, rng, shaped=self.shape(logits))
        self.consume(choice.token_id)
        return choice

    def consume(self, token: int) -> None:
        self.counts[token] = self.counts.get(token, 0) + 1
        if self.constraint is not None:
            self.constraint.consume(token)


class Constraint(Protocol):
    """What a TokenSampler needs of an output constraint (nodes/token_constraint.py)."""

    def allowed(self) -> np.ndarray: ...

    def consume(self, token: int) -> None: ...
