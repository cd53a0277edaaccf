"""Sampling parameters a Route Session carries to its tail shard."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, field_validator

from schemas.output_constraint import OutputConstraint
from schemas.protocol import Versioned, since

MAX_LOGIT_BIAS = 300
MAX_GENERATED = 131072

Stage = Literal["top_k", "min_p", "temperature", "top_p"]
# the tail's own order of the cut and scale stages (what a request without llama-server's
# `samplers` gets): top_k and min_p on the untempered row, temperature, then top_p
DEFAULT_ORDER: tuple[Stage, ...] = ("top_k", "min_p", "temperature", "top_p")


class SamplingParams(Versioned):
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
    # OpenAI's penalties, over the tokens this session generated: each token's logit less
    # presence_penalty if it was generated at all, and frequency_penalty times how often
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    constraint: OutputConstraint | None = None  # the structure the answer must have (response_format)
    # the tokens the session generated on earlier routes (a restart): the tail's penalties and
    # constraint start from them
    generated: tuple[int, ...] = Field(default=(), max_length=MAX_GENERATED)
    # the order the tail applies top_k, min_p, temperature and top_p in, each once (llama.cpp's
    # semantics: each stage works on the candidates the earlier ones left). Protocol 2: left out
    # of the JSON at its default, and a route with another order takes only nodes of protocol 2
    order: tuple[Stage, ...] = Field(default=DEFAULT_ORDER, json_schema_extra=since(2))

    @field_validator("order")
    @classmethod
    def _each_stage_once(cls, v: tuple[Stage, ...]) -> tuple[Stage, ...]:
        if sorted(v) != sorted(DEFAULT_ORDER):
            raise ValueError(f"order lists each of {DEFAULT_ORDER} exactly once, got {v}")
        return v

    @property
    def untempered(self) -> tuple[Stage, ...]:
        """The stages before temperature: they judge the untempered row."""
        return self.order[: self.order.index("temperature")]

    @property
    def tempered(self) -> tuple[Stage, ...]:
        """The stages after temperature: they judge the tempered row."""
        return self.order[self.order.index("temperature") + 1:]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def stateful(self) -> bool:
        """Whether the choice depends on what the session generated before (penalties, a
        constraint): the tail then keeps a TokenSampler per session."""
        return bool(self.presence_penalty or self.frequency_penalty or self.constraint is not None)
