"""Sampling parameters a Route Session carries to its tail shard."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

MAX_LOGIT_BIAS = 300


class SamplingParams(BaseModel):
    """How the tail turns logits into a token. temperature == 0 means greedy."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    temperature: float = Field(default=0.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)  # the OpenAI API's: a non-negative integer
    top_logprobs: int = Field(default=0, ge=0, le=20)
    logprobs: bool = False
    top_k: int = Field(default=0, ge=0)  # keep the k most likely tokens (0: all)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)  # keep tokens at least min_p x the likeliest's probability
    # (token id, added to its logit) pairs, in [-100, 100] as the OpenAI API's; applied before
    # everything else, greedy included
    logit_bias: tuple[tuple[int, float], ...] = Field(default=(), max_length=MAX_LOGIT_BIAS)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
