"""POST /tokenize and POST /detokenize, as llama-server and vLLM serve them, with the gateway's own
tokenizer (the GGUF's vocabulary, the ids a chat or completion request is routed with).

/tokenize takes either form (by the field that carries the text):
- llama-server's `content` (`add_special` false, `parse_special` true, `with_pieces` false by
  default): {"tokens": [id, ...]}, or with pieces [{"id", "piece"}, ...], a piece that is no
  whole UTF-8 text being its list of bytes;
- vLLM's `prompt` (`add_special_tokens` true: a BOS where the vocabulary asks for one, as
  /v1/completions tokenizes it) or `messages` (the chat template, with `tools`, exactly the ids
  /v1/chat/completions routes): {"count", "max_model_len", "tokens", "token_strs"} (`token_strs`:
  the vocabulary's text of each token with `return_token_strs`, else null).
/detokenize takes {"tokens": [...]} and answers the text (special tokens as their text, as both
servers do) under both servers' keys, llama-server's `content` and vLLM's `prompt`.
A field of neither form is a 400 naming it; a `model` must name the served model (404 otherwise).
"""

from __future__ import annotations

import asyncio
from typing import Any, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gateway.api_chat import CHAT, error_response
from gateway.chat_request import invalid_value, parse_chat_request, parse_json_body
from gateway.errors import ApiError, InvalidRequestError, ModelNotFoundError
from gateway.request_body import read_body
from gateway.state import MESH, MODEL
from gateway.tokenizer import ModelTokenizer

MAX_TOKENS_IN = 1 << 20  # ids one /detokenize may carry (a body is at most --max-body-bytes anyway)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None


class LlamaTokenize(_Strict):
    content: str
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class VllmTokenize(_Strict):
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class VllmChatTokenize(_Strict):
    messages: list[Any]
    tools: Any = None
    add_generation_prompt: Literal[True] = True  # the chat endpoint always opens the assistant's turn
    continue_final_message: Literal[False] = False
    add_special_tokens: Literal[False] = False  # the template writes any BOS
    return_token_strs: bool = False


class Detokenize(_Strict):
    tokens: list[int] = Field(max_length=MAX_TOKENS_IN)


def _form(data: dict[str, Any]) -> type[_Strict]:
    """Which server's request this is, by the field that carries its text (pure)."""
    for key, form in (("content", LlamaTokenize), ("messages", VllmChatTokenize), ("prompt", VllmTokenize)):
        if key in data:
            return form
    raise InvalidRequestError("the text to tokenize goes in `content` (llama-server), `prompt` or `messages` "
                              "(vLLM)", param="content", code="missing_required_parameter")


def _parsed(form: type[_Strict], data: dict[str, Any]) -> Any:
    try:
        return form.model_validate(data)
    except ValidationError as exc:
        names = frozenset(form.model_fields)
        raise invalid_value(exc, names) from exc


def _piece(tok: ModelTokenizer, token: int) -> str | list[int]:
    raw = tok.special_piece_bytes(token)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


def tokenize_answer(tok: ModelTokenizer, req: Any, n_ctx: int) -> dict[str, Any]:
    """The /tokenize answer of a parsed request (runs off the event loop: tokenizing costs)."""
    if isinstance(req, LlamaTokenize):
        ids = tok.tokenize(req.content, special=req.parse_special, add_special=req.add_special)
        return {"tokens": [{"id": t, "piece": _piece(tok, t)} for t in ids] if req.with_pieces else ids}
    if isinstance(req, VllmChatTokenize):
        chat = parse_chat_request({"model": req.model or "-", "messages": req.messages, "tools": req.tools})
        ids = CHAT.encode(tok, chat, None)
    else:
        ids = tok.tokenize(req.prompt, special=True, add_special=req.add_special_tokens)
    return {"count": len(ids), "max_model_len": n_ctx, "tokens": ids,
            "token_strs": [tok.vocab_text(t) for t in ids] if req.return_token_strs else None}


async def _body(request: web.Request) -> dict[str, Any]:
    data = parse_json_body(await read_body(request))
    model = data.get("model")
    if model is not None and not (isinstance(model, str) and request.app[MODEL].matches(model, request.app[MESH])):
        raise ModelNotFoundError(str(model))
    return data


async def tokenize(request: web.Request) -> web.Response:
    """POST /tokenize (llama-server's or vLLM's form)."""
    try:
        data = await _body(request)
        req = _parsed(_form(data), data)
        served, mesh = request.app[MODEL], request.app[MESH]
        n_ctx = mesh.context_of(served.revision)  # the context a chat or completion prompt must fit
        return web.json_response(await asyncio.to_thread(tokenize_answer, served.tokenizer, req, n_ctx))
    except ApiError as exc:
        return error_response(exc)


async def detokenize(request: web.Request) -> web.Response:
    """POST /detokenize: {"tokens": [...]} -> the text, as `content` (llama-server) and `prompt` (vLLM)."""
    try:
        req = _parsed(Detokenize, await _body(request))
        tok = request.app[MODEL].tokenizer
        if any(not 0 <= t < tok.n_vocab for t in req.tokens):
            raise InvalidRequestError(f"tokens holds an id beyond this model's vocabulary of {tok.n_vocab}",
                                      param="tokens", code="invalid_value")
        text = await asyncio.to_thread(tok.detokenize, req.tokens)
        return web.json_response({"content": text, "prompt": text})
    except ApiError as exc:
        return error_response(exc)
