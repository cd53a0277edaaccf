"""Parse and validate a legacy `POST /v1/completions` body into a CompletionRequest (pure).

It shares the chat request's sampling, stop, routing and validation fields (and its refusal of
parameters the gateway does not honour: chat_request.NOT_HONOURED); the prompt is text or
token ids instead of messages, and `echo`, `logprobs` (the legacy count of alternatives) and
`suffix` are its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gateway.chat_request import MAX_SEED, MAX_STOP_STRINGS, check_honoured
from gateway.errors import InvalidRequestError
from schemas.route import RoutePolicy
from schemas.sampling import MAX_LOGIT_BIAS, SamplingParams

DEFAULT_MAX_TOKENS = 16  # the OpenAI API's default for completions


class _StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


class _Body(BaseModel):
    """The fields POST /v1/completions understands (strict like the OpenAI API)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str = Field(min_length=1)
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=DEFAULT_MAX_TOKENS, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    logit_bias: dict[str, float] | None = Field(default=None, max_length=MAX_LOGIT_BIAS)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    stream: bool | None = False
    stream_options: _StreamOptions | None = None
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool | None = False
    suffix: str | None = None
    n: int | None = Field(default=None, ge=1)
    best_of: int | None = Field(default=None, ge=1)
    restart: bool | None = None
    validate_: bool | None = Field(default=None, alias="validate")


@dataclass(slots=True, frozen=True)
class CompletionRequest:
    """A validated completion request: the prompt (text, or token ids), how to sample and stop."""

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


def _refuse(param: str, message: str, code: str = "unsupported_value") -> InvalidRequestError:
    return InvalidRequestError(message, param=param, code=code)


def parse_completion_request(data: dict[str, Any]) -> CompletionRequest:
    """Validate a decoded body; bad or unsupported fields raise InvalidRequestError naming them."""
    check_honoured(data)
    try:
        body = _Body.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = err.get("loc", ())
        param = str(loc[0]) if loc else None
        raise InvalidRequestError(f"invalid value for {param or 'request'}: {err['msg']}", param=param,
                                  code="invalid_value" if err["type"] != "missing" else "missing_required_parameter",
                                  ) from exc
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise _refuse("prompt", "one prompt per request: send several prompts as several requests")
        prompt = prompt[0]
    if not prompt:
        raise _refuse("prompt", "the prompt is empty", "invalid_value")
    if body.n is not None and body.n > 1:
        raise _refuse("n", "n > 1 is not supported: each Route Session produces one choice")
    if body.best_of is not None and body.best_of > 1:
        raise _refuse("best_of", "best_of > 1 is not supported")
    if body.suffix:
        raise _refuse("suffix", "suffix (fill in the middle) is not supported")
    if body.echo and body.logprobs:
        raise _refuse("logprobs", "logprobs with echo would need the prompt's logprobs, which no hop computes")
    if body.stream_options is not None and not body.stream:
        raise _refuse("stream_options", "stream_options is only allowed when stream is true", "invalid_value")
    stops = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    if len(stops) > MAX_STOP_STRINGS or any(s == "" for s in stops):
        raise _refuse("stop", f"at most {MAX_STOP_STRINGS} stop strings, none empty", "invalid_value")
    for token, bias in (body.logit_bias or {}).items():
        if not token.isdigit() or len(token) > 9 or not -100.0 <= bias <= 100.0:
            raise _refuse("logit_bias", "logit_bias maps token ids to values in [-100, 100]", "invalid_value")
    sampling = SamplingParams(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p, seed=body.seed,
        logprobs=body.logprobs is not None, top_logprobs=body.logprobs or 0,
        top_k=body.top_k or 0, min_p=body.min_p or 0.0,
        logit_bias=tuple(sorted((int(t), float(b)) for t, b in (body.logit_bias or {}).items())),
    )
    return CompletionRequest(
        model=body.model, prompt=prompt, sampling=sampling, max_tokens=body.max_tokens, stop=stops,
        stream=bool(body.stream), include_usage=bool(body.stream_options and body.stream_options.include_usage),
        echo=bool(body.echo), restart=body.restart, validate=body.validate_,
    )
