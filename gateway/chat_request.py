"""Parse and validate an OpenAI chat-completion request body into a ChatRequest (pure)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from gateway.errors import ContextLengthError, InvalidRequestError, unsupported_field
from gateway.neutral_params import TUNING, neutral
from gateway.response_format import output_constraint
from gateway.sampler_order import ordered
from gateway.tool_calls import ToolRequest, parse_tools
from schemas.route import RoutePolicy
from schemas.sampling import MAX_LOGIT_BIAS, SamplingParams

MAX_STOP_STRINGS = 16
MAX_CHOICES = 8  # `n`: choices of one request, each its own Route Session
MAX_SEED = 2**63 - 1  # seeds are 64-bit signed integers in the OpenAI API; negative ones are refused
Role = Literal["system", "developer", "user", "assistant", "tool"]


def is_token_id_key(key: str) -> bool:
    """Whether a logit_bias key is a token id: 1-9 ASCII digits (pure). str.isdigit alone also
    takes digits such as '²' that int() refuses, which then failed the request with a 500."""
    return key.isascii() and key.isdigit() and len(key) <= 9


class _TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    text: str | None = None


class _FunctionCallBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(max_length=64)
    arguments: str = ""


class _ToolCallBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: str = Field(default="", max_length=128)
    type: Literal["function"] = "function"
    function: _FunctionCallBody


class _Message(BaseModel):
    # history, not instructions: an answer passed back carries the SDK's own keys (`refusal`,
    # `parsed`, a call's `index` and `parsed_arguments`, `reasoning_content`), which say nothing
    # about the next answer and are not read
    model_config = ConfigDict(extra="ignore")

    role: Role
    content: str | list[_TextPart] | None = None
    name: str | None = None
    tool_calls: list[_ToolCallBody] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = Field(default=None, max_length=128)  # a tool's result: the call it answers


class StreamOptions(BaseModel):
    """`stream_options` of both endpoints: any other key is a 400 naming it."""

    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False
    include_obfuscation: Literal[False] = False  # (the SDK's; this gateway adds no obfuscation field)

    @model_validator(mode="before")
    @classmethod
    def _neutral(cls, data: Any) -> Any:
        """vLLM's `continuous_usage_stats` passes at false, its default (true, usage in every
        chunk, is not done: a 400 naming it)."""
        if isinstance(data, dict) and data.get("continuous_usage_stats") is False:
            return {k: v for k, v in data.items() if k != "continuous_usage_stats"}
        return data


class _RoutePolicyBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["public", "private"] = "public"
    allow_nodes: list[str] = Field(default_factory=list, max_length=256)


class _Body(BaseModel):
    """The fields the gateway understands (any other top-level field is a 400 unless it is
    METADATA or one at its neutral value: check_honoured, gateway/neutral_params.py).

    Strict like the OpenAI API: a number is never a string or a bool, an integer never a
    float (`"seed": 1.5`, `"seed": true` and `"max_tokens": "10"` are 400s)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str = Field(min_length=1)
    messages: list[_Message] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    n: int | None = Field(default=None, ge=1)  # choices: each its own Route Session (gateway/choices.py)
    top_k: int | None = Field(default=None, ge=-1)  # llama-server's: keep the k likeliest (0, or vLLM's -1: all)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)  # llama-server's
    logit_bias: dict[str, float] | None = Field(default=None, max_length=MAX_LOGIT_BIAS)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    response_format: Any = None  # gateway/response_format.py reads it
    tools: Any = None  # gateway/tool_calls.py reads these three
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    restart: bool | None = None  # Meshnet: continue on a new route if a hop is lost (SDKs: extra_body)
    speculative: bool | None = None  # Meshnet: false turns speculative decoding off for this request
    route_policy: _RoutePolicyBody | None = None  # Meshnet: public, or private to an allow list (extra_body)
    validate_: bool | None = Field(default=None, alias="validate")  # Meshnet: always replay-validate this one
    return_progress: bool | None = None  # llama-server's: a prompt_progress chunk when the prompt is processed
    samplers: Any = None  # llama-server's sampler order: gateway/sampler_order.py reads it

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for token, bias in (v or {}).items():
            if not is_token_id_key(token):
                raise ValueError(f"logit_bias keys are token ids, got {token!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values are in [-100, 100], got {bias}")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        items = [v] if isinstance(v, str) else (v or [])
        if len(items) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(s == "" for s in items):
            raise ValueError("stop strings must not be empty")
        return v


@dataclass(slots=True, frozen=True)
class ChatMessage:
    """One message with its content flattened to text, ready for the chat template."""

    role: str
    content: str
    name: str | None = None
    tool_calls: tuple[dict[str, Any], ...] = ()  # an assistant's earlier calls, as the API carries them
    tool_call_id: str | None = None

    def as_template_dict(self) -> dict[str, Any]:
        """The dict the GGUF chat template sees (a Tool Dialect may rewrite it)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.name:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [dict(c) for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


@dataclass(slots=True, frozen=True)
class ChatRequest:
    """A validated chat request: what to render, how to sample, when to stop, how to answer."""

    PROMPT_PARAM: ClassVar[str] = "messages"  # the field a context-length error names
    model: str
    messages: tuple[ChatMessage, ...]
    sampling: SamplingParams
    max_tokens: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stream: bool = False
    include_usage: bool = False
    restart: bool | None = None  # None: the gateway's --restart
    route_policy: RoutePolicy | None = None  # None: the headers, else the gateway's --route-policy
    validate: bool | None = None  # None: the x-meshnet-validate header (flagged sessions are always replayed)
    tools: ToolRequest | None = None  # the tools the model may call, and how (gateway/tool_calls.py)
    n: int = 1  # choices
    speculative: bool | None = None  # may the head draft tokens (exact routes; --draft)? None: the header, else on
    reasoning_auto: bool = False  # llama-server's reasoning_format "auto": neutral only for a template that does not think
    return_progress: bool = False  # llama-server's: stream a prompt_progress chunk once the route has the prompt

    @property
    def choices(self) -> int:
        return self.n

    @property
    def prompt_param(self) -> str:
        """The param an error about the prompt names (a completion batch's names its item)."""
        return self.PROMPT_PARAM


def _flatten(msg: _Message, index: int) -> ChatMessage:
    if (msg.content is None or msg.content == []) and not (msg.role == "assistant" and msg.tool_calls):
        raise InvalidRequestError(f"a {msg.role} message needs content (only an assistant's tool calls may go without)",
                                  param=f"messages[{index}].content", code="missing_required_parameter")
    if msg.role == "tool" and not msg.tool_call_id:
        raise InvalidRequestError("a tool message names the call it answers: tool_call_id",
                                  param=f"messages[{index}].tool_call_id", code="missing_required_parameter")
    if msg.content is None:
        text = ""
    elif isinstance(msg.content, str):
        text = msg.content
    else:
        pieces = []
        for part in msg.content:
            if part.type == "text" and part.text is None:
                raise InvalidRequestError("a text content part needs its text", param=f"messages[{index}].content",
                                          code="missing_required_parameter")
            if part.type != "text" or part.text is None:
                raise InvalidRequestError(
                    f"content part type {part.type!r} is not supported; only text parts are",
                    param=f"messages[{index}].content",
                    code="unsupported_content",
                )
            pieces.append(part.text)
        text = "".join(pieces)
    calls = tuple(c.model_dump() for c in msg.tool_calls or ())
    return ChatMessage(role=msg.role, content=text, name=msg.name, tool_calls=calls, tool_call_id=msg.tool_call_id)


def _check_tool_results(messages: tuple[ChatMessage, ...]) -> None:
    """Every tool message answers a call an earlier assistant message made, as OpenAI's API asks:
    a result for no known call has no tool name to show the model."""
    made: set[str] = set()
    for i, m in enumerate(messages):
        if m.role == "assistant":
            made.update(str(c.get("id", "")) for c in m.tool_calls)
        if m.role == "tool" and m.tool_call_id not in made:
            raise InvalidRequestError(
                f"tool message {i} answers tool_call_id {m.tool_call_id!r}, which no earlier assistant "
                "message's tool_calls made", param=f"messages[{i}].tool_call_id", code="invalid_value")


BODY_FIELDS = frozenset(f.alias or name for name, f in _Body.model_fields.items())
_FIELD_NAMES = frozenset(
    f.alias or name for model in (_Body, _Message, _TextPart, StreamOptions, _ToolCallBody, _FunctionCallBody)
    for name, f in model.model_fields.items()
)


def unknown_field_error(exc: ValidationError) -> InvalidRequestError | None:
    """The 400 for a field inside a known one that the gateway does not know (pydantic's
    extra_forbidden), naming its whole path (`stream_options.continuous_usage_stats`)."""
    err = exc.errors()[0]
    if err["type"] != "extra_forbidden":
        return None
    return unsupported_field("".join(f"[{item}]" if isinstance(item, int) else f".{item}"
                                     for item in err.get("loc", ())).lstrip("."))


def _path(loc: tuple[int | str, ...], names: frozenset[str]) -> str:
    """`messages[0].content[0].text` for a pydantic location (union members' tags dropped)."""
    out = ""
    for item in loc:
        if isinstance(item, int):
            out += f"[{item}]"
        elif item in names:
            out += ("." if out else "") + item
    return out


def invalid_value(exc: ValidationError, names: frozenset[str]) -> InvalidRequestError:
    """The 400 for the first invalid field of a body (`names`: its models' field names). Where a
    value may take several shapes (a message's content: a string or a list of parts), the error
    comes from inside the shape it got furthest in (`messages[0].content[0].text`), or names
    them all when it matches none."""
    if (unknown := unknown_field_error(exc)) is not None:
        return unknown
    errors = exc.errors()
    first = _path(errors[0].get("loc", ()), names)
    same = [(_path(e.get("loc", ()), names), e) for e in errors]
    same = [(p, e) for p, e in same if p == first or p.startswith(first + "[") or p.startswith(first + ".")]
    param = max((p for p, _ in same), key=len)
    shapes = [e for p, e in same if p == param]
    msgs = list(dict.fromkeys(_readable(e["msg"]) for e in shapes))
    lead = "Input should be "
    msg = lead + " or ".join(m.removeprefix(lead) for m in msgs) if all(m.startswith(lead) for m in msgs) \
        else "; or ".join(msgs)
    return InvalidRequestError(f"invalid value for {param or 'request'}: {msg}", param=param or None,
                               code="invalid_value" if shapes[0]["type"] != "missing" else "missing_required_parameter")


def _readable(msg: str) -> str:
    """pydantic's message without the gateway's own class names."""
    head, sep, _model = msg.partition("a valid dictionary or instance of ")
    return head + "a JSON object" if sep else msg


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """Decode the request body; malformed JSON or a non-object is an InvalidRequestError."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequestError(f"request body is not valid JSON: {exc}", code="invalid_json") from exc
    if not isinstance(data, dict):
        raise InvalidRequestError("request body must be a JSON object", code="invalid_json")
    return data


# fields that describe the caller, not the answer: accepted, and nothing here acts on them, but
# of the OpenAI API's types (`"user": 5` is a 400 there, and here)
METADATA = frozenset({"user", "metadata", "safety_identifier", "prompt_cache_key"})
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512  # the OpenAI API's bounds


def check_metadata(param: str, value: Any) -> None:
    """A 400 naming a METADATA field whose value is not of its type in the OpenAI API (pure):
    a string, or for `metadata` up to 16 string pairs (keys up to 64 characters, values 512)."""
    if param != "metadata":
        if not isinstance(value, str):
            raise InvalidRequestError(f"invalid value for {param}: Input should be a valid string", param=param,
                                      code="invalid_value")
        return
    if not (isinstance(value, dict) and len(value) <= MAX_METADATA_PAIRS and all(
            len(k) <= MAX_METADATA_KEY and isinstance(v, str) and len(v) <= MAX_METADATA_VALUE
            for k, v in value.items())):
        raise InvalidRequestError(
            f"invalid value for metadata: at most {MAX_METADATA_PAIRS} pairs of strings (keys up to "
            f"{MAX_METADATA_KEY} characters, values up to {MAX_METADATA_VALUE})", param=param, code="invalid_value")


def not_honoured_error(param: str) -> InvalidRequestError:
    """The 400 for a parameter the gateway knows but does not implement, away from its neutral value."""
    if param in TUNING:
        return InvalidRequestError(
            f"{param} is not supported by this gateway: it tunes a sampler this request turns on, which this "
            "gateway does not implement as that server does; leave it out", param=param, code="unsupported_parameter")
    return InvalidRequestError(f"{param} is not supported by this gateway yet; leave it out (or at its neutral "
                               "value)", param=param, code="unsupported_parameter")


def check_honoured(data: dict[str, Any], known: frozenset[str]) -> None:
    """A 400 naming the first top-level field the gateway would have to ignore: one that is not
    `known` (the endpoint's own fields) nor METADATA, or one of gateway/neutral_params.py away
    from its neutral value. No request is answered as if a field it set had been read. A null sets
    nothing (the OpenAI API's "not given", which clients that write every field send), so it
    passes whatever the field."""
    for param, value in data.items():
        if value is None or param in known:
            continue
        if param in METADATA:
            check_metadata(param, value)
            continue
        at_neutral = neutral(param, value, data)
        if at_neutral:
            continue
        if at_neutral is None:
            raise unsupported_field(param)
        raise not_honoured_error(param)


UNSET = -1  # llama-server's "not set": max_tokens -1 is no limit (its web UI's default), seed -1 a random seed


def without_unset(data: dict[str, Any], fields: tuple[str, ...]) -> tuple[dict[str, Any], bool]:
    """The body without those of `fields` that are UNSET, and whether there were any (pure). A
    max_tokens left out ends the answer at an end-of-generation token or where the context is
    full, a seed left out draws unseeded: what llama-server's -1 means for each."""
    gone = {f for f in fields if type(data.get(f)) is int and data[f] == UNSET}
    return {k: v for k, v in data.items() if k not in gone}, bool(gone)


def _validated(data: dict[str, Any]) -> _Body:
    """The body's fields, or the 400 naming the first one that is wrong or unknown."""
    check_honoured(data, BODY_FIELDS)
    try:
        return _Body.model_validate(without_unset(data, ("max_tokens", "max_completion_tokens", "seed"))[0])
    except ValidationError as exc:
        raise invalid_value(exc, _FIELD_NAMES) from exc


def parse_chat_request(data: dict[str, Any]) -> ChatRequest:
    """Validate a decoded body; bad fields raise InvalidRequestError, and so do fields it does
    not honour (check_honoured)."""
    body = _validated(data)
    if body.n is not None and body.n > MAX_CHOICES:
        raise InvalidRequestError(f"n is at most {MAX_CHOICES}", param="n", code="invalid_value")
    if body.stream_options is not None and not body.stream:
        raise InvalidRequestError(
            "stream_options is only allowed when stream is true", param="stream_options",
            code="invalid_value",
        )
    if body.return_progress and body.stream and (body.n or 1) > 1:
        raise InvalidRequestError("return_progress is only supported with n 1", param="return_progress",
                                  code="unsupported_value")
    if body.top_logprobs and not body.logprobs:
        raise InvalidRequestError(
            "top_logprobs requires logprobs to be true", param="top_logprobs", code="invalid_value"
        )
    messages = tuple(_flatten(m, i) for i, m in enumerate(body.messages))
    _check_tool_results(messages)
    sampling = SamplingParams(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        seed=body.seed,
        logprobs=bool(body.logprobs),
        top_logprobs=body.top_logprobs or 0,
        top_k=max(body.top_k or 0, 0),
        min_p=body.min_p or 0.0,
        logit_bias=tuple(sorted((int(t), float(b)) for t, b in (body.logit_bias or {}).items())),
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        constraint=output_constraint(body.response_format),
    )
    sampling = ordered(sampling, body.samplers)
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    tools = parse_tools(body.tools, body.tool_choice, body.parallel_tool_calls)
    if tools is not None and tools.forced and sampling.constraint is not None:
        raise InvalidRequestError("response_format cannot be combined with a forced tool call (tool_choice "
                                  f"{body.tool_choice!r})", param="response_format", code="invalid_value")
    return ChatRequest(
        model=body.model,
        messages=messages,
        sampling=sampling,
        max_tokens=body.max_completion_tokens or body.max_tokens,
        stop=stop,
        stream=bool(body.stream),
        include_usage=bool(body.stream and body.stream_options and body.stream_options.include_usage),
        restart=body.restart,
        route_policy=RoutePolicy(kind=body.route_policy.kind, allow_nodes=list(body.route_policy.allow_nodes))
        if body.route_policy is not None else None,
        validate=body.validate_,
        tools=tools,
        speculative=body.speculative,
        n=body.n or 1,
        reasoning_auto=data.get("reasoning_format") == "auto",
        return_progress=bool(body.return_progress and body.stream),
    )


RESTART_HEADER = "x-meshnet-restart"
_SWITCH = {"on": True, "true": True, "1": True, "off": False, "false": False, "0": False}


def _switch(body_value: bool | None, header: str | None, default: bool, name: str) -> bool:
    """A per-request on/off switch (pure): the body's field, else header `name`, else `default`.
    A header value it does not know is a 400 even where the body's field wins (it was ignored)."""
    value = None if header is None else _SWITCH.get(header.strip().lower())
    if header is not None and value is None:
        raise InvalidRequestError(f"{name} must be on or off (or true/false, 1/0), got {header!r}", param=name,
                                  code="invalid_value")
    if body_value is not None:
        return body_value
    return default if value is None else value


def restart_wanted(body_value: bool | None, header: str | None, default: bool) -> bool:
    """Whether a request's session may move to a new route when it loses a hop: the body's
    `restart` field, else the x-meshnet-restart header (on/off), else the gateway's default."""
    return _switch(body_value, header, default, RESTART_HEADER)


VALIDATE_HEADER = "x-meshnet-validate"  # on: this session is always replayed by the validator
SPECULATIVE_HEADER = "x-meshnet-speculative"  # off: the head drafts no tokens for this session


def validate_flagged(body_value: bool | None, header: str | None) -> bool:
    """Whether the client flagged its session for replay validation (body `validate`, else the
    x-meshnet-validate header)."""
    return _switch(body_value, header, False, VALIDATE_HEADER)


def speculative_wanted(body_value: bool | None, header: str | None) -> bool:
    """Whether the head may draft tokens for a request (body `speculative`, else the
    x-meshnet-speculative header, else on)."""
    return _switch(body_value, header, True, SPECULATIVE_HEADER)


POLICY_HEADER = "x-meshnet-route-policy"  # public | private (request and response)
ALLOW_HEADER = "x-meshnet-allow-nodes"  # node ids, comma separated (a private policy's allow list)


def route_policy_wanted(body_value: RoutePolicy | None, kind_header: str | None, allow_header: str | None,
                        default: RoutePolicy) -> RoutePolicy:
    """Which nodes a request's route may use (pure): the body's `route_policy`, else the
    x-meshnet-route-policy / x-meshnet-allow-nodes headers, else the gateway's default. A
    private policy with no node on its allow list is a 400, not a route nobody can serve."""
    if body_value is not None:
        policy = body_value
    elif kind_header is None and allow_header is None:
        return default
    else:
        kind = (kind_header or ("private" if allow_header else default.kind)).strip().lower()
        if kind not in ("public", "private"):
            raise InvalidRequestError(f"{POLICY_HEADER} must be public or private, got {kind_header!r}",
                                      param=POLICY_HEADER, code="invalid_value")
        allow = [n.strip() for n in (allow_header or "").split(",") if n.strip()]
        if kind == "private" and not allow and allow_header is None:
            allow = list(default.allow_nodes)
        policy = RoutePolicy(kind=kind, allow_nodes=allow if kind == "private" else [])  # type: ignore[arg-type]
    if policy.kind == "private" and not policy.allow_nodes:
        raise InvalidRequestError("a private route policy needs at least one node on its allow list "
                                  f"(route_policy.allow_nodes or {ALLOW_HEADER})", param="route_policy",
                                  code="invalid_value")
    return policy


def check_context(prompt_tokens: int, max_tokens: int | None, n_ctx: int, prompt_param: str = "messages") -> int:
    """The token budget for the completion; raises ContextLengthError (naming `prompt_param`,
    the request's prompt field) when it does not fit."""
    if prompt_tokens >= n_ctx or (max_tokens is not None and prompt_tokens + max_tokens > n_ctx):
        asked = prompt_tokens + (max_tokens or 1)
        raise ContextLengthError(
            f"This model's maximum context length is {n_ctx} tokens. However, you requested "
            f"{asked} tokens ({prompt_tokens} in the {prompt_param}, {max_tokens or 1} in the "
            f"completion). Please reduce the length of the {prompt_param} or completion.",
            n_ctx=n_ctx, requested=asked, param=prompt_param,
        )
    budget = n_ctx - prompt_tokens
    return budget if max_tokens is None else min(max_tokens, budget)
