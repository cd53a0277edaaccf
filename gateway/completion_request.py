"""Parse and validate a legacy `POST /v1/completions` body into a CompletionRequest (pure).

It shares the chat request's sampling, stop, routing and validation fields (and its refusal of
parameters the gateway does not honour: gateway/neutral_params.py); the prompt is text or
token ids instead of messages, and `echo`, `logprobs` (the legacy count of alternatives) and
`suffix` are its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gateway.chat_request import (
    MAX_CHOICES,
    MAX_SEED,
    MAX_STOP_STRINGS,
    StreamOptions,
    check_honoured,
    invalid_value,
    is_token_id_key,
    without_unset,
)
from gateway.errors import InvalidRequestError
from gateway.response_format import output_constraint
from gateway.sampler_order import ordered
from schemas.route import RoutePolicy
from schemas.sampling import MAX_LOGIT_BIAS, SamplingParams

DEFAULT_MAX_TOKENS = 16  # the OpenAI API's default for completions


class _Body(BaseModel):
    """The fields POST /v1/completions understands (strict like the OpenAI API)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str = Field(min_length=1)
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=DEFAULT_MAX_TOKENS, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)  # 0, or vLLM's -1: off
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    logit_bias: dict[str, float] | None = Field(default=None, max_length=MAX_LOGIT_BIAS)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    response_format: Any = None  # gateway/response_format.py reads it
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool | None = False
    suffix: str | None = None
    n: int | None = Field(default=None, ge=1)
    best_of: int | None = Field(default=None, ge=1)
    restart: bool | None = None
    speculative: bool | None = None  # Meshnet: false turns speculative decoding off
    validate_: bool | None = Field(default=None, alias="validate")
    samplers: Any = None  # llama-server's sampler order: gateway/sampler_order.py reads it


CHAT_ONLY = ("messages", "tools", "tool_choice", "parallel_tool_calls")
# what check_honoured lets through: this endpoint's fields, and chat's at their neutral values
KNOWN_FIELDS = frozenset(f.alias or name for name, f in _Body.model_fields.items()) | frozenset(CHAT_ONLY)
_FIELD_NAMES = frozenset(f.alias or name for model in (_Body, StreamOptions) for name, f in model.model_fields.items())


@dataclass(slots=True, frozen=True)
class CompletionRequest:
    """A validated completion request: the prompt (text, or token ids), how to sample and stop."""

    PROMPT_PARAM: ClassVar[str] = "prompt"  # the field a context-length error names
    model: str
    prompt: str | list[int]
    sampling: SamplingParams
    max_tokens: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    echo: bool
    restart: bool | None = None
    validate: bool | None = None
    route_policy: RoutePolicy | None = None  # (chat only: the header sets it)
    n: int = 1  # choices per prompt
    suffix: str = ""  # fill in the middle: the text after the answer (a model with FIM tokens)
    prompts: tuple[str | list[int], ...] = ()  # a batch: every prompt, `prompt` the first
    speculative: bool | None = None  # may the head draft tokens (chat's `speculative`)
    batch_index: int | None = None  # a batch (`prompt` a list of prompts): which one `prompt` is

    @property
    def prompt_param(self) -> str:
        """The param an error about this prompt names: `prompt`, or `prompt[i]` for a batch's
        item i (OpenAI's param path), so the client knows which of its prompts it is."""
        return self.PROMPT_PARAM if self.batch_index is None else f"{self.PROMPT_PARAM}[{self.batch_index}]"

    @property
    def choices(self) -> int:
        """Choices in the answer: n for each prompt, prompt by prompt."""
        return max(1, len(self.prompts)) * self.n


def _refuse(param: str, message: str, code: str = "unsupported_value") -> InvalidRequestError:
    return InvalidRequestError(message, param=param, code=code)


def parse_completion_request(data: dict[str, Any]) -> CompletionRequest:
    """Validate a decoded body; bad or unsupported fields raise InvalidRequestError naming them."""
    for param in CHAT_ONLY:  # chat's messages and tools have no meaning for a bare prompt
        if data.get(param) not in (None, [], "none"):
            raise _refuse(param, f"{param} is for /v1/chat/completions", "unsupported_parameter")
    check_honoured(data, KNOWN_FIELDS)
    data, no_limit = without_unset(without_unset(data, ("seed",))[0], ("max_tokens",))
    try:
        body = _Body.model_validate(data)
    except ValidationError as exc:
        raise invalid_value(exc, _FIELD_NAMES) from exc
    prompts: list[str | list[int]] = [body.prompt]  # type: ignore[list-item]
    batched = isinstance(body.prompt, list) and bool(body.prompt) and isinstance(body.prompt[0], (str, list))
    if batched:
        prompts = list(body.prompt)  # type: ignore[arg-type]
    for i, p in enumerate(prompts):
        if not p:
            raise _refuse(f"prompt[{i}]" if batched else "prompt", "the prompt is empty", "invalid_value")
    if body.n is not None and body.n > MAX_CHOICES:  # before the batch's bound: a lone prompt's n is at fault
        raise _refuse("n", f"n is at most {MAX_CHOICES}", "invalid_value")
    if len(prompts) * (body.n or 1) > MAX_CHOICES:
        raise _refuse("prompt", f"prompts x n is at most {MAX_CHOICES} choices per request", "invalid_value")
    prompt = prompts[0]
    if body.best_of is not None and body.best_of > 1:
        raise _refuse("best_of", "best_of > 1 is not supported")
    if body.echo and body.logprobs is not None:  # 0 too: the chosen tokens' logprobs, the prompt's among them
        raise _refuse("logprobs", "logprobs with echo would need the prompt's logprobs, which no hop computes")
    if body.stream_options is not None and not body.stream:
        raise _refuse("stream_options", "stream_options is only allowed when stream is true", "invalid_value")
    stops = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    if len(stops) > MAX_STOP_STRINGS or any(s == "" for s in stops):
        raise _refuse("stop", f"at most {MAX_STOP_STRINGS} stop strings, none empty", "invalid_value")
    for token, bias in (body.logit_bias or {}).items():
        if not is_token_id_key(token) or not -100.0 <= bias <= 100.0:
            raise _refuse("logit_bias", "logit_bias maps token ids to values in [-100, 100]", "invalid_value")
    sampling = SamplingParams(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p, seed=body.seed,
        logprobs=body.logprobs is not None, top_logprobs=body.logprobs or 0,
        top_k=max(body.top_k or 0, 0), min_p=body.min_p or 0.0,
        logit_bias=tuple(sorted((int(t), float(b)) for t, b in (body.logit_bias or {}).items())),
        presence_penalty=body.presence_penalty or 0.0, frequency_penalty=body.frequency_penalty or 0.0,
        constraint=output_constraint(body.response_format),
    )
    sampling = ordered(sampling, body.samplers)
    return CompletionRequest(
        model=body.model, prompt=prompt, sampling=sampling, stop=stops,
        # null: the default, as OpenAI; -1: no limit, as llama-server
        max_tokens=None if no_limit else DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens,
        stream=bool(body.stream), include_usage=bool(body.stream_options and body.stream_options.include_usage),
        echo=bool(body.echo), restart=body.restart, validate=body.validate_, n=body.n or 1,
        prompts=tuple(prompts), suffix=body.suffix or "", speculative=body.speculative,
        batch_index=0 if batched else None,
    )
