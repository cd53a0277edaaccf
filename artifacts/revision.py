"""Model revision: a content hash of a GGUF file, cached next to the shard cache."""

from __future__ import annotations

import contextlib
import hashlib
import os
from functools import lru_cache
from pathlib import Path


def cache_dir() -> Path:
    """Directory for derived artifacts (shard files, hashes). MESHNET_CACHE overrides."""
    root = os.environ.get("MESHNET_CACHE") or Path.home() / ".cache" / "meshnet"
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


@lru_cache(maxsize=64)
def _hash_file(path: str, size: int, mtime_ns: int) -> str:
    stamp = cache_dir() / "revisions" / f"{hashlib.sha1(path.encode()).hexdigest()}-{size}-{mtime_ns}"
    if stamp.exists():
        return stamp.read_text().strip()
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    digest = h.hexdigest()[:16]
    try:
        stamp.parent.mkdir(parents=True, exist_ok=True)
        stamp.write_text(digest)
    except OSError:  # a full or read-only cache: no stamp (a cut one would lie), the next start hashes again
        with contextlib.suppress(OSError):
            stamp.unlink(missing_ok=True)
    return digest


def model_revision(path: str | Path) -> str:
    """16-hex-digit sha256 prefix of the file's bytes (memoized by path, size, mtime)."""
    p = Path(path).resolve()
    st = p.stat()
    return _hash_file(str(p), st.st_size, st.st_mtime_ns)
