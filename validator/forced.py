"""Score an original's tokens as its tail chose them (the reference's and the hop check's view)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from nodes.engine import ConstraintError
from nodes.sampling import TokenSampler, choose_token, logsumexp, token_rng
from nodes.token_constraint import TokenConstraint
from schemas.sampling import SamplingParams
from validator.compare import ForcedStep


class ForcedScorer:
    """Scores an original's tokens position by position as its tail chose them: the logprob of
    each is the model's own, and a greedy token is judged against the best of the row the tail
    chose from (penalties, logit bias and output constraint applied, over the original's own
    tokens so far). Also gives the token this scorer's own sampler would have drawn."""

    def __init__(self, sampling: SamplingParams, model_path: str | Path) -> None:
        self.sampling = sampling
        self.sampler = TokenSampler(sampling, TokenConstraint(sampling.constraint, model_path)
                                    if sampling.constraint is not None else None)
        self._rng = np.random.default_rng(0)

    def step(self, logits: np.ndarray, token: int, position: int) -> tuple[ForcedStep, int]:
        lse = logsumexp(logits)  # as the tail computes a token's logprob (token_logprob)
        shaped = self.sampler.shape(logits)
        own = choose_token(logits, self.sampling, token_rng(self.sampling, position, self._rng), shaped=shaped)
        logprob = float(logits[token]) - lse
        gap = float(shaped.max()) - float(shaped[token])  # how far the greedy choice was from the best
        try:
            self.sampler.consume(token)
        except ConstraintError:  # the original left the constraint: no tail of this session may
            self.sampler.constraint = None
            return ForcedStep(logprob=-math.inf, best_logprob=math.inf), own.token_id
        return ForcedStep(logprob=logprob, best_logprob=logprob + gap), own.token_id
