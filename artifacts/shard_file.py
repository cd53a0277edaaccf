"""Shard materialization: cut a layer range [start, end) out of a full GGUF into its own GGUF.

A shard file keeps the model's metadata, sets `<arch>.block_count` to the range length and
keeps `blk.i.*` for i in the range renumbered from 0. Per-layer metadata arrays are sliced.

Shards never see text, so no shard file carries the tokenizer: `tokenizer.ggml.model` is
"none" and `<arch>.vocab_size` gives the vocabulary size. A non-tail shard gets a tiny
vocabulary (TINY_VOCAB dummy tokens, zero `token_embd`/`output`), so neither its file nor
its LM head carries the model's vocabulary.
Such a shard takes hidden rows only; the head shard's embedding lookup happens outside
llama.cpp (see `TokenEmbedding`). A non-tail shard also gets one extra "capture layer"
(a copy of its last layer) whose INPUT llama.cpp hands out for every row
(llama_set_embeddings_layer_inp): that input is the shard's output, and no eval callback
is needed. The engine asks for no output row, so the capture layer's FFN and the LM head
run on zero rows; only the capture layer's attention part is extra work.
Files are cached under `cache_dir()/shards`, keyed by the model revision and the range,
and written atomically (temp file + rename).

Everything here reads the model through a ModelSource (artifacts/source.py): a whole GGUF, or
the verified pieces a node fetched from the Shard Swarm. `shard_source_tensors` names exactly
the tensors the writer reads for a range, so the Artifact Manifest's piece list for a range
(artifacts/manifest.py) is, by construction, what the writer needs.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from artifacts.architectures import SPLITTABLE, arch_support, split_reason, swa_pattern
from artifacts.gguf_header import GGUFHeader
from artifacts.revision import cache_dir
from artifacts.source import ModelSource, open_source

FORMAT_VERSION = 2  # bump when the shard layout changes; old cache entries are then ignored
TINY_VOCAB = 8
RECENT_ROWS = 4096  # single-token embedding rows kept dequantized on a head shard
SPLITTABLE_ARCHS = frozenset(SPLITTABLE)  # graphs whose layer range we cut exactly (artifacts/architectures.py)
_BLK = re.compile(r"^blk\.(\d+)\.(.+)$")
EMBEDDING = "token_embd.weight"
# tensors only a tail's file carries (a non-tail shard gets zeros of TINY_VOCAB rows instead)
TAIL_ONLY = frozenset({EMBEDDING, "output.weight"})


def tensor_layer(name: str) -> int | None:
    """The layer a tensor belongs to (`blk.<i>.…`), or None for a shared tensor."""
    m = _BLK.match(name)
    return int(m.group(1)) if m else None


class ShardFileError(ValueError):
    """A shard cannot be cut from this model (bad range, unknown layout)."""

    def __init__(self, message: str, *, model: str, start: int, end: int) -> None:
        super().__init__(message)
        self.model = model
        self.start = start
        self.end = end


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What a shard runtime needs to know about a full GGUF before loading it."""

    path: Path
    arch: str
    name: str
    n_layer: int
    n_embd: int
    n_vocab: int
    n_ctx_train: int
    splittable: bool
    reason: str  # why not splittable ("" when it is)
    n_head: int = 0
    n_head_kv: int = 0
    head_dim: int = 0
    expert_count: int = 0  # experts per MoE layer (0: dense)
    expert_used_count: int = 0  # experts one token runs in a MoE layer

    @property
    def kv_width(self) -> int:
        """K (or V) values per token per layer: kv heads × head dim."""
        return self.n_head_kv * self.head_dim


def split_blocker(arch: str, metadata: dict[str, Any]) -> str:
    """Why a layer range of this architecture cannot be cut exactly ("" when it can)."""
    # experts live in their layer's tensors (router, stacked expert FFNs), so they cut like
    # any other per-layer tensor; tests/test_architectures.py proves each listed MoE exact
    return split_reason(arch)


def read_model_info(model: str | Path | ModelSource) -> ModelInfo:
    """Read architecture, sizes and splittability from a GGUF header (tensor data stays on disk)."""
    src = open_source(model)
    h = src.header
    arch = str(h.get("general.architecture", "unknown"))
    embd = h.tensors.get("token_embd.weight")
    n_vocab = int(embd.dims[1]) if embd is not None and len(embd.dims) > 1 else 0
    reason = split_blocker(arch, {f"{arch}.expert_count": h.get(f"{arch}.expert_count")})
    n_embd = int(h.get(f"{arch}.embedding_length", 0))
    n_head = _per_layer_first(h.get(f"{arch}.attention.head_count", 0))
    n_head_kv = _per_layer_first(h.get(f"{arch}.attention.head_count_kv", n_head))
    return ModelInfo(
        path=src.location,
        arch=arch,
        name=src.name,
        n_layer=int(h.get(f"{arch}.block_count", 0)),
        n_embd=n_embd,
        n_vocab=n_vocab,
        n_ctx_train=int(h.get(f"{arch}.context_length", 0)),
        splittable=not reason,
        reason=reason,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=int(h.get(f"{arch}.attention.key_length", 0)) or (n_embd // n_head if n_head else 0),
        expert_count=int(h.get(f"{arch}.expert_count", 0) or 0),
        expert_used_count=int(h.get(f"{arch}.expert_used_count", 0) or 0),
    )


def _per_layer_first(value: Any) -> int:
    """A hyperparameter that may be per-layer (a list): its first value."""
    return int(value[0] if isinstance(value, list) else value)


@dataclass(frozen=True, slots=True)
class ShardWeights:
    """The weight bytes of a shard's layers, and the part of them one token reads."""

    param_bytes: int  # every tensor of layers [start, end)
    active_bytes: int  # per token: a MoE layer runs expert_used_count of its expert_count experts


def is_expert_tensor(name: str) -> bool:
    """A stacked per-expert tensor (`blk.<i>.ffn_{gate,up,down}_exps.*`, one slice per expert);
    a layer's router (`ffn_gate_inp`) and shared experts (`*_shexp`) run for every token."""
    return tensor_layer(name) is not None and "_exps." in name


def shard_weights(h: GGUFHeader, start: int, end: int) -> ShardWeights:
    """Parameter bytes of layers [start, end) and the bytes one token reads of them (pure, from
    the header alone, so a piece store's header serves as well as the file): every layer
    tensor in full, but of each stacked expert tensor only expert_used_count / expert_count
    (the router picks that many experts per token). Dense: active == param. Shared tensors
    (the embedding, the output head a tail also runs) are left out: every route has them once."""
    share = token_share(h)
    param = active = 0
    for t in h.tensors.values():
        layer = tensor_layer(t.name)
        if layer is None or not start <= layer < end:
            continue
        param += t.nbytes
        active += share(t.name, t.nbytes)
    return ShardWeights(param_bytes=param, active_bytes=active)


def token_share(h: GGUFHeader) -> Callable[[str, int], int]:
    """What one token uses of `amount` (bytes or weights) of a named layer tensor (pure): all of
    it, but of a stacked expert tensor only expert_used_count / expert_count. Experts are
    stacked on the slowest axis in equal slices, so the share is exact."""
    arch = str(h.get("general.architecture", "unknown"))
    n_expert = int(h.get(f"{arch}.expert_count", 0) or 0)
    n_used = min(int(h.get(f"{arch}.expert_used_count", 0) or 0), n_expert)

    def share(name: str, amount: int) -> int:
        return amount * n_used // n_expert if n_used and is_expert_tensor(name) else amount

    return share


def shard_cache_path(model: str | Path | ModelSource, start: int, end: int) -> Path:
    """Where the shard [start, end) of this model is cached (keyed by model revision)."""
    return shard_path_of(open_source(model).revision, start, end)


def shard_path_of(revision: str, start: int, end: int) -> Path:
    """Where the shard [start, end) of the model of this revision is cached."""
    return cache_dir() / "shards" / f"{revision}-{start}-{end}-v{FORMAT_VERSION}.gguf"


def tensor_needed(name: str, start: int, end: int, n_layer: int) -> bool:
    """Whether the shard of [start, end) reads this original tensor (pure): its layers, the
    shared tensors, and on the tail the embedding (tied LM head) and output head; a head
    that is not the tail reads the embedding for its TokenEmbedding."""
    layer = tensor_layer(name)
    if layer is not None:
        return start <= layer < end
    return end == n_layer or name not in TAIL_ONLY or (start == 0 and name == EMBEDDING)


def active_param_bytes(h: GGUFHeader, start: int, end: int) -> int:
    """Weight bytes one token reads in layers [start, end) (pure; `shard_weights`). The
    ledger pays work by it, so a heavy shard earns more than a light one of as many layers,
    and the tracker prices a hop nobody has measured by it (the Capability Report's
    `active_param_bytes_per_token`)."""
    return shard_weights(h, start, end).active_bytes


def shard_source_tensors(h: GGUFHeader, start: int, end: int) -> list[str]:
    """The original tensors the shard of [start, end) is written from, in file order."""
    n_layer = int(h.get(f"{h.get('general.architecture')}.block_count", 0))
    ordered = sorted(h.tensors.values(), key=lambda t: t.offset)
    return [t.name for t in ordered if tensor_needed(t.name, start, end, n_layer)]


def materialize_shard(model: str | Path | ModelSource, start: int, end: int) -> Path:
    """Return a GGUF holding exactly layers [start, end) of the model; cut it once and cache it.

    The whole range [0, n_layer) is the original file itself (a piece store writes it out
    whole, byte for byte, the first time).
    """
    src = open_source(model)
    info = read_model_info(src)
    if not (0 <= start < end <= info.n_layer):
        raise ShardFileError(
            f"layer range [{start}, {end}) is not inside [0, {info.n_layer})",
            model=str(model), start=start, end=end,
        )
    if start == 0 and end == info.n_layer:
        try:
            whole = src.whole_file()
        except OSError as exc:  # a piece store writes the file out first: its disk may be full
            raise _write_error(exc, getattr(src, "location", Path(".")), model, start, end) from exc
        if whole is None:
            raise ShardFileError("the whole model needs every piece of it", model=str(model), start=start, end=end)
        return whole
    if not info.splittable:
        raise ShardFileError(info.reason, model=str(model), start=start, end=end)
    target = shard_cache_path(src, start, end)
    if target.exists():
        return target
    tmp = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
        os.close(fd)
        _write_shard(src, Path(tmp), start, end, tail=end == info.n_layer)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; the cache is shared by the machine's nodes
        os.replace(tmp, target)
    except OSError as exc:  # a full or read-only cache disk: said in one line, not a traceback
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)  # first, so the free space said is what the shard would find
        raise _write_error(exc, target.parent, model, start, end) from exc
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _write_error(exc: OSError, where: Path, model: object, start: int, end: int) -> ShardFileError:
    """A ShardFileError for a shard (or whole file) this machine could not write to `where`."""
    why = exc.strerror or f"{exc} (disk full?)"  # numpy's short write ("N requested and M written") has no errno
    try:
        free = f"{shutil.disk_usage(where).free / 1e6:.1f} MB free there"
    except OSError:
        free = "free space unknown"
    return ShardFileError(f"cannot write the file of layers [{start},{end}) to {where}: {why} ({free}; "
                          "MESHNET_CACHE sets where shard files go)", model=str(model), start=start, end=end)


def _copy_metadata(h: GGUFHeader, writer: Any, arch: str, start: int, end: int, tail: bool) -> None:
    import gguf

    n_layer = int(h.get(f"{arch}.block_count"))
    for name, (vtype, item, value) in h.fields.items():
        if name == "general.architecture" or name.startswith(("GGUF.", "tokenizer.")):
            continue
        if name in (f"{arch}.block_count", f"{arch}.vocab_size") or (
                name == f"{arch}.attention.sliding_window_pattern" and not isinstance(value, list)):
            continue  # rewritten below
        if name.startswith(f"{arch}.") and isinstance(value, list) and len(value) == n_layer:
            # per-layer hyperparameters follow the layers (the capture layer copies the last)
            value = value[start:end] if tail else [*value[start:end], value[end - 1]]
        sub = gguf.GGUFValueType(item) if item is not None else None
        writer.add_key_value(name, value, gguf.GGUFValueType(vtype), sub_type=sub)
    support = arch_support(arch)
    pattern_key = f"{arch}.attention.sliding_window_pattern"
    if support is not None and support.swa_period and not isinstance(h.get(pattern_key), list):
        # a pattern llama.cpp would compute from the shard-local index: write it out from the
        # original indexes (the capture layer copies the last)
        pattern = swa_pattern(support.swa_period, start, end)
        writer.add_array(pattern_key, pattern if tail else [*pattern, pattern[-1]])
    writer.add_uint32(f"{arch}.block_count", end - start + (0 if tail else 1))
    # shards take embeddings, never text: no tokenizer, only the vocabulary size
    writer.add_string("tokenizer.ggml.model", "none")
    n_vocab = int(h.tensors["token_embd.weight"].dims[1]) if tail else TINY_VOCAB
    writer.add_uint32(f"{arch}.vocab_size", n_vocab)


def _shard_tensors(h: GGUFHeader, start: int, end: int, tail: bool) -> list[tuple[str, Any]]:
    """(new name, TensorInfo or a float32 array) for every tensor the shard file keeps."""
    kept: list[tuple[str, Any]] = []
    capture: list[tuple[str, Any]] = []  # the capture layer: a copy of the last layer
    n_embd = int(h.tensors["token_embd.weight"].dims[0])
    for t in h.tensors.values():
        m = _BLK.match(t.name)
        if m:
            i = int(m.group(1))
            if start <= i < end:
                kept.append((f"blk.{i - start}.{m.group(2)}", t))
            if i == end - 1 and not tail:
                capture.append((f"blk.{end - start}.{m.group(2)}", t))
            continue
        if not tail and t.name in TAIL_ONLY:
            continue
        kept.append((t.name, t))
    if not tail:
        zeros = np.zeros((TINY_VOCAB, n_embd), dtype=np.float32)
        kept.insert(0, ("token_embd.weight", zeros))
        kept.append(("output.weight", zeros))
    return kept + capture


def _write_shard(src: ModelSource, dst: Path, start: int, end: int, *, tail: bool) -> None:
    import gguf

    h = src.full_header()
    arch = str(h.get("general.architecture"))
    writer = gguf.GGUFWriter(str(dst), arch=arch)
    writer.data_alignment = h.alignment
    _copy_metadata(h, writer, arch, start, end, tail)
    tensors = _shard_tensors(h, start, end, tail)
    for name, t in tensors:
        if isinstance(t, np.ndarray):
            writer.add_tensor_info(name, t.shape, t.dtype, t.nbytes)
        else:
            qtype = gguf.GGMLQuantizationType(t.ggml_type)
            writer.add_tensor_info(name, t.byte_shape, np.dtype(np.uint8), t.nbytes, qtype)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for _name, t in tensors:
            writer.write_tensor_data(t if isinstance(t, np.ndarray) else src.tensor_bytes(t.name))
    except BaseException:
        for f in writer.fout or ():  # a failed write (disk full): the file is removed, free its blocks too
            with contextlib.suppress(OSError):
                f.close()
        raise
    writer.close()


def _block_decoder(ggml_type: int) -> tuple[Any, int]:
    """gguf's block dequantizer for a quantized type and its block size in bytes, or (None, 0)."""
    import gguf
    from gguf.quants import _type_traits

    qtype = gguf.GGMLQuantizationType(ggml_type)
    traits = _type_traits.get(qtype)
    if traits is None:
        return None, 0
    return traits.dequantize_blocks, gguf.GGML_QUANT_SIZES[qtype][1]


class TokenEmbedding:
    """The head shard's embedding lookup, done in numpy from the full GGUF's `token_embd`.

    Rows stay in their stored (quantized) form and are dequantized per lookup, exactly as
    llama.cpp's get_rows would.
    """

    def __init__(self, model: str | Path | ModelSource) -> None:
        src = open_source(model)
        t = src.header.tensors.get(EMBEDDING)
        if t is None:
            raise ShardFileError("model has no token_embd.weight", model=str(model), start=0, end=0)
        self._qtype = t.ggml_type
        self._rows = np.ascontiguousarray(src.tensor_bytes(t.name))  # [n_vocab, bytes_per_row]
        self.n_vocab = int(t.dims[1])
        self.n_embd = int(t.dims[0])
        self._blocks, self._type_size = _block_decoder(t.ggml_type)
        self._recent: dict[int, np.ndarray] = {}  # bounded cache of single-row lookups

    @property
    def nbytes(self) -> int:
        """Memory held by the stored rows."""
        return int(self._rows.nbytes)

    def lookup(self, token_ids: np.ndarray) -> np.ndarray:
        """[n] token ids → [n, n_embd] float32 embeddings."""
        if len(token_ids) == 1:  # decode steps: one row, often a token seen before
            return self._one(int(token_ids[0]))[None, :]
        return self._dequantize(np.asarray(token_ids, dtype=np.int64))

    def _one(self, token_id: int) -> np.ndarray:
        row = self._recent.get(token_id)
        if row is None:
            if len(self._recent) >= RECENT_ROWS:
                self._recent.pop(next(iter(self._recent)))  # oldest first
            row = self._recent[token_id] = self._dequantize(np.asarray([token_id]))[0]
        return row

    def _dequantize(self, ids: np.ndarray) -> np.ndarray:
        rows = self._rows[ids]
        if self._blocks is not None:  # straight to the block decoder: ~3x faster for one row
            out = self._blocks(rows.reshape(-1, self._type_size))
        else:
            import gguf

            out = gguf.quants.dequantize(rows, gguf.GGMLQuantizationType(self._qtype))
        return np.ascontiguousarray(out.reshape(len(rows), self.n_embd), dtype=np.float32)
