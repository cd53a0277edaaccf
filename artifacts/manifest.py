"""Artifact Manifest: a GGUF file mapped to content-addressed pieces, tensors and layers.

A manifest lets a node fetch only what its layer range needs and prove what it holds:
- the file is tiled by pieces, each with its sha256 (its id), byte range and size;
- pieces are cut on tensor boundaries and never mix groups, so a layer's tensors are whole
  pieces of their own (a tensor larger than the piece size is cut into several pieces, still
  of that layer only); the padding after a tensor belongs to its piece;
- the header piece holds every metadata field, the tokenizer among them: what a shard file
  copies. Shared pieces: header, embedding (`token_embd`), output head, other shared tensors
  (output norm, RoPE factors);
- `layer_to_pieces` and `shared_pieces` name piece ids; `pieces_for_range` selects exactly
  the pieces the shard writer reads for a range (artifacts.shard_file.tensor_needed).

`artifact_id` is content-derived: the first 32 hex digits of the file's sha256, whose first
16 are the model revision nodes already announce, so a node built from pieces and a node
with the whole file are one route group.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from artifacts.gguf_header import GGUFHeader, read_header
from artifacts.shard_file import EMBEDDING, TAIL_ONLY, read_model_info, tensor_layer, tensor_needed

MANIFEST_VERSION = 1
DEFAULT_PIECE_BYTES = 8 << 20
PieceRole = Literal["header", "layer", "embedding", "output", "shared"]
_HEX64 = r"^[0-9a-f]{64}$"
# bounds on what a manifest may claim, checked before anything is allocated from it (a manifest
# comes from the bus or a file, so from anyone); its GGUF header is checked later (check_header)
MAX_LAYERS = 4096
MAX_EMBD = 1 << 20
MAX_EXPERTS = 1 << 16
MAX_CONTEXT = 1 << 27


class ManifestError(ValueError):
    """A manifest that does not validate, a piece that does not match it, a range outside the model."""

    def __init__(self, message: str, *, piece_id: str | None = None, path: str | None = None) -> None:
        super().__init__(message)
        self.piece_id = piece_id
        self.path = path


class ManifestPiece(BaseModel):
    """One content-addressed piece: bytes [offset, offset + size) of the file."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    index: int = Field(ge=0)
    piece_id: str = Field(pattern=_HEX64)  # sha256 of the piece's bytes
    offset: int = Field(ge=0)
    size: int = Field(gt=0)
    role: PieceRole
    layer: int | None = None  # for role "layer"
    tensors: list[str] = Field(default_factory=list)  # tensors with bytes in this piece


class CacheDescriptor(BaseModel):
    """What a session's Hot KV State costs on the llama.cpp backend (the Capability Report's ABI)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    cache_abi: str
    kv_dtype: str = "f16"
    kv_bytes_per_token_per_layer: int = Field(ge=0)


class ArtifactManifest(BaseModel):
    """A GGUF artifact: identity, provenance, pieces, and the maps from tensors and layers to pieces."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    manifest_version: Literal[1] = MANIFEST_VERSION
    artifact_id: str = Field(pattern=r"^[0-9a-f]{32}$")
    model: str  # the id nodes announce and clients ask for
    model_name: str  # general.name
    preset: str | None = None  # general.basename + size label, when the file says
    architecture: str
    n_layer: int = Field(gt=0, le=MAX_LAYERS)
    n_embd: int = Field(ge=0, le=MAX_EMBD)
    expert_count: int = Field(default=0, ge=0, le=MAX_EXPERTS)
    upstream_repo: str | None = None
    upstream_revision: str | None = None
    license: str | None = None
    quantization: str
    context_length: int = Field(ge=0, le=MAX_CONTEXT)
    file_name: str
    file_size: int = Field(gt=0)
    file_sha256: str = Field(pattern=_HEX64)
    piece_bytes: int = Field(gt=0)
    pieces: list[ManifestPiece]
    tensor_to_layer_map: dict[str, int | None]
    layer_to_pieces: dict[int, list[str]]
    shared_pieces: dict[str, list[str]]  # role -> piece ids (header, embedding, output, shared)
    cache: CacheDescriptor

    @property
    def model_revision(self) -> str:
        return self.file_sha256[:16]

    @model_validator(mode="after")
    def _check(self) -> ArtifactManifest:
        if self.artifact_id != self.file_sha256[:32]:
            raise ValueError("artifact_id is not the file sha256's first 32 hex digits")
        pos = 0
        for i, p in enumerate(self.pieces):
            if p.index != i:
                raise ValueError(f"piece {p.piece_id} has index {p.index}, expected {i}")
            if p.offset != pos:
                raise ValueError(f"piece {p.piece_id} starts at {p.offset}, expected {pos} (pieces must tile the file)")
            if (p.role == "layer") != (p.layer is not None) or (p.layer is not None and not 0 <= p.layer < self.n_layer):
                raise ValueError(f"piece {p.piece_id}: role {p.role} with layer {p.layer}")
            pos += p.size
        if pos != self.file_size:
            raise ValueError(f"pieces cover {pos} bytes, the file has {self.file_size}")
        if "/" in self.file_name or "\\" in self.file_name or self.file_name in ("", ".", "..", "manifest.json",
                                                                              "pieces"):
            raise ValueError(f"file_name {self.file_name!r} must be a plain file name")
        if not self.pieces or self.pieces[0].role != "header":
            raise ValueError("the first piece must be the header")
        if len(self.layer_to_pieces) != self.n_layer or sorted(self.layer_to_pieces) != list(range(self.n_layer)):
            raise ValueError(f"layer_to_pieces must name every layer 0..{self.n_layer - 1}")
        ids = {p.piece_id for p in self.pieces}
        for layer, pids in self.layer_to_pieces.items():
            if not pids or not set(pids) <= ids:
                raise ValueError(f"layer {layer} lists unknown or no pieces")
        return self

    # -- lookups -----------------------------------------------------------------------------

    def piece(self, piece_id: str) -> ManifestPiece:
        """The first piece with this id (identical bytes share one id)."""
        for p in self.pieces:
            if p.piece_id == piece_id:
                return p
        raise ManifestError(f"piece {piece_id} is not in artifact {self.artifact_id}", piece_id=piece_id)

    def header_piece(self) -> ManifestPiece:
        return self.pieces[0]

    def check_header(self, header: GGUFHeader) -> None:
        """A ManifestError unless the GGUF header (from the verified header piece) agrees with
        what the manifest claims: architecture, layer count, and every tensor inside the file."""
        arch = str(header.get("general.architecture", ""))
        n_layer = int(header.get(f"{arch}.block_count", 0) or 0)
        if (arch, n_layer) != (self.architecture, self.n_layer):
            raise ManifestError(f"manifest of {self.model} says {self.architecture} with {self.n_layer} layers, "
                                f"its GGUF header {arch} with {n_layer}")
        cut = header.past_end(self.file_size)
        if cut:
            raise ManifestError(f"manifest of {self.model}: {cut[0]}")

    def check_range(self, start: int, end: int) -> None:
        """A typed error unless [start, end) is a non-empty range of this model's layers."""
        if not 0 <= start < end <= self.n_layer:
            raise ManifestError(f"layer range [{start}, {end}) is not inside [0, {self.n_layer}) of {self.model}")

    @classmethod
    def load(cls, path: str | Path) -> ArtifactManifest:
        """Read and validate a manifest file; a typed ManifestError says what is wrong."""
        p = Path(path)
        try:
            return cls.model_validate_json(p.read_bytes())
        except FileNotFoundError:
            raise ManifestError(f"{p}: no such manifest", path=str(p)) from None
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(x) for x in first["loc"]) or "manifest"
            raise ManifestError(f"{p}: invalid manifest: {where}: {first['msg']}", path=str(p)) from None

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.model_dump_json(indent=1))


@dataclass(frozen=True, slots=True)
class PieceSelection:
    """The pieces a node serving [start, end) must fetch and verify (each id once)."""

    start: int
    end: int
    pieces: tuple[ManifestPiece, ...]

    @property
    def nbytes(self) -> int:
        return sum(p.size for p in self.pieces)

    def by_role(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for p in self.pieces:
            out[p.role] = out.get(p.role, 0) + p.size
        return out


def pieces_for_range(m: ArtifactManifest, start: int, end: int) -> PieceSelection:
    """Exactly the pieces the shard writer reads for [start, end): the header, the range's
    layers, the shared tensors, the embedding on a head, the embedding and output on a tail."""
    m.check_range(start, end)
    chosen: dict[str, ManifestPiece] = {}
    for p in m.pieces:
        needed = p.role == "header" or any(tensor_needed(t, start, end, m.n_layer) for t in p.tensors)
        if needed and p.piece_id not in chosen:
            chosen[p.piece_id] = p
    return PieceSelection(start, end, tuple(chosen.values()))


# -- building ----------------------------------------------------------------------------------


@dataclass(slots=True)
class _Plan:
    offset: int
    size: int
    role: PieceRole
    layer: int | None
    tensors: list[str] = field(default_factory=list)


def _role(name: str) -> tuple[PieceRole, int | None]:
    layer = tensor_layer(name)
    if layer is not None:
        return "layer", layer
    if name == EMBEDDING:
        return "embedding", None
    if name in TAIL_ONLY:
        return "output", None
    return "shared", None


def plan_pieces(h: GGUFHeader, file_size: int, piece_bytes: int = DEFAULT_PIECE_BYTES) -> list[_Plan]:
    """Cut the file into pieces (pure, from the header): the header first, then runs of
    consecutive tensors of one group up to `piece_bytes`, a larger tensor in several pieces."""
    ordered = sorted(h.tensors.values(), key=lambda t: t.offset)
    if not ordered:
        return [_Plan(0, file_size, "header", None)]
    plans = [_Plan(0, ordered[0].offset, "header", None)]
    current: _Plan | None = None
    for i, t in enumerate(ordered):
        stop = ordered[i + 1].offset if i + 1 < len(ordered) else file_size
        span = stop - t.offset  # the tensor and the padding after it
        role, layer = _role(t.name)
        if current is not None and (current.role, current.layer) == (role, layer) \
                and current.size + span <= piece_bytes:
            current.size += span
            current.tensors.append(t.name)
            continue
        if span > piece_bytes:
            plans += [_Plan(t.offset + a, min(piece_bytes, span - a), role, layer, [t.name])
                      for a in range(0, span, piece_bytes)]
            current = None
            continue
        current = _Plan(t.offset, span, role, layer, [t.name])
        plans.append(current)
    return [p for p in plans if p.size > 0]


def _quantization(file_type: object) -> str:
    try:
        import gguf

        return gguf.LlamaFileType(int(file_type)).name.removeprefix("MOSTLY_")  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return "unknown"


ProgressFn = Callable[[int, int], None]  # (bytes done, bytes total)


def build_manifest(path: str | Path, *, piece_bytes: int = DEFAULT_PIECE_BYTES,
                   progress: ProgressFn | None = None) -> ArtifactManifest:
    """Hash a GGUF file once, whole and per piece, and describe it."""
    p = Path(path)
    size = p.stat().st_size
    h = read_header(p)
    info = read_model_info(p)
    plans = plan_pieces(h, size, piece_bytes)
    whole = hashlib.sha256()
    ids: list[str] = []
    done = 0
    with open(p, "rb", buffering=0) as f:
        for plan in plans:
            piece = hashlib.sha256()
            left = plan.size
            while left:
                chunk = f.read(min(left, 4 << 20))
                if not chunk:
                    raise ManifestError(f"{p} is shorter than its header says", path=str(p))
                piece.update(chunk)
                whole.update(chunk)
                left -= len(chunk)
                done += len(chunk)
                if progress is not None:
                    progress(done, size)
            ids.append(piece.hexdigest())
    sha = whole.hexdigest()
    arch = info.arch
    pieces = [ManifestPiece(index=i, piece_id=pid, offset=pl.offset, size=pl.size, role=pl.role,
                            layer=pl.layer, tensors=pl.tensors) for i, (pl, pid) in enumerate(zip(plans, ids, strict=True))]
    layer_to: dict[int, list[str]] = {i: [] for i in range(info.n_layer)}
    shared: dict[str, list[str]] = {}
    for pc in pieces:
        bucket = layer_to[pc.layer] if pc.layer is not None else shared.setdefault(pc.role, [])
        if pc.piece_id not in bucket:
            bucket.append(pc.piece_id)
    base, label = h.get("general.basename"), h.get("general.size_label")
    return ArtifactManifest(
        artifact_id=sha[:32], model=info.name, model_name=str(h.get("general.name", info.name)),
        preset=f"{base}-{label}".lower() if base and label else None,
        architecture=arch, n_layer=info.n_layer, n_embd=info.n_embd,
        expert_count=int(h.get(f"{arch}.expert_count", 0) or 0),
        upstream_repo=_first_str(h, "general.source.repo_url", "general.source.huggingface.repository",
                                 "general.base_model.0.repo_url", "general.repo_url"),
        upstream_revision=_first_str(h, "general.source.revision", "general.base_model.0.revision"),
        license=_first_str(h, "general.license"),
        quantization=_quantization(h.get("general.file_type")),
        context_length=info.n_ctx_train, file_name=p.name, file_size=size, file_sha256=sha,
        piece_bytes=piece_bytes, pieces=pieces,
        tensor_to_layer_map={name: tensor_layer(name) for name in h.tensors},
        layer_to_pieces=layer_to, shared_pieces=shared,
        cache=CacheDescriptor(cache_abi=f"llama.cpp/kv-f16/{arch}", kv_bytes_per_token_per_layer=2 * info.kv_width * 2),
    )


def _first_str(h: GGUFHeader, *keys: str) -> str | None:
    for k in keys:
        v = h.get(k)
        if isinstance(v, str) and v:
            return v
    return None


class ProgressLine:
    """A one-line terminal progress report (bytes, rate, ETA), at most every `every_s`."""

    def __init__(self, label: str, *, stream=None, every_s: float = 0.5) -> None:
        import sys

        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.every_s = every_s
        self.t0 = time.monotonic()
        self._last = 0.0

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if now - self._last < self.every_s and done < total:
            return
        self._last = now
        self.stream.write("\r" + progress_text(self.label, done, total, now - self.t0))
        if done >= total:
            self.stream.write("\n")
        self.stream.flush()


def progress_text(label: str, done: int, total: int, elapsed_s: float, start: int = 0) -> str:
    """`label  12.0/33.5 MB  35%  48.1 MB/s  ETA 0.4 s` (pure); `start` of the `done` bytes were
    there before (a resumed fetch) and count in the total, not in the rate."""
    rate = (done - start) / elapsed_s if elapsed_s > 0 else 0.0
    eta = (total - done) / rate if rate > 0 else float("inf")
    pct = 100.0 * done / total if total else 100.0
    eta_s = f"{eta:.1f} s" if eta != float("inf") else "?"
    return f"{label}  {done / 1e6:.1f}/{total / 1e6:.1f} MB  {pct:.0f}%  {rate / 1e6:.1f} MB/s  ETA {eta_s}"


def cached_manifest(path: str | Path, *, piece_bytes: int = DEFAULT_PIECE_BYTES,
                    progress: ProgressFn | None = None) -> ArtifactManifest:
    """The manifest of a local GGUF, built once and kept under `<cache>/manifests/`
    (keyed by the file's revision, so a changed file gets a new one)."""
    from artifacts.revision import cache_dir, model_revision

    p = Path(path)
    target = cache_dir() / "manifests" / f"{model_revision(p)}-{p.stat().st_size}-{piece_bytes}.json"
    if target.is_file():
        try:
            return ArtifactManifest.load(target)
        except ManifestError:
            pass  # rebuilt below
    m = build_manifest(p, piece_bytes=piece_bytes, progress=progress)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(f".{time.monotonic_ns()}.tmp")
    m.save(tmp)
    tmp.replace(target)
    return m
