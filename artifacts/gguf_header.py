"""A fast GGUF header reader: key/values and tensor infos, tensor bytes as memmap slices.

gguf.GGUFReader builds a numpy view per array element, which takes ~8 s on a 49k-token
vocabulary; this reader walks the same layout with struct and skips string arrays
(tokenizer tables) unless asked, so opening a model's header takes milliseconds.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUFValueType ids → struct format (scalars); 8 = string, 9 = array
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9
SMALL_STRING_ARRAY = 1024  # longer string arrays (vocabularies, merges) are skipped unless asked


class GGUFFormatError(ValueError):
    """The file is not a GGUF this reader understands."""

    def __init__(self, message: str, *, path: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path


@dataclass(frozen=True, slots=True)
class SkippedArray:
    """A string array left unread (its element count is known)."""

    count: int


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor: ggml dims (ne0 first), ggml type id, byte offset in the file and size."""

    name: str
    dims: tuple[int, ...]
    ggml_type: int
    offset: int  # absolute, from the start of the file
    nbytes: int

    @property
    def byte_shape(self) -> tuple[int, ...]:
        """numpy shape of the raw bytes: rows first, bytes per row last."""
        rows = tuple(reversed(self.dims[1:]))
        return (*rows, self.nbytes // max(1, int(np.prod(rows, dtype=np.int64))))


@dataclass(frozen=True, slots=True)
class GGUFHeader:
    """Everything before the tensor data of a GGUF file."""

    path: Path
    version: int
    fields: dict[str, tuple[int, int | None, Any]]  # key → (value type, array item type, value)
    tensors: dict[str, TensorInfo]
    alignment: int

    def past_end(self, size: int) -> list[str]:
        """The tensors whose bytes reach past a file of `size` bytes (a cut download or copy)."""
        return [f"{t.name}: bytes {t.offset}..{t.offset + t.nbytes} past the end of the file ({size})"
                for t in self.tensors.values() if t.offset + t.nbytes > size]

    def get(self, key: str, default: Any = None) -> Any:
        """The value of `key` (SkippedArray for unread string arrays), or default."""
        entry = self.fields.get(key)
        return default if entry is None else entry[2]

    def tensor_bytes(self, name: str) -> np.ndarray:
        """The raw bytes of a tensor as a read-only memmap in its byte shape."""
        t = self.tensors[name]
        mm = np.memmap(self.path, dtype=np.uint8, mode="r", offset=t.offset, shape=(t.nbytes,))
        return mm.reshape(t.byte_shape)


class _Cursor:
    def __init__(self, buf: bytes) -> None:
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize("<" + fmt)
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.unpack("Q")
        s = self.buf[self.pos : self.pos + n].decode("utf-8", errors="replace")
        self.pos += n
        return s

    def skip_strings(self, count: int) -> None:
        for _ in range(count):
            (n,) = struct.unpack_from("<Q", self.buf, self.pos)
            self.pos += 8 + n

    def value(self, vtype: int, keep_strings: bool) -> tuple[int | None, Any]:
        if vtype in _SCALARS:
            return None, self.unpack(_SCALARS[vtype])
        if vtype == STRING:
            return None, self.string()
        if vtype != ARRAY:
            raise ValueError(f"unknown GGUF value type {vtype}")
        item, count = self.unpack("I"), self.unpack("Q")
        if item == STRING:
            if keep_strings or count <= SMALL_STRING_ARRAY:
                return item, [self.string() for _ in range(count)]
            self.skip_strings(count)
            return item, SkippedArray(count)
        if item not in _SCALARS:
            raise ValueError(f"unsupported GGUF array item type {item}")
        fmt = f"<{count}{_SCALARS[item]}"
        values = list(struct.unpack_from(fmt, self.buf, self.pos))
        self.pos += struct.calcsize(fmt)
        return item, values


def _tensor_nbytes(dims: tuple[int, ...], ggml_type: int) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    return int(np.prod(dims, dtype=np.int64)) // block * type_size


def _read_prefix(path: Path) -> bytes:
    """The file's head, grown until the header (with its string tables) fits."""
    size = 1 << 24
    with open(path, "rb") as f:
        while True:
            f.seek(0)
            buf = f.read(size)
            if len(buf) < size:
                return buf
            try:
                _parse(path, buf, keep_strings=False)
                return buf
            except struct.error:
                size *= 4


def _parse(path: Path, buf: bytes, keep_strings: bool) -> GGUFHeader:
    c = _Cursor(buf)
    if buf[:4] != GGUF_MAGIC:
        raise GGUFFormatError("not a GGUF file", path=str(path))
    c.pos = 4
    version, n_tensors, n_kv = c.unpack("I"), c.unpack("Q"), c.unpack("Q")
    fields: dict[str, tuple[int, int | None, Any]] = {}
    for _ in range(n_kv):
        key, vtype = c.string(), c.unpack("I")
        item, value = c.value(vtype, keep_strings)
        fields[key] = (vtype, item, value)
    infos = []
    for _ in range(n_tensors):
        name, n_dims = c.string(), c.unpack("I")
        dims = tuple(c.unpack("Q") for _ in range(n_dims))
        infos.append((name, dims, c.unpack("I"), c.unpack("Q")))
    alignment = int(fields.get("general.alignment", (0, None, DEFAULT_ALIGNMENT))[2])
    data_start = (c.pos + alignment - 1) // alignment * alignment
    tensors = {
        name: TensorInfo(name, dims, gtype, data_start + off, _tensor_nbytes(dims, gtype))
        for name, dims, gtype, off in infos
    }
    return GGUFHeader(path, version, fields, tensors, alignment)


def parse_header_bytes(buf: bytes, *, path: str | Path, keep_strings: bool = True) -> GGUFHeader:
    """Parse a header from its bytes (a manifest's header piece); tensor offsets stay those
    of the original file. `path` names the origin in errors."""
    try:
        return _parse(Path(path), buf, keep_strings)
    except (struct.error, ValueError, UnicodeDecodeError) as exc:
        if isinstance(exc, GGUFFormatError):
            raise
        raise GGUFFormatError(f"unreadable GGUF header: {exc}", path=str(path)) from exc


@lru_cache(maxsize=16)
def _cached(path: str, size: int, mtime_ns: int, keep_strings: bool) -> GGUFHeader:
    p = Path(path)
    try:
        return _parse(p, _read_prefix(p), keep_strings)
    except (struct.error, ValueError, UnicodeDecodeError) as exc:
        if isinstance(exc, GGUFFormatError):
            raise
        raise GGUFFormatError(f"unreadable GGUF header: {exc}", path=path) from exc


def read_header(path: str | Path, *, keep_strings: bool = False) -> GGUFHeader:
    """Parse a GGUF header (memoized by path, size and mtime)."""
    p = Path(path).resolve()
    st = p.stat()
    return _cached(str(p), st.st_size, st.st_mtime_ns, keep_strings)
