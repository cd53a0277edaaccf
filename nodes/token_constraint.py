"""Token Constraint: which tokens a session's Output Constraint allows next, on the tail.

One llguidance matcher per constrained session: before each choice the tail asks it for the
mask of allowed tokens (a bitmask over the vocabulary: a few microseconds a token on the bundled
model, bench/constrained.py), and after it hands it the chosen token. The matcher works on the
model's own vocabulary, read by llama.cpp (vocab only) from the model's Vocabulary File, once
per file.
Every end-of-generation token of the model may end the answer once the grammar is complete.
"""

from __future__ import annotations

import warnings
from functools import lru_cache
from pathlib import Path

import llguidance
import numpy as np
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from nodes.engine import ConstraintError
from nodes.llama_ffi import import_llama_cpp
from schemas.output_constraint import OutputConstraint, grammar_of


@lru_cache(maxsize=4)
def vocabulary_of(model_path: str) -> llguidance.LLTokenizer:
    """The matcher's view of a GGUF's vocabulary (about 0.2 s on the bundled model: cached);
    `model_path` is a GGUF with the tokenizer: the model, or its Vocabulary File
    (artifacts/vocab_file.py; shard files have none)."""
    llama_cpp = import_llama_cpp()  # the one way llama.cpp is loaded (its OpenMP settings first)
    from llguidance.llamacpp import lltokenizer_from_vocab  # imports llama_cpp itself

    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(model_path.encode(), params)
    if not model:
        raise ConstraintError(f"cannot read the vocabulary of {model_path}")
    vocab = llama_cpp.llama_model_get_vocab(model)
    eog = [t for t in range(llama_cpp.llama_vocab_n_tokens(vocab)) if llama_cpp.llama_vocab_is_eog(vocab, t)]
    with warnings.catch_warnings():  # it asks each token's attributes by llama.cpp's older name
        warnings.simplefilter("ignore", DeprecationWarning)
        tokenizer = lltokenizer_from_vocab(vocab, eos_token=eog or None)
    # the tokenizer keeps what it needs; the model is kept alive with it (llama.cpp owns the vocab)
    _models.append(model)
    return tokenizer


_models: list[object] = []


class TokenConstraint:
    """One session's matcher and its mask buffer."""

    def __init__(self, constraint: OutputConstraint, model_path: str | Path) -> None:
        tokenizer = vocabulary_of(str(model_path))
        try:
            grammar = grammar_of(constraint)
        except ValueError as exc:
            raise ConstraintError(f"response_format: {exc}") from None
        self._matcher = llguidance.LLMatcher(tokenizer, grammar)
        if self._matcher.is_error():
            raise ConstraintError(f"response_format: {self._matcher.get_error()}")
        self.vocab_size = tokenizer.vocab_size
        self._bits = allocate_token_bitmask(1, self.vocab_size)

    def allowed(self) -> np.ndarray:
        """A bool per vocabulary entry: the tokens the grammar allows next."""
        fill_next_token_bitmask(self._matcher, self._bits, 0)
        if self._matcher.is_error():
            raise ConstraintError(f"the output constraint failed: {self._matcher.get_error()}")
        return np.unpackbits(self._bits[0].view(np.uint8), bitorder="little")[:self.vocab_size].view(bool)

    def consume(self, token: int) -> None:
        """Advance past a chosen (or, on a restart, earlier generated) token."""
        if not self._matcher.consume_token(token):
            raise ConstraintError(f"token {token} is not allowed by the output constraint "
                                  f"({self._matcher.get_error() or 'outside the grammar'})")
