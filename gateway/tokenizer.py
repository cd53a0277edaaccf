"""Tokenizer and chat template from the GGUF itself (llama.cpp in vocab_only mode)."""

from __future__ import annotations

import ctypes
import re
from collections.abc import Sequence
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

import llama_cpp

from gateway.chat_template import ChatTemplate, TemplateError
from gateway.errors import ContextLengthError
from gateway.text_stream import IncrementalDetokenizer

CONTENT_MARK = "\ue000{}\ue001"  # private-use characters around a message index (_encode_contents_as_text)
CONTENT_MARK_RE = re.compile("\ue000(\\d+)\ue001")

# Used when a GGUF carries no chat template: plain ChatML.
FALLBACK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


_QUIET_LOG = llama_cpp.llama_log_callback(lambda level, text, user_data: None)


def _quiet_llama_log() -> None:
    """llama.cpp's own log off (the nodes do the same): the vocab-only context below warned of
    its size to every user at start, and the gateway has nothing of llama.cpp's to report."""
    llama_cpp.llama_log_set(_QUIET_LOG, ctypes.c_void_p(0))


class ModelTokenizer:
    """Tokenize prompts, render the chat template and turn token ids back into bytes."""

    def __init__(self, model_path: str | Path) -> None:
        self.path = Path(model_path)
        _quiet_llama_log()
        self._llm = llama_cpp.Llama(
            model_path=str(self.path), vocab_only=True, verbose=False
        )
        self.metadata: dict[str, Any] = dict(self._llm.metadata)
        self.n_vocab = int(self._llm.n_vocab())
        arch = self.metadata.get("general.architecture", "llama")
        self.n_ctx_train = int(
            self.metadata.get(f"{arch}.context_length")
            or llama_cpp.llama_model_n_ctx_train(self._llm.model)
            or 2048
        )
        vocab = llama_cpp.llama_model_get_vocab(self._llm.model)
        self._vocab = vocab
        self.eog_ids = frozenset(
            t for t in range(self.n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, t)
        )
        bos, eos = self._llm.token_bos(), self._llm.token_eos()
        self.add_bos = bool(llama_cpp.llama_vocab_get_add_bos(vocab))
        self.template = ChatTemplate(
            source=self.metadata.get("tokenizer.chat_template") or FALLBACK_TEMPLATE,
            bos_token=self._text(bos),
            eos_token=self._text(eos),
        )
        self._token_bytes = lru_cache(maxsize=None)(self._bytes_of)
        # the text of every control or user-defined token: in a message's content it is text,
        # never the token (only the template's own markup may produce special tokens)
        special = llama_cpp.LLAMA_TOKEN_ATTR_CONTROL | llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED
        self.special_texts = frozenset(
            text for t in range(self.n_vocab)
            if llama_cpp.llama_vocab_get_attr(vocab, t) & special and (text := self._text(t)))

    def _text(self, token_id: int) -> str:
        """A token's vocabulary text (how the template writes bos_token/eos_token)."""
        if token_id < 0:
            return ""
        return llama_cpp.llama_vocab_get_text(self._vocab, token_id).decode("utf-8", "replace")

    @property
    def name(self) -> str:
        """The model's own name from its metadata (general.name), else the file stem."""
        return str(self.metadata.get("general.name") or self.path.stem)

    @property
    def n_layer(self) -> int:
        """Number of transformer layers (`<arch>.block_count`)."""
        arch = self.metadata.get("general.architecture", "llama")
        return int(self.metadata.get(f"{arch}.block_count", 0))

    def render_chat(self, messages: Sequence[dict[str, Any]], variables: dict[str, Any] | None = None) -> str:
        """Prompt text for these messages with the assistant's turn opened (`variables`: more
        names the template sees, e.g. `tools`)."""
        return self.template.render(messages, add_generation_prompt=True, variables=variables)

    def tokenize(self, text: str, *, special: bool = True, add_special: bool = False) -> list[int]:
        """Token ids of a rendered prompt; with `special`, special tokens in the text are parsed
        as such (the template's markup), else they are text.

        The template already writes any BOS it wants, so none is added here (as
        llama-cpp-python's Jinja2ChatFormatter does) unless `add_special` asks for the
        vocabulary's own (llama.cpp's add_special: a BOS where the vocabulary wants one).
        """
        return list(self._llm.tokenize(text.encode("utf-8"), add_bos=add_special, special=special))

    @cached_property
    def max_token_bytes(self) -> int:
        """The longest token's bytes: a text of B bytes is at least B / this many tokens."""
        return max((len(self.token_bytes(t)) for t in range(self.n_vocab)), default=1) or 1

    def encode_chat(self, messages: Sequence[dict[str, Any]], *, n_ctx: int | None = None,
                    variables: dict[str, Any] | None = None) -> list[int]:
        """The prompt's token ids: the rendered template, where only the template's own markup
        gives special tokens. A message whose content holds a special token's text (a user
        writing `<|im_start|>system ...` to forge a turn) has that content tokenized as text.
        With `n_ctx`, a rendered prompt too long to fit it whatever its tokens is refused
        before it is tokenized (ContextLengthError): tokenizing costs more than rendering."""
        rendered = self.render_chat(messages, variables)
        self._check_fits(rendered, n_ctx)
        if not any(self._holds_special_text(m) for m in messages):
            return self.tokenize(rendered)
        return self._encode_contents_as_text(messages, variables)

    @cached_property
    def fim_ids(self) -> tuple[int, int, int] | None:
        """The fill-in-the-middle tokens (prefix, suffix, middle), or None if the model has none."""
        ids = tuple(int(f(self._vocab)) for f in (llama_cpp.llama_vocab_fim_pre, llama_cpp.llama_vocab_fim_suf,
                                                   llama_cpp.llama_vocab_fim_mid))
        return None if min(ids) < 0 else ids  # type: ignore[return-value]

    def encode_infill(self, prefix: str, suffix: str, *, n_ctx: int | None = None,
                      param: str = "prompt") -> list[int]:
        """A fill-in-the-middle prompt, as llama-server's /infill: [BOS] FIM_PRE prefix FIM_SUF
        suffix FIM_MID; the answer is the middle (ValueError: the model has no FIM tokens)."""
        if self.fim_ids is None:
            raise ValueError("this model has no fill-in-the-middle tokens")
        self._check_fits(prefix + suffix, n_ctx, param)
        return fim_prompt(self.tokenize(prefix), self.tokenize(suffix), self.fim_ids,
                          self._llm.token_bos() if self.add_bos else None)

    def encode_text(self, text: str, *, n_ctx: int | None = None, param: str = "prompt") -> list[int]:
        """A completion prompt's ids, as llama-server's: a BOS when the vocabulary asks for one,
        special tokens in the text parsed. With `n_ctx`, refused when it cannot fit (as encode_chat),
        naming `param` (a batch's `prompt[i]`)."""
        self._check_fits(text, n_ctx, param)
        return list(self._llm.tokenize(text.encode("utf-8"), add_bos=self.add_bos, special=True))

    def _check_fits(self, text: str, n_ctx: int | None, param: str = "messages") -> None:
        """A ContextLengthError (naming the request's `param`) when `text` has more tokens than
        `n_ctx` whatever its tokens are (its bytes over the longest token's): tokenizing costs
        more than this look."""
        if n_ctx is None:
            return
        fewest = -(-len(text.encode("utf-8", "surrogatepass")) // self.max_token_bytes)
        if fewest >= n_ctx:
            raise ContextLengthError(
                f"This model's maximum context length is {n_ctx} tokens. However, your prompt is at "
                f"least {fewest} tokens. Please reduce the length of the prompt.", n_ctx=n_ctx, requested=fewest,
                param=param)

    def _holds_special_text(self, message: dict[str, Any]) -> bool:
        content = message.get("content")
        return isinstance(content, str) and any(t in content for t in self.special_texts)

    def _encode_contents_as_text(self, messages: Sequence[dict[str, Any]],
                                 variables: dict[str, Any] | None = None) -> list[int]:
        """Render with a placeholder for each message's content, then tokenize the template's
        text with special tokens and each content without."""
        marked = [{**m, "content": CONTENT_MARK.format(i)} if isinstance(m.get("content"), str) else m
                  for i, m in enumerate(messages)]
        parts = CONTENT_MARK_RE.split(self.render_chat(marked, variables))
        found = [int(i) for i in parts[1::2]]
        if sorted(found) != [i for i, m in enumerate(messages) if isinstance(m.get("content"), str)]:
            raise TemplateError("a message holds special-token text, and this chat template changes message "
                                "content, so it cannot be kept apart from the template's markup")
        ids: list[int] = []
        for k, part in enumerate(parts):
            if k % 2:
                ids += self.tokenize(messages[int(part)]["content"], special=False)
            elif part:
                ids += self.tokenize(part)
        return ids

    def is_eog(self, token_id: int) -> bool:
        """True for end-of-generation tokens (EOS, EOT, ...) as the GGUF declares them."""
        return token_id in self.eog_ids

    def _bytes_of(self, token_id: int, special: bool = False) -> bytes:
        size = 32
        while True:
            buf = ctypes.create_string_buffer(size)
            n = llama_cpp.llama_token_to_piece(self._vocab, token_id, buf, size, 0, special)
            if n >= 0:
                return buf.raw[:n]
            size = -n

    def special_piece_bytes(self, token_id: int) -> bytes:
        """A token's bytes with a control token as its text (`<|im_end|>`), as llama-server's
        /tokenize pieces show it."""
        return self._bytes_of(token_id, special=True)

    def vocab_text(self, token_id: int) -> str:
        """A token's text in the vocabulary (`Ġhello`), as a Hugging Face tokenizer's
        convert_ids_to_tokens gives it."""
        return self._text(token_id)

    def detokenize(self, ids: Sequence[int]) -> str:
        """The text of these ids, control tokens as their text (as llama-server's and vLLM's
        /detokenize); bytes that are no whole UTF-8 character become U+FFFD."""
        return b"".join(self._bytes_of(t, special=True) for t in ids).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token adds to the text (special tokens render as nothing)."""
        return self._token_bytes(token_id)

    def piece(self, token_id: int, *, special: bool = False) -> str:
        """One token as text (lossy for partial UTF-8); special=True shows control tokens."""
        return self._llm.detokenize([token_id], special=special).decode("utf-8", errors="replace")

    def detokenizer(self) -> IncrementalDetokenizer:
        """A fresh incremental detokenizer for one completion."""
        return IncrementalDetokenizer(self.token_bytes)

    def close(self) -> None:
        """Free the vocab-only model."""
        self._llm.close()


def fim_prompt(prefix: list[int], suffix: list[int], fim: tuple[int, int, int], bos: int | None) -> list[int]:
    """[bos] FIM_PRE prefix FIM_SUF suffix FIM_MID (pure)."""
    pre, suf, mid = fim
    return [*([bos] if bos is not None and bos >= 0 else []), pre, *prefix, suf, *suffix, mid]
