"""Piece Store: a directory of verified pieces of one artifact, and the ModelSource they make.

Layout: `<root>/manifest.json` and `<root>/pieces/<piece_id>`. A piece file appears only by
an atomic rename after its bytes matched its sha256 (`commit`), so a piece file of the right
size is a verified piece. A download cut short leaves `<root>/pieces/.<piece_id>.part`, the
bytes received so far: the next fetch of that piece (from any seeder) continues after them,
and the hash of the whole piece decides in the end.
`verify` re-hashes everything and says which layer ranges the directory can prove it serves.
"""

from __future__ import annotations

import bisect
import hashlib
import os
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

from artifacts.gguf_header import GGUFHeader, parse_header_bytes
from artifacts.manifest import ArtifactManifest, ManifestError, ManifestPiece, pieces_for_range
from artifacts.revision import cache_dir

MANIFEST_FILE = "manifest.json"
PARTIAL_SUFFIX = ".part"


def default_store_dir(artifact_id: str) -> Path:
    """Where a node keeps an artifact's pieces: `<cache>/artifacts/<artifact_id>`."""
    return cache_dir() / "artifacts" / artifact_id


@dataclass(frozen=True, slots=True)
class VerifyReport:
    """What `PieceStore.verify` found."""

    artifact_id: str
    verified: tuple[str, ...]
    missing: tuple[str, ...]
    corrupt: tuple[str, ...]  # present, but the size or the sha256 differs
    ranges: tuple[tuple[int, int], ...]  # maximal layer ranges every piece of which is verified
    verified_bytes: int

    @property
    def complete(self) -> bool:
        return not self.missing and not self.corrupt


def servable_ranges(m: ArtifactManifest, held: set[str]) -> list[tuple[int, int]]:
    """Maximal layer ranges [a, b) whose every piece (pieces_for_range) is in `held` (pure).
    Any sub-range of one is servable too, with one exception each way: a sub-range that starts
    at 0 needs the embedding, one that ends at n_layer the embedding and output head, and the
    returned range already leaves those layers out when those pieces are missing."""
    shared = {pid for role in ("header", "shared") for pid in m.shared_pieces.get(role, [])}
    if not shared <= held:
        return []
    ok = [set(m.layer_to_pieces[i]) <= held for i in range(m.n_layer)]
    ranges: list[tuple[int, int]] = []
    i = 0
    while i < m.n_layer:
        if not ok[i]:
            i += 1
            continue
        j = i
        while j < m.n_layer and ok[j]:
            j += 1
        a, b = i, j
        if a == 0 and not _holds(pieces_for_range(m, 0, 1 if b > 1 else b), held):
            a = 1  # no embedding: layers from 1 on only (a head needs it)
        if b == m.n_layer and a < b and not _holds(pieces_for_range(m, b - 1, b), held):
            b -= 1  # no output pieces: not the tail
        if a < b:
            ranges.append((a, b))
        i = j
    return ranges


def _holds(selection, held: set[str]) -> bool:
    return all(p.piece_id in held for p in selection.pieces)


class PieceStore:
    """The verified pieces of one artifact in one directory."""

    def __init__(self, root: Path, manifest: ArtifactManifest) -> None:
        self.root = root
        self.manifest = manifest
        self.pieces_dir = root / "pieces"

    @classmethod
    def open(cls, root: str | Path) -> PieceStore:
        """An existing store (its manifest.json validated)."""
        r = Path(root)
        if not (r / MANIFEST_FILE).is_file():
            raise ManifestError(f"{r} holds no {MANIFEST_FILE} (not a piece store)", path=str(r))
        return cls(r, ArtifactManifest.load(r / MANIFEST_FILE))

    @classmethod
    def create(cls, root: str | Path, manifest: ArtifactManifest) -> PieceStore:
        """Open or make the store for `manifest` at root; refuse a root that holds another artifact."""
        r = Path(root)
        r.mkdir(parents=True, exist_ok=True)
        path = r / MANIFEST_FILE
        if path.is_file():
            have = ArtifactManifest.load(path)
            if have.artifact_id != manifest.artifact_id:
                raise ManifestError(f"{r} holds artifact {have.artifact_id}, not {manifest.artifact_id}", path=str(r))
            if [p.piece_id for p in have.pieces] != [p.piece_id for p in manifest.pieces]:
                raise ManifestError(f"{r} holds artifact {manifest.artifact_id} cut into other pieces "
                                    f"({have.piece_bytes} bytes, not {manifest.piece_bytes})", path=str(r))
        else:
            _atomic_write(path, manifest.model_dump_json(indent=1).encode())
        store = cls(r, manifest)
        store.pieces_dir.mkdir(exist_ok=True)
        resumable = {store.partial_path(p.piece_id).name for p in manifest.pieces}
        for stale in store.pieces_dir.glob(f".*{PARTIAL_SUFFIX}"):
            if stale.name not in resumable:  # not a piece of this manifest (an older layout)
                stale.unlink(missing_ok=True)
        return store

    def path(self, piece_id: str) -> Path:
        return self.pieces_dir / piece_id

    def has(self, piece: ManifestPiece) -> bool:
        """Present with its size (files appear only after verification, see `commit`)."""
        try:
            return self.path(piece.piece_id).stat().st_size == piece.size
        except FileNotFoundError:
            return False

    def held(self) -> set[str]:
        """Ids of the pieces present."""
        return {p.piece_id for p in self.manifest.pieces if self.has(p)}

    def held_bytes(self) -> int:
        seen: set[str] = set()
        total = 0
        for p in self.manifest.pieces:
            if p.piece_id not in seen and self.has(p):
                seen.add(p.piece_id)
                total += p.size
        return total

    def partial_path(self, piece_id: str) -> Path:
        return self.pieces_dir / f".{piece_id}{PARTIAL_SUFFIX}"

    def open_partial(self, piece: ManifestPiece) -> tuple[int, str, int]:
        """The partial file of a piece being downloaded: (fd, path, bytes it holds already).
        Bytes beyond the piece's size cannot be its own: such a file starts again empty."""
        self.pieces_dir.mkdir(parents=True, exist_ok=True)
        path = self.partial_path(piece.piece_id)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        have = os.fstat(fd).st_size
        if have > piece.size:
            os.ftruncate(fd, 0)
            have = 0
        return fd, str(path), have

    def partial_bytes(self, piece: ManifestPiece) -> int:
        """Bytes a cut download of `piece` left (0: none, or more than the piece can hold)."""
        try:
            have = self.partial_path(piece.piece_id).stat().st_size
        except FileNotFoundError:
            return 0
        return have if have <= piece.size else 0

    def drop_partial(self, piece: ManifestPiece) -> None:
        self.partial_path(piece.piece_id).unlink(missing_ok=True)

    def commit(self, partial: str, piece: ManifestPiece, sha256_hex: str, size: int) -> None:
        """Make a downloaded piece part of the store if its size and hash match (else a typed
        error naming it, and the partial file is removed)."""
        if size != piece.size or sha256_hex != piece.piece_id:
            os.unlink(partial)
            what = f"{size} bytes" if size != piece.size else f"sha256 {sha256_hex[:16]}…"
            where = piece.role if piece.layer is None else f"layer {piece.layer}"
            raise ManifestError(f"piece {piece.piece_id[:16]}… ({where}) does not verify: "
                                f"got {what}, expected {piece.size} bytes with its sha256",
                                piece_id=piece.piece_id)
        os.chmod(partial, 0o644)
        os.replace(partial, self.path(piece.piece_id))

    def add_bytes(self, piece: ManifestPiece, data: bytes) -> None:
        """Store a piece held in memory (verified first)."""
        fd, tmp, _ = self.open_partial(piece)
        with os.fdopen(fd, "wb") as f:
            f.truncate(0)
            f.write(data)
        self.commit(tmp, piece, hashlib.sha256(data).hexdigest(), len(data))

    def verify(self, progress: Callable[[int, int], None] | None = None) -> VerifyReport:
        """Hash every piece present against the manifest."""
        m = self.manifest
        unique = list({p.piece_id: p for p in m.pieces}.values())
        total = sum(p.size for p in unique)
        done = 0
        ok, missing, corrupt = [], [], []
        for p in unique:
            path = self.path(p.piece_id)
            if not path.exists():
                missing.append(p.piece_id)
            elif path.stat().st_size != p.size or _sha256_file(path) != p.piece_id:
                corrupt.append(p.piece_id)
            else:
                ok.append(p.piece_id)
            done += p.size
            if progress is not None:
                progress(done, total)
        held = set(ok)
        return VerifyReport(m.artifact_id, tuple(ok), tuple(missing), tuple(corrupt),
                            tuple(servable_ranges(m, held)),
                            sum(p.size for p in unique if p.piece_id in held))

    def source(self) -> PieceSource:
        return PieceSource(self)


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(4 << 20):
            h.update(chunk)
    return h.hexdigest()


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


class PieceSource:
    """A PieceStore read as a ModelSource: the header from its header piece, tensor bytes from
    the pieces that hold them (a missing piece is a ManifestError naming it)."""

    def __init__(self, store: PieceStore) -> None:
        self.store = store
        self.manifest = store.manifest
        self._offsets = [p.offset for p in self.manifest.pieces]

    @cached_property
    def _header(self) -> GGUFHeader:
        hp = self.manifest.header_piece()
        header = parse_header_bytes(self._read(hp, 0, hp.size), path=self.store.root, keep_strings=True)
        self.manifest.check_header(header)
        return header

    @property
    def header(self) -> GGUFHeader:
        return self._header

    def full_header(self) -> GGUFHeader:
        return self._header

    @property
    def name(self) -> str:
        return self.manifest.model

    @property
    def revision(self) -> str:
        return self.manifest.model_revision

    @property
    def location(self) -> Path:
        return self.store.root

    def whole_file(self) -> Path | None:
        """The original file, concatenated from the pieces once (all of them held), or None."""
        m = self.manifest
        target = self.store.root / m.file_name
        if target.is_file() and target.stat().st_size == m.file_size:
            return target
        if any(not self.store.has(p) for p in m.pieces):
            return None
        fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=self.store.root)
        try:
            with os.fdopen(fd, "wb") as out:
                for p in m.pieces:
                    out.write(self._read(p, 0, p.size))
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return target

    def tensor_bytes(self, name: str) -> np.ndarray:
        t = self._header.tensors[name]
        parts = list(self._spans(t.offset, t.nbytes))
        if len(parts) == 1:
            p, lo, n = parts[0]
            self._need(p)
            flat = np.memmap(self.store.path(p.piece_id), dtype=np.uint8, mode="r", offset=lo, shape=(n,))
        else:
            flat = np.frombuffer(b"".join(self._read(p, lo, n) for p, lo, n in parts), dtype=np.uint8)
        return flat.reshape(t.byte_shape)

    def _spans(self, offset: int, nbytes: int) -> Iterable[tuple[ManifestPiece, int, int]]:
        """(piece, offset in it, length) covering file bytes [offset, offset + nbytes)."""
        pieces = self.manifest.pieces
        i = bisect.bisect_right(self._offsets, offset) - 1
        while nbytes > 0:
            p = pieces[i]
            lo = offset - p.offset
            n = min(nbytes, p.size - lo)
            yield p, lo, n
            offset += n
            nbytes -= n
            i += 1

    def _need(self, p: ManifestPiece) -> None:
        if not self.store.has(p):
            where = f"layer {p.layer}" if p.layer is not None else p.role
            raise ManifestError(f"piece {p.piece_id[:16]}… ({where}) is not in {self.store.root}",
                                piece_id=p.piece_id)

    def _read(self, p: ManifestPiece, lo: int, n: int) -> bytes:
        self._need(p)
        with open(self.store.path(p.piece_id), "rb") as f:
            f.seek(lo)
            return f.read(n)

    def __repr__(self) -> str:
        return f"PieceSource({str(self.store.root)!r})"
