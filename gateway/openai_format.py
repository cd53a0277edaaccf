"""OpenAI chat-completion and legacy completion responses, chunks and SSE shapes (pure builders)."""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson


@dataclass(slots=True)
class TokenLogprob:
    """Logprob of one generated token and its top alternatives, as text and bytes."""

    token: str
    logprob: float
    raw: bytes
    top: list[tuple[str, float, bytes]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """The OpenAI `logprobs.content[i]` object."""
        return {
            "token": self.token,
            "logprob": self.logprob,
            "bytes": list(self.raw),
            "top_logprobs": [
                {"token": t, "logprob": lp, "bytes": list(b)} for t, lp, b in self.top
            ],
        }


@dataclass(slots=True, frozen=True)
class Usage:
    """Token counts of one completion."""

    prompt_tokens: int
    completion_tokens: int
    drafted: int = 0  # speculative decoding: tokens the route's head drafted
    accepted: int = 0  # of those, the ones the tail kept (each one a completion token)

    @classmethod
    def total(cls, prompt_tokens: int, usages: Sequence[Usage]) -> Usage:
        """The usage of several choices of one prompt."""
        return cls(prompt_tokens, sum(u.completion_tokens for u in usages),
                   sum(u.drafted for u in usages), sum(u.accepted for u in usages))

    def as_dict(self) -> dict[str, Any]:
        """The OpenAI `usage` object; with `speculation` (Meshnet's) when the head drafted."""
        d: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }
        if self.drafted:
            d["speculation"] = {"drafted_tokens": self.drafted, "accepted_tokens": self.accepted}
        return d


def _logprobs(items: list[TokenLogprob] | None) -> dict[str, Any] | None:
    return None if items is None else {"content": [i.as_dict() for i in items]}


def completion_body(
    *,
    completion_id: str,
    created: int,
    model: str,
    content: str,
    finish_reason: str,
    usage: Usage,
    logprobs: list[TokenLogprob] | None = None,
    tool_calls: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A non-streaming `chat.completion` object (`tool_calls`: the message's calls; its content
    is then None when it says nothing else)."""
    message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
    if tool_calls:
        message = {**message, "content": content or None, "tool_calls": tool_calls}
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": _logprobs(logprobs),
                "finish_reason": finish_reason,
            }
        ],
        "usage": usage.as_dict(),
    }


@dataclass(slots=True, frozen=True)
class ChunkFactory:
    """Builds `chat.completion.chunk` objects of one streamed completion."""

    completion_id: str
    created: int
    model: str
    include_usage: bool = False

    def _chunk(self, choices: list[dict[str, Any]], usage: Usage | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.completion_id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": choices,
        }
        if self.include_usage:
            out["usage"] = usage.as_dict() if usage is not None else None
        return out

    def delta(
        self,
        *,
        content: str | None = None,
        role: bool = False,
        logprobs: list[TokenLogprob] | None = None,
        finish_reason: str | None = None,
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """One chunk with a content delta (and the role on the first one), or tool calls."""
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if content is not None:
            delta["content"] = content
        if tool_calls:
            delta["tool_calls"] = tool_calls
        return self._chunk(
            [
                {
                    "index": 0,
                    "delta": delta,
                    "logprobs": _logprobs(logprobs),
                    "finish_reason": finish_reason,
                }
            ]
        )

    def usage(self, usage: Usage) -> dict[str, Any]:
        """The extra final chunk with empty choices and the usage (include_usage only)."""
        return self._chunk([], usage)

    def prompt_progress(self, prompt_tokens: int, time_ms: float | None) -> dict[str, Any]:
        """llama-server's `prompt_progress` chunk (its `return_progress`) for a prompt the whole
        route has processed: an empty delta and {total, cache, processed, time_ms}. `cache` is 0:
        every prompt token went through the route as a frame (a hop reusing a shared prefix's rows
        does not tell the gateway). `time_ms`: the prefill from its first frame to the tail's
        token (left out if it was not measured)."""
        out = self._chunk([{"index": 0, "delta": {}, "logprobs": None, "finish_reason": None}])
        progress: dict[str, Any] = {"total": prompt_tokens, "cache": 0, "processed": prompt_tokens}
        if time_ms is not None:
            progress["time_ms"] = round(time_ms, 3)
        out["prompt_progress"] = progress
        return out


def sse_data(payload: dict[str, Any] | str) -> bytes:
    """One SSE event carrying `data:` only (a JSON object, or a literal like [DONE])."""
    data = payload if isinstance(payload, str) else orjson.dumps(payload).decode()
    return f"data: {data}\n\n".encode()


def sse_event(data: str, *, event_id: int | None = None, event: str | None = None) -> bytes:
    """One SSE event with optional `id:` and `event:` lines (data must be one line)."""
    lines = []
    if event_id is not None:
        lines.append(f"id: {event_id}")
    if event is not None:
        lines.append(f"event: {event}")
    lines.append(f"data: {data}")
    return ("\n".join(lines) + "\n\n").encode()


def sse_comment(text: str = "keep-alive") -> bytes:
    """An SSE comment line (clients ignore it; proxies see traffic)."""
    return f": {text}\n\n".encode()


class AnswerFormat(Protocol):
    """How one endpoint's answers look (chat.completion, or the legacy text_completion): the
    generation path is the same, only the objects differ."""

    def opening(self) -> dict[str, Any] | None:
        """The first streamed chunk, before any token (None: none)."""
        ...

    def delta(self, text: str, logprobs: list[TokenLogprob] | None) -> list[dict[str, Any]]:
        """The chunks of some text (none: a format may hold it back)."""
        ...

    def finish(self, reason: str, cut: bool = False) -> list[dict[str, Any]]:
        """The last chunks, the finish reason in the last one (`cut`: max_tokens or a stop
        string ended the answer, not the model: Finished.cut)."""
        ...

    def usage(self, usage: Usage) -> dict[str, Any]: ...

    def body(self, content: str, finish_reason: str, usage: Usage,
             logprobs: list[TokenLogprob] | None, cut: bool = False) -> dict[str, Any]: ...


@dataclass(slots=True)
class ChatFormat:
    """`chat.completion` and `chat.completion.chunk` objects."""

    chunks: ChunkFactory

    def opening(self) -> dict[str, Any] | None:
        return self.chunks.delta(role=True, content="")

    def delta(self, text: str, logprobs: list[TokenLogprob] | None) -> list[dict[str, Any]]:
        return [self.chunks.delta(content=text, logprobs=logprobs)]

    def finish(self, reason: str, cut: bool = False) -> list[dict[str, Any]]:
        return [self.chunks.delta(finish_reason=reason)]

    def usage(self, usage: Usage) -> dict[str, Any]:
        return self.chunks.usage(usage)

    def body(self, content: str, finish_reason: str, usage: Usage, logprobs: list[TokenLogprob] | None,
             cut: bool = False) -> dict[str, Any]:
        c = self.chunks
        return completion_body(completion_id=c.completion_id, created=c.created, model=c.model, content=content,
                               finish_reason=finish_reason, usage=usage, logprobs=logprobs)


def legacy_logprobs(items: list[TokenLogprob], offset: int,
                    utf8: codecs.IncrementalDecoder) -> tuple[dict[str, Any], int]:
    """The legacy completions `logprobs` object of these tokens. `text_offset`: where each
    token's text begins in the choice's text, from `offset`, counting the characters the
    tokens before it completed (`utf8` carries a character split across tokens: its first
    token adds nothing, the one that ends it adds one); and the offset after them."""
    offsets, at = [], offset
    for i in items:
        offsets.append(at)
        at += len(utf8.decode(i.raw))
    return {"tokens": [i.token for i in items], "token_logprobs": [i.logprob for i in items],
            "top_logprobs": [_with_chosen(i) for i in items], "text_offset": offsets}, at


def _with_chosen(item: TokenLogprob) -> dict[str, float]:
    """A legacy `top_logprobs` entry: the top alternatives and the chosen token, always (so up
    to N + 1 entries, as OpenAI's legacy API and vLLM)."""
    top = {t: lp for t, lp, _ in item.top}
    top.setdefault(item.token, item.logprob)
    return top


def _utf8() -> codecs.IncrementalDecoder:
    return codecs.getincrementaldecoder("utf-8")(errors="replace")


@dataclass(slots=True)
class TextFormat:
    """The legacy `text_completion` objects of POST /v1/completions (one choice)."""

    completion_id: str
    created: int
    model: str
    include_usage: bool = False
    echo: str = ""  # the prompt's text, sent before the answer
    _offset: int = 0  # characters of the echo and the tokens so far (the legacy logprobs' text_offset)
    _utf8: codecs.IncrementalDecoder = field(default_factory=_utf8)  # the tokens' bytes so far

    def _object(self, choices: list[dict[str, Any]], usage: Usage | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.completion_id, "object": "text_completion", "created": self.created,
                               "model": self.model, "system_fingerprint": None, "choices": choices}
        if self.include_usage:
            out["usage"] = usage.as_dict() if usage is not None else None
        return out

    def _choice(self, text: str, logprobs: dict[str, Any] | None, finish_reason: str | None) -> dict[str, Any]:
        return {"text": text, "index": 0, "logprobs": logprobs, "finish_reason": finish_reason}

    def opening(self) -> dict[str, Any] | None:
        if not self.echo:
            return None
        self._offset = len(self.echo)
        return self._object([self._choice(self.echo, None, None)])

    def delta(self, text: str, logprobs: list[TokenLogprob] | None) -> list[dict[str, Any]]:
        if logprobs is None:
            return [self._object([self._choice(text, None, None)])]
        lp, self._offset = legacy_logprobs(logprobs, self._offset, self._utf8)
        return [self._object([self._choice(text, lp, None)])]

    def finish(self, reason: str, cut: bool = False) -> list[dict[str, Any]]:
        return [self._object([self._choice("", None, reason)])]

    def usage(self, usage: Usage) -> dict[str, Any]:
        return self._object([], usage)

    def body(self, content: str, finish_reason: str, usage: Usage, logprobs: list[TokenLogprob] | None,
             cut: bool = False) -> dict[str, Any]:
        lp = legacy_logprobs(logprobs, len(self.echo), _utf8())[0] if logprobs is not None else None
        out = self._object([self._choice(self.echo + content, lp, finish_reason)])
        out["usage"] = usage.as_dict()
        return out
