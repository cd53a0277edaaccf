"""Tool calls: a request's `tools` in the prompt, and the model's answer read back as calls.

How a model asks for a tool depends on its family, so each chat template gets a Tool Dialect:
- **Hermes** (Qwen 2.5/3, Hermes, and every template that writes `<tool_call>`): the template
  renders `tools` itself, and the model answers `<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>`, one block per call.
- **Llama 3.x** (a template with `<|python_tag|>` or `ipython`): one JSON object
  `{"name": ..., "parameters": {...}}`. **Mistral** (`[TOOL_CALLS]`): that tag, then a JSON list
  of `{"name": ..., "arguments": {...}}`. Both templates render `tools` themselves.
- **JSON fallback** (a template with no tool format, like the bundled SmolLM2's): the gateway
  describes the tools in a system message (FALLBACK_PROMPT) and asks for one JSON object,
  `{"tool_calls": [{"name": ..., "arguments": {...}}]}`. Earlier calls and their results are
  rendered back as text: an assistant turn with that JSON, and a user turn with the result.
With `tool_choice` "required" or a named function, the answer is constrained to a valid call of
the offered tools (an Output Constraint: the tail masks every other token), so the call is
always produced and always parses. With "auto" the model chooses; its answer is a call if it
parses as one. Streaming holds back only text that may still become a call.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from gateway.errors import InvalidRequestError, check_known_keys
from gateway.openai_format import ChatFormat, TokenLogprob, Usage, completion_body
from schemas.output_constraint import OutputConstraint

TOOL_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
MAX_TOOLS = 128
FALLBACK_PROMPT = (
    "You can call these tools (JSON schema of each one's arguments):\n{tools}\n"
    'To call tools, answer with only one JSON object: {{"tool_calls": [{{"name": "<tool name>", '
    '"arguments": {{<the arguments>}}}}]}}. Otherwise answer normally.'
)
FALLBACK_KEY = '{"tool_calls"'
MAX_PARALLEL_CALLS = 8  # a forced answer's most calls: a small model may repeat one call until its context is full


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=lambda: dict(NO_PARAMETERS), hash=False)

    def as_openai(self) -> dict[str, Any]:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass(frozen=True, slots=True)
class ToolRequest:
    """A request's tools, and how it wants them used: `choice` is "auto", "required", or the
    name of the one function it must call."""

    tools: tuple[Tool, ...]
    choice: str = "auto"
    parallel: bool = True

    @property
    def forced(self) -> bool:
        return self.choice != "auto"

    @property
    def offered(self) -> tuple[Tool, ...]:
        if self.choice in ("auto", "required"):
            return self.tools
        return tuple(t for t in self.tools if t.name == self.choice)


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as the OpenAI API carries it

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def _refuse(param: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(message, param=param, code="invalid_value")


# what a tool may say; any other key is a 400 naming it. `strict` is accepted as vLLM does: a
# forced call (tool_choice "required" or named) is constrained to the parameters either way, and
# a call the model chooses under "auto" is parsed, not constrained, either way
TOOL_KEYS = {"type", "function"}
FUNCTION_KEYS = {"name", "description", "parameters", "strict"}
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


def parse_tools(tools: Any, choice: Any, parallel: Any) -> ToolRequest | None:
    """The request's tools (None: none, or `tool_choice` "none"); InvalidRequestError naming
    the parameter that is malformed."""
    if parallel is not None and not isinstance(parallel, bool):  # malformed with or without tools
        raise _refuse("parallel_tool_calls", "parallel_tool_calls must be a boolean")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise _refuse("tool_choice", "tool_choice needs tools")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise _refuse("tools", f"tools must be a list of at most {MAX_TOOLS} functions")
    parsed: list[Tool] = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not TOOL_NAME.match(fn["name"]):
            raise _refuse(f"tools[{i}]", 'each tool is {"type": "function", "function": {"name": ..., '
                                         '"parameters": {...}}}, its name of letters, digits, _ . -')
        check_known_keys(t, TOOL_KEYS, f"tools[{i}]")
        check_known_keys(fn, FUNCTION_KEYS, f"tools[{i}].function")
        if not isinstance(fn.get("strict", False), bool | None):
            raise _refuse(f"tools[{i}].function.strict", "strict must be a boolean")
        params = fn.get("parameters", dict(NO_PARAMETERS))  # none: a function of no arguments, as OpenAI
        if not isinstance(params, dict):
            raise _refuse(f"tools[{i}].function.parameters", "parameters must be a JSON schema object")
        description = fn.get("description") or ""
        if not isinstance(description, str):
            raise _refuse(f"tools[{i}].function.description", "description must be a string")
        parsed.append(Tool(fn["name"], description, params))
    names = [t.name for t in parsed]
    if len(set(names)) != len(names):
        raise _refuse("tools", "tool names must differ")
    if choice is None or choice == "auto":
        mode = "auto"
    elif choice == "none":
        return None
    elif choice == "required":
        mode = "required"
    elif (name := _named_choice(choice)) in names:
        mode = name
    else:
        raise _refuse("tool_choice", 'tool_choice is "none", "auto", "required" or '
                                     '{"type": "function", "function": {"name": <one of the tools>}}')
    # a named function is called once unless several calls are asked for (as vLLM): a small model
    # forced to call it may otherwise repeat the call until MAX_PARALLEL_CALLS
    return ToolRequest(tuple(parsed), mode, parallel is True or (parallel is None and mode in ("auto", "required")))


def _named_choice(choice: Any) -> str | None:
    """The function a `{"type": "function", "function": {"name": ...}}` tool_choice names (None:
    it is no such object); any other key in it is a 400 naming its path."""
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(choice.get("function"), dict):
        return None
    check_known_keys(choice, {"type", "function"}, "tool_choice")
    check_known_keys(choice["function"], {"name"}, "tool_choice.function")
    name = choice["function"].get("name")
    return name if isinstance(name, str) else None


DEF_SECTIONS = {"$defs": "", "definitions": "definitions_"}  # a tool's sections, and their names' prefixes
DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})  # values, never schemas


def _hoisted(params: dict[str, Any], key: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A tool's parameters schema to nest in a call's schema, and the definitions its `$ref`s
    name, for the `$defs` at the root of the document it goes in (pure). A reference is read
    from the document's root, which is no longer the tool's schema (pydantic's nested models
    come as `#/$defs/Item`): `#/$defs/Item` becomes `#/$defs/<key>_Item` (`#/definitions/Item`
    `#/$defs/<key>_definitions_Item`), and any other pointer into the tool's schema (`#`,
    `#/properties/x`, as zod writes them) points into its copy at `#/$defs/<key>`."""
    defs: dict[str, Any] = {}
    for section, prefix in DEF_SECTIONS.items():
        found = params.get(section)
        if isinstance(found, dict):
            defs.update({f"{key}_{prefix}{name}": d for name, d in found.items()})
    rooted = False

    def moved(ref: str) -> str:
        nonlocal rooted
        for section, prefix in DEF_SECTIONS.items():
            head = f"#/{section}/"
            if ref.startswith(head):
                return f"#/$defs/{key}_{prefix}{ref[len(head):]}"
        if ref == "#" or ref.startswith("#/"):
            rooted = True
            return f"#/$defs/{key}{ref[1:]}"
        return ref

    def renamed(node: Any) -> Any:
        if isinstance(node, list):
            return [renamed(v) for v in node]
        if not isinstance(node, dict):
            return node
        out = {k: v if k in DATA_KEYWORDS else renamed(v) for k, v in node.items()}
        if isinstance(node.get("$ref"), str):
            out["$ref"] = moved(node["$ref"])
        return out

    body = renamed({k: v for k, v in params.items() if k not in DEF_SECTIONS})
    defs = {name: renamed(d) for name, d in defs.items()}
    if rooted:
        defs[key] = body
    return body, defs


def _one_call(tools: Sequence[Tool], args: str = "arguments") -> tuple[dict[str, Any], dict[str, Any]]:
    """The schema of one call of any of `tools` (its arguments under `args`), and the `$defs`
    its document's root needs."""
    alternatives, defs = [], {}
    for i, t in enumerate(tools):
        params, found = _hoisted(t.parameters, f"tool{i}")
        defs.update(found)
        alternatives.append({"type": "object", "properties": {"name": {"const": t.name}, args: params},
                             "required": ["name", args], "additionalProperties": False})
    return {"anyOf": alternatives}, defs


def _rooted(schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    return {**schema, "$defs": defs} if defs else schema


def call_schema(tools: Sequence[Tool]) -> dict[str, Any]:
    """The JSON schema of one call of any of `tools` (pure)."""
    return _rooted(*_one_call(tools))


def calls_schema(request: ToolRequest, wrap: Callable[[dict[str, Any]], dict[str, Any]] = lambda s: s
                 ) -> dict[str, Any]:
    """The JSON schema of a forced answer's list of calls: at least one, one if not parallel,
    else at most MAX_PARALLEL_CALLS (pure); `wrap` puts the list in the document, whose root
    gets the tools' `$defs`."""
    one, defs = _one_call(request.offered)
    return _rooted(wrap({"type": "array", "items": one, "minItems": 1,
                         "maxItems": MAX_PARALLEL_CALLS if request.parallel else 1}), defs)


def _calls_from(items: Any, names: set[str]) -> list[ToolCall] | None:
    """Calls from a decoded list of {"name", "arguments"} (None: it is not one)."""
    if not isinstance(items, list) or not items:
        return None
    calls = []
    for item in items:
        if not isinstance(item, dict) or item.get("name") not in names:
            return None
        args = item.get("arguments", item.get("parameters", {}))
        calls.append(ToolCall(new_call_id(), item["name"], args if isinstance(args, str) else json.dumps(args)))
    return calls


def _complete_calls(text: str, names: set[str]) -> list[ToolCall]:
    """The calls a cut-off fallback answer (`{"tool_calls": [{...}, {...}, {...` ) completed."""
    start = text.find("[")
    decoder, items, i = json.JSONDecoder(), [], start + 1
    while start >= 0:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        try:
            item, i = decoder.raw_decode(text, i)
        except ValueError:
            break
        items.append(item)
    return [c for item in items for c in _calls_from([item], names) or ()]


class ToolDialect(Protocol):
    """One family's way of putting tools in the prompt and calls in the answer."""

    def render(self, messages: list[dict[str, Any]], request: ToolRequest | None
               ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The messages for the chat template, and extra template variables."""
        ...

    def parse(self, text: str, request: ToolRequest) -> tuple[str | None, list[ToolCall]]:
        """The answer's text outside calls (None if none) and its calls."""
        ...

    def sendable(self, text: str) -> int:
        """How much of a streamed answer so far may go out as text: the rest may become a call."""
        ...

    def constraint(self, request: ToolRequest) -> OutputConstraint | None:
        """What a forced call's answer is constrained to."""
        ...


def _assistant_calls(message: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for c in message.get("tool_calls") or [] if isinstance(c, dict)]


def _arguments(call: dict[str, Any]) -> Any:
    raw = call.get("function", {}).get("arguments", "{}")
    try:
        return json.loads(raw) if isinstance(raw, str) else raw
    except ValueError:
        return raw


@dataclass(slots=True)
class JsonFallback:
    """Tools described in a system message; a call is one JSON object (module docstring).
    `in_system` False puts the description in the first user turn instead, for a template that
    refuses a system message (Mistral's first ones, Gemma's raise on one)."""

    in_system: bool = True

    def render(self, messages: list[dict[str, Any]], request: ToolRequest | None
               ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        names: dict[str, str] = {}  # call id -> tool name, for the results
        out: list[dict[str, Any]] = []
        for m in messages:
            calls = _assistant_calls(m) if m["role"] == "assistant" else []
            if calls:
                for c in calls:
                    names[str(c.get("id", ""))] = str(c.get("function", {}).get("name", ""))
                text = json.dumps({"tool_calls": [{"name": c.get("function", {}).get("name"),
                                                   "arguments": _arguments(c)} for c in calls]})
                out.append({"role": "assistant", "content": ((m.get("content") or "") + "\n" + text).strip()})
            elif m["role"] == "tool":
                call_id = str(m.get("tool_call_id", ""))
                out.append({"role": "user", "content": f"Result of the tool call {names.get(call_id, '')} "
                                                       f"({call_id}):\n{m.get('content', '')}"})
            else:
                out.append({"role": m["role"], "content": m.get("content", "")})
        if request is not None:
            described = "\n".join(json.dumps({"name": t.name, "description": t.description,
                                              "arguments": t.parameters}) for t in request.offered)
            out = _with_tools_prompt(out, FALLBACK_PROMPT.format(tools=described), self.in_system)
        return out, {}

    def parse(self, text: str, request: ToolRequest) -> tuple[str | None, list[ToolCall]]:
        stripped, names = text.strip(), {t.name for t in request.offered}
        if stripped.startswith("{"):
            try:
                data = json.loads(stripped)
            except ValueError:
                data = None
            if isinstance(data, dict):
                calls = _calls_from(data.get("tool_calls"), names)
                if calls:
                    return None, calls
            elif self.sendable(text) == 0:  # a call list cut off (max_tokens, a stop string): never shown as text
                return None, _complete_calls(stripped, names)
        return text, []

    def sendable(self, text: str) -> int:
        squeezed = re.sub(r"\s+", "", text)
        if not squeezed or FALLBACK_KEY.startswith(squeezed) or squeezed.startswith(FALLBACK_KEY):
            return 0
        return len(text)

    def constraint(self, request: ToolRequest) -> OutputConstraint | None:
        if not request.forced:
            return None
        schema = calls_schema(request, lambda calls: {"type": "object", "properties": {"tool_calls": calls},
                                                      "required": ["tool_calls"], "additionalProperties": False})
        return OutputConstraint(kind="json_schema", schema_text=json.dumps(schema), name="tool_calls")


HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
HERMES_OPEN = "<tool_call>"


class Hermes:
    """Templates that render `tools` and expect `<tool_call>{...}</tool_call>` blocks."""

    def render(self, messages: list[dict[str, Any]], request: ToolRequest | None
               ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        out = []
        for m in messages:
            calls = _assistant_calls(m) if m["role"] == "assistant" else []
            if calls:  # the templates read the arguments as an object
                m = {**m, "tool_calls": [{**c, "function": {**c.get("function", {}), "arguments": _arguments(c)}}
                                         for c in calls]}
            out.append(m)
        return out, ({"tools": [t.as_openai() for t in request.offered]} if request is not None else {})

    def parse(self, text: str, request: ToolRequest) -> tuple[str | None, list[ToolCall]]:
        blocks = HERMES_CALL.findall(text)
        if not blocks:
            return text, []
        items = []
        for block in blocks:
            try:
                items.append(json.loads(block))
            except ValueError:
                return text, []
        calls = _calls_from(items, {t.name for t in request.offered})
        if not calls:
            return text, []
        rest = HERMES_CALL.sub("", text).strip()
        return rest or None, calls

    def sendable(self, text: str) -> int:
        return self.held_from(text, HERMES_OPEN)

    @staticmethod
    def held_from(text: str, tag: str) -> int:
        """Where a call opened by `tag` starts, or may be starting (a prefix of it at the end)."""
        at = text.find(tag)
        if at >= 0:
            return at
        for n in range(min(len(tag) - 1, len(text)), 0, -1):
            if tag.startswith(text[-n:]):
                return len(text) - n
        return len(text)

    def constraint(self, request: ToolRequest) -> OutputConstraint | None:
        if not request.forced:
            return None
        one = f'"{HERMES_OPEN}\\n" %json {json.dumps(call_schema(request.offered))} "\\n</tool_call>"'
        more = ' ("\\n" call)*' if request.parallel else ""
        grammar = f"start: call{more}\ncall: {one}\n"
        return OutputConstraint(kind="grammar", grammar_text=grammar, name="tool_calls")


LLAMA_TAG = "<|python_tag|>"


class Llama3:
    """Llama 3.x templates (they render `tools` themselves, results as `ipython` turns): a call
    is one JSON object `{"name": ..., "parameters": {...}}`, maybe after `<|python_tag|>`."""

    render = Hermes.render

    def parse(self, text: str, request: ToolRequest) -> tuple[str | None, list[ToolCall]]:
        body = text.strip().removeprefix(LLAMA_TAG).strip()
        try:
            data = json.loads(body) if body.startswith(("{", "[")) else None
        except ValueError:
            data = None
        calls = _calls_from(data if isinstance(data, list) else [data], {t.name for t in request.offered})
        return (None, calls) if calls else (text, [])

    def sendable(self, text: str) -> int:
        stripped = text.lstrip()
        if not stripped or stripped.startswith(("{", LLAMA_TAG)) or LLAMA_TAG.startswith(stripped):
            return 0
        return len(text)

    def constraint(self, request: ToolRequest) -> OutputConstraint | None:
        if not request.forced:
            return None
        one = _rooted(*_one_call(request.offered, "parameters"))
        return OutputConstraint(kind="json_schema", schema_text=json.dumps(one), name="tool_call")


MISTRAL_TAG = "[TOOL_CALLS]"


class Mistral:
    """Mistral templates: calls are `[TOOL_CALLS]` and a JSON list of `{"name", "arguments"}`."""

    render = Hermes.render

    def parse(self, text: str, request: ToolRequest) -> tuple[str | None, list[ToolCall]]:
        before, tag, after = text.partition(MISTRAL_TAG)
        if not tag:
            return text, []
        try:
            data = json.loads(after.strip())
        except ValueError:
            return text, []
        calls = _calls_from(data if isinstance(data, list) else [data], {t.name for t in request.offered})
        return (before.strip() or None, calls) if calls else (text, [])

    def sendable(self, text: str) -> int:
        return Hermes.held_from(text, MISTRAL_TAG)

    def constraint(self, request: ToolRequest) -> OutputConstraint | None:
        if not request.forced:
            return None
        calls = calls_schema(request)
        return OutputConstraint(kind="grammar", name="tool_calls",
                                grammar_text=f'start: "{MISTRAL_TAG}" %json {json.dumps(calls)}\n')


def _with_tools_prompt(messages: list[dict[str, Any]], prompt: str, in_system: bool) -> list[dict[str, Any]]:
    """`messages` with the tools' description after the leading system message's text (or in a
    new one); without `in_system`, before the first user message's text (pure)."""
    out = list(messages)
    if in_system:
        at = 0 if out and out[0]["role"] == "system" else None
    else:
        at = next((i for i, m in enumerate(out) if m["role"] == "user"), None)
    if at is None:
        return [{"role": "system" if in_system else "user", "content": prompt}, *out]
    role, text = out[at]["role"], out[at]["content"]
    out[at] = {"role": role, "content": f"{text}\n\n{prompt}" if in_system else f"{prompt}\n\n{text}"}
    return out


def dialect_for(template_source: str) -> ToolDialect:
    """The Tool Dialect of a chat template, by the markup it writes (pure)."""
    if HERMES_OPEN in template_source:
        return Hermes()
    if MISTRAL_TAG in template_source:
        return Mistral()
    if LLAMA_TAG in template_source or "ipython" in template_source:
        return Llama3()
    return JsonFallback()


@dataclass(slots=True)
class ToolCallFormat:
    """Chat answers of a request with tools: text goes out as it comes, but for what may
    still become a call, which is read at the end into `tool_calls` (streamed as one
    `delta.tool_calls` chunk per call, `finish_reason` "tool_calls")."""

    inner: ChatFormat
    dialect: ToolDialect
    request: ToolRequest
    text: str = ""
    sent: int = 0  # characters of `text` sent as content
    held: list[TokenLogprob] | None = None  # the logprobs of tokens held back (None: none asked)

    def opening(self) -> dict[str, Any] | None:
        return self.inner.opening()

    def delta(self, text: str, logprobs: list[TokenLogprob] | None) -> list[dict[str, Any]]:
        self.text += text
        if logprobs is not None:
            self.held = [*(self.held or ()), *logprobs]
        upto = max(self.sent, self.dialect.sendable(self.text))
        if upto == self.sent:
            return []  # held, and its logprobs with it
        piece, self.sent = self.text[self.sent:upto], upto
        released, self.held = self.held, None if self.held is None else []
        return self.inner.delta(piece, released)

    def _read(self, text: str, cut: bool) -> tuple[str | None, list[ToolCall]]:
        """The answer's text (None: none) and calls. Call markup cut off (`cut`: by max_tokens or
        a stop string) gives its whole calls, or nothing, never its wrapper as text; markup the
        model ended itself that is no call (malformed JSON) is text, as the model wrote it."""
        content, calls = self.dialect.parse(text, self.request)
        if content is None and not calls and not cut:
            return text, []
        return content, calls

    def finish(self, reason: str, cut: bool = False) -> list[dict[str, Any]]:
        content, calls = self._read(self.text, cut or reason == "length")
        chunks = self.inner.chunks
        if not calls:  # what was held is text after all: it goes out with its logprobs
            rest = self.text[self.sent:] if content is not None else ""
            return [*(self.inner.delta(rest, self.held) if rest else []), *self.inner.finish(reason)]
        out = []
        said = content or ""
        if said.startswith(self.text[:self.sent]) and len(said) > self.sent:
            out.append(chunks.delta(content=said[self.sent:]))
        out += [chunks.delta(tool_calls=[c.as_openai(i)]) for i, c in enumerate(calls)]
        return [*out, chunks.delta(finish_reason=_finish(reason))]

    def usage(self, usage: Usage) -> dict[str, Any]:
        return self.inner.usage(usage)

    def body(self, content: str, finish_reason: str, usage: Usage,
             logprobs: list[TokenLogprob] | None, cut: bool = False) -> dict[str, Any]:
        text, calls = self._read(content, cut or finish_reason == "length")
        if not calls:
            if text is None:  # a call list cut off with no whole call: neither its text nor its logprobs
                return self.inner.body("", finish_reason, usage, _content_logprobs(logprobs, ""))
            return self.inner.body(content, finish_reason, usage, logprobs)
        c = self.inner.chunks
        return completion_body(completion_id=c.completion_id, created=c.created, model=c.model, content=text or "",
                               finish_reason=_finish(finish_reason), usage=usage,
                               logprobs=_content_logprobs(logprobs, text or ""),
                               tool_calls=[call.as_openai() for call in calls])


def _content_logprobs(logprobs: list[TokenLogprob] | None, content: str) -> list[TokenLogprob] | None:
    """The logprobs of the tokens that spell the content when it opens the answer: OpenAI gives
    none for the calls' markup (a stream holds back the same tokens' logprobs). Tokens stop at
    the first one the content does not continue with, so a call's markup never has logprobs
    (and content after a call has none either)."""
    if logprobs is None:
        return None
    want, said, kept = content.encode(), b"", []
    for lp in logprobs:
        if len(said.lstrip()) >= len(want):
            break
        said += lp.raw
        head = said.lstrip()  # (dialects strip the content)
        if not (want.startswith(head) or head.startswith(want)):
            break
        kept.append(lp)
    return kept


def _finish(reason: str) -> str:
    """A call's finish reason: "tool_calls" when the model ended it (a cut one stays "length")."""
    return "tool_calls" if reason == "stop" else reason
