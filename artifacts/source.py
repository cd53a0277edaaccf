"""Model Source: where a shard's bytes come from, a whole GGUF file or a directory of verified pieces.

The shard writer, the head's embedding lookup and the engine read a model only through this
interface: its GGUF header (fields and tensor infos at their offsets in the original file), a
tensor's raw bytes, and its identity (name, revision). A node that fetched only its pieces
from the Shard Swarm (artifacts/swarm.py) therefore runs exactly the code a node with the
whole file runs, on the same bytes.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from artifacts.bundled import model_id
from artifacts.gguf_header import GGUFFormatError, GGUFHeader, read_header
from artifacts.revision import model_revision


@runtime_checkable
class ModelSource(Protocol):
    """A GGUF model, whole or in part, as the shard writer reads it."""

    @property
    def header(self) -> GGUFHeader:
        """The original file's header; long string arrays (tokenizer tables) may be skipped."""
        ...

    def full_header(self) -> GGUFHeader:
        """The header with every string array read (what a shard file copies)."""
        ...

    @property
    def name(self) -> str:
        """The model id nodes announce and clients ask for."""
        ...

    @property
    def revision(self) -> str:
        """16 hex digits of the original file's sha256 (artifacts.revision.model_revision)."""
        ...

    @property
    def location(self) -> Path:
        """The file, or the piece store's directory (for messages)."""
        ...

    def whole_file(self) -> Path | None:
        """The original GGUF on this machine (a piece store writes it out from its pieces,
        byte for byte, when it holds them all), else None."""
        ...

    def tensor_bytes(self, name: str) -> np.ndarray:
        """A tensor's raw bytes in its byte shape (rows first, bytes per row last)."""
        ...


class GGUFFile:
    """A whole GGUF file on local disk."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    @property
    def header(self) -> GGUFHeader:
        return read_header(self.path)  # memoized by path, size and mtime

    def check_complete(self) -> None:
        """A GGUFFormatError unless every tensor's bytes are in the file."""
        cut = self.header.past_end(self.path.stat().st_size)
        if cut:
            raise GGUFFormatError(f"truncated (a cut download or copy?): {cut[-1]}"
                                  + (f", and {len(cut) - 1} more tensor(s)" if len(cut) > 1 else ""),
                                  path=str(self.path))

    def full_header(self) -> GGUFHeader:
        return read_header(self.path, keep_strings=True)

    @property
    def name(self) -> str:
        return model_id(self.path)

    @cached_property
    def revision(self) -> str:
        return model_revision(self.path)

    @property
    def location(self) -> Path:
        return self.path

    def whole_file(self) -> Path:
        return self.path

    def tensor_bytes(self, name: str) -> np.ndarray:
        return self.header.tensor_bytes(name)

    def __repr__(self) -> str:
        return f"GGUFFile({str(self.path)!r})"


def open_source(model: str | Path | ModelSource) -> ModelSource:
    """A ModelSource for a GGUF path, a piece store directory (artifacts.piece_store), or a source."""
    if isinstance(model, ModelSource):
        return model
    p = Path(model)
    if p.is_dir():
        from artifacts.piece_store import PieceStore

        return PieceStore.open(p).source()
    return GGUFFile(p)
