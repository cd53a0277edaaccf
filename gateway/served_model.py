"""The model this gateway serves: its tokenizer, revision and the names clients may use."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from artifacts.bundled import BUNDLED_NAME, bundled_model_path, model_id, resolve_model
from artifacts.gguf_header import read_header
from artifacts.revision import model_revision
from gateway.mesh_view import MeshView, RoutableModel
from gateway.tokenizer import ModelTokenizer

BUNDLED_ALIASES = (BUNDLED_NAME, "smollm2", "bundled")


class ModelLoadError(RuntimeError):
    """The gateway cannot serve this model: no such file, no GGUF, or a vocabulary llama.cpp refuses."""


def _open(model: str | None) -> tuple[Path, ModelTokenizer]:
    """The GGUF `model` names and its tokenizer, or a ModelLoadError saying which of the three failed."""
    try:
        path = resolve_model(model)
        read_header(path)  # "not a GGUF file" says more than llama.cpp's "failed to load"
    except (OSError, ValueError) as exc:
        raise ModelLoadError(str(exc)) from exc
    try:
        return path, ModelTokenizer(path)
    except ValueError as exc:  # llama_cpp: "Failed to load model from file"
        raise ModelLoadError(f"llama.cpp could not load the vocabulary of {path} (is there a tokenizer in its "
                             "metadata, tokenizer.ggml.*?)") from exc


@dataclass(slots=True)
class ServedModel:
    """A tokenizer plus identity; `routable` asks the mesh view whether a full route exists."""

    path: Path
    revision: str
    tokenizer: ModelTokenizer
    aliases: frozenset[str]

    @classmethod
    def load(cls, model: str | None) -> ServedModel:
        """Resolve a GGUF path or bundled name, load its vocabulary and hash it."""
        path, tokenizer = _open(model)
        names = {tokenizer.name, path.stem, path.name, model_id(path), model_revision(path)}  # model_id: what nodes announce
        if model:
            names.add(model)
        try:
            if path == bundled_model_path():
                names.update(BUNDLED_ALIASES)
        except FileNotFoundError:
            pass
        return cls(path, model_revision(path), tokenizer, frozenset(n.lower() for n in names))

    def public_name(self, routable: RoutableModel | None) -> str:
        """The id clients see: the name nodes announce, else the bundled name or file stem."""
        if routable is not None:
            return routable.name
        return BUNDLED_NAME if BUNDLED_NAME in self.aliases else self.path.stem

    def matches(self, name: str, mesh: MeshView) -> bool:
        """Whether a request's `model` names this model (any alias or announced name)."""
        wanted = name.lower()
        if wanted in self.aliases:
            return True
        routable = mesh.find(self.revision)
        return routable is not None and routable.name.lower() == wanted

    def close(self) -> None:
        """Free the tokenizer."""
        self.tokenizer.close()
