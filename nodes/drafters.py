"""Where a route's head gets its drafted tokens (speculative decoding, nodes/speculation.py).

A Drafter proposes up to k tokens to follow a session's history; the tail then keeps those the
target model agrees with. Two kinds:
- PromptLookup (the default): what followed the latest earlier occurrence of the last few
  tokens (`lookup_draft`). No model; good where the answer repeats its context.
- ModelDrafter (`meshnet node --draft-model PATH.gguf`): a small model of the same vocabulary,
  run whole on the head with llama.cpp, greedy. It keeps each session's tokens in its own KV
  and, per step, drops what the target did not keep, feeds what is new (at most CATCH_UP_ROWS
  rows a step: a long prompt is read over several steps, which draft nothing) and decodes k
  tokens.

Any other drafter (an MTP head, say) plugs in behind the same two methods.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from nodes.engine import BatchPart, CacheFullError, EngineError, ShardEngine, single_result
from nodes.speculation import lookup_draft
from schemas.sampling import SamplingParams


class Drafter(Protocol):
    def propose(self, session_id: str, history: Sequence[int], k: int) -> list[int]:
        """Up to `k` tokens to follow `history` (every token of the session so far, the last
        one not yet run by the target)."""
        ...

    def forget(self, session_id: str) -> None:
        """The session ended: free what the drafter holds for it."""
        ...


class PromptLookup:
    """Drafts from the session's own tokens (lookup_draft)."""

    def propose(self, session_id: str, history: Sequence[int], k: int) -> list[int]:
        return lookup_draft(history, k)

    def forget(self, session_id: str) -> None:
        pass


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share (pure)."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n], dtype=np.int64) != np.asarray(b[:n], dtype=np.int64))
    return int(diff[0]) if len(diff) else n


# The most history rows one propose feeds the draft model: it runs on the head's event loop, so
# a long prompt read whole held the loop for seconds (on 2 cores, a 1000-token prompt through a
# 30-layer self-draft: over 10 s, and the node was expired for missing heartbeats). A longer
# history is read a slice per step, drafting nothing until the draft model has caught up.
CATCH_UP_ROWS = 32


class ModelDrafter:
    """A draft model on the head: one greedy session in its engine per Route Session."""

    def __init__(self, engine: ShardEngine) -> None:
        self.engine = engine
        self._fed: dict[str, list[int]] = {}  # per session: the tokens its draft KV holds, in order

    def propose(self, session_id: str, history: Sequence[int], k: int) -> list[int]:
        if k <= 0 or not history:
            return []
        fed = self._fed.get(session_id)
        if fed is None:
            try:
                self.engine.open_session(session_id, SamplingParams(temperature=0.0))
            except CacheFullError:  # every draft slot taken (the whole draft model's KV budget holds
                return []  # fewer sessions than the head's): no drafts until one frees, not a failed run
            fed = self._fed[session_id] = []
        keep = min(common_prefix(fed, history), len(history) - 1)  # at least one row to run
        end = min(len(history), keep + CATCH_UP_ROWS)
        new = np.asarray(history[keep:end], dtype=np.int32)
        out = single_result(self.engine.forward_batch([BatchPart(session_id, keep, new, rewind=True)]))
        fed[keep:] = history[keep:end]
        if end < len(history):  # still reading the prompt (or a restart's history): no drafts yet
            return []
        drafts: list[int] = []
        while True:
            if out.token is None:
                raise EngineError("the draft model chose no token")
            drafts.append(out.token.token_id)
            if len(drafts) == k:
                return drafts
            out = self.engine.forward(session_id, len(fed), token_ids=np.asarray(drafts[-1:], dtype=np.int32))
            fed.append(drafts[-1])

    def forget(self, session_id: str) -> None:
        if self._fed.pop(session_id, None) is not None:
            self.engine.close_session(session_id)


def weightless(n_tensors: int, n_layer: int) -> str:
    """Why a GGUF cannot run as a draft model for want of weights ("" when it has some) (pure).
    A vocabulary-only GGUF (llama.cpp's ggml-vocab-*.gguf, a Vocabulary File) passes the
    vocabulary check, then failed to load with 'llama.cpp could not load ...', or with 'layer
    range [0, 0) is not inside [0, 0)' where it says it has no layers."""
    if n_tensors == 0:
        return ("it holds no tensors: a vocabulary-only GGUF (such as llama.cpp's ggml-vocab-*.gguf) has the "
                "tokenizer but no weights to draft with")
    if n_layer <= 0:
        return "it has no layers (block_count 0): there is no model to draft with"
    return ""


def vocabulary_mismatch(target: Path, draft: Path) -> str:
    """Why `draft` cannot draft for `target` ("" when every token id means the same text);
    EngineError when llama.cpp cannot read `draft` at all."""
    from llama_cpp import Llama

    a = Llama(model_path=str(target), vocab_only=True, verbose=False)
    try:
        b = Llama(model_path=str(draft), vocab_only=True, verbose=False)
    except ValueError as exc:  # not a GGUF, or one whose vocabulary llama.cpp cannot read
        a.close()
        raise EngineError(f"llama.cpp cannot read {draft} as a model ({exc})") from exc
    try:
        if a.n_vocab() != b.n_vocab():
            return f"the draft model has {b.n_vocab()} tokens, the target {a.n_vocab()}"
        for t in range(a.n_vocab()):
            if a._model.token_get_text(t) != b._model.token_get_text(t):
                return (f"token {t} is {a._model.token_get_text(t)!r} in the target and "
                        f"{b._model.token_get_text(t)!r} in the draft model")
        return ""
    finally:
        a.close()
        b.close()
