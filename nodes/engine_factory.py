"""Pick and load a ShardEngine backend by name ("llama.cpp" or "torch")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nodes.engine import ShardEngine, UnsupportedModelError

BACKENDS = ("llama.cpp", "torch")
_ALIASES = {"llama.cpp": "llama.cpp", "llama": "llama.cpp", "llamacpp": "llama.cpp", "torch": "torch", "pytorch": "torch"}


def load_engine(backend: str, model_path: str | Path, start: int, end: int, **opts: Any) -> ShardEngine:
    """Load layers [start, end) of the GGUF at model_path on the named backend.

    opts go to the backend: n_ctx (tokens per session), max_sessions, n_threads; llama.cpp
    also takes n_threads_batch, n_batch, flash_attn, capture ("auto", "layer_inp",
    "cb_eval") and measure (a quick self-measurement at load). The torch backend ignores
    options it does not have.
    """
    name = _ALIASES.get(backend.lower())
    if name == "llama.cpp":
        from nodes.llama_engine import LlamaShardEngine

        return LlamaShardEngine(model_path, start, end, **opts)
    if name == "torch":
        from nodes.torch_engine import TorchShardEngine

        return TorchShardEngine(model_path, start, end, **opts)
    raise UnsupportedModelError(f"unknown backend {backend!r}; choose one of {BACKENDS}", backend=backend)
