"""Shard materialization from the full GGUF: layout, caching, unsupported architectures."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from artifacts.gguf_header import SkippedArray, read_header
from artifacts.shard_file import (
    TINY_VOCAB,
    ShardFileError,
    TokenEmbedding,
    materialize_shard,
    read_model_info,
)
from nodes.engine import UnsupportedModelError
from tests.fixtures.tiny_gguf import write_tiny_gemma


def _field(path: Path, key: str):
    return read_header(path).get(key)


def test_shard_files_keep_exact_layers(model_path, shard_cache) -> None:
    src = read_header(model_path)
    head = materialize_shard(model_path, 0, 10)
    mid = materialize_shard(model_path, 10, 20)
    tail = materialize_shard(model_path, 20, 30)
    assert materialize_shard(model_path, 0, 30) == model_path
    for path, start, end in ((head, 0, 10), (mid, 10, 20), (tail, 20, 30)):
        assert path.parent.parent == shard_cache
        capture = 0 if end == 30 else 1  # non-tail shards end with a capture layer
        assert _field(path, "llama.block_count") == end - start + capture
        got = read_header(path)
        for i in range(end - start + capture):
            a, b = f"blk.{i}.ffn_down.weight", f"blk.{min(start + i, end - 1)}.ffn_down.weight"
            assert got.tensors[a].ggml_type == src.tensors[b].ggml_type
            assert np.array_equal(got.tensor_bytes(a), src.tensor_bytes(b))
        assert f"blk.{end - start + capture}.attn_q.weight" not in got.tensors
    for non_tail in (head, mid):
        assert _field(non_tail, "tokenizer.ggml.model") == "none"
        assert _field(non_tail, "llama.vocab_size") == TINY_VOCAB
        assert read_header(non_tail).tensors["token_embd.weight"].dims == (576, TINY_VOCAB)
    assert _field(tail, "tokenizer.ggml.model") == "none"
    assert _field(tail, "llama.vocab_size") == 49152
    assert read_header(tail).tensors["token_embd.weight"].dims == (576, 49152)


def test_shard_file_is_cut_once(model_path, shard_cache) -> None:
    path = materialize_shard(model_path, 3, 7)
    stamp = path.stat().st_mtime_ns
    assert materialize_shard(model_path, 3, 7) == path
    assert path.stat().st_mtime_ns == stamp
    assert not list(path.parent.glob("*.tmp"))


@pytest.fixture(scope="module")
def reference_reader(model_path):
    """gguf's own (slow, ~8 s) reader: the independent view of the file."""
    import gguf

    return gguf.GGUFReader(str(model_path))


def test_fast_header_agrees_with_gguf_reader(model_path, reference_reader) -> None:
    mine = read_header(model_path)
    assert set(mine.fields) == {k for k in reference_reader.fields if not k.startswith("GGUF.")}
    for key, field in reference_reader.fields.items():
        if key.startswith("GGUF."):
            continue
        if isinstance(mine.get(key), SkippedArray):  # only the big string tables are skipped
            assert key.startswith("tokenizer.ggml.") and mine.get(key).count == len(field.data)
            continue
        assert mine.get(key) == field.contents(), key
    assert len(mine.tensors) == len(reference_reader.tensors)
    for t in reference_reader.tensors:
        info = mine.tensors[t.name]
        assert (list(info.dims), info.ggml_type, info.nbytes) == (list(t.shape), int(t.tensor_type), t.n_bytes)
        assert info.offset == t.data_offset
        if t.name in ("token_embd.weight", "blk.29.ffn_down.weight", "output_norm.weight"):
            assert np.array_equal(mine.tensor_bytes(t.name).reshape(-1), np.asarray(t.data).view(np.uint8).reshape(-1))


def test_token_embedding_matches_gguf_rows(model_path, reference_reader) -> None:
    import gguf

    emb = TokenEmbedding(model_path)
    t = next(t for t in reference_reader.tensors if t.name == "token_embd.weight")
    ids = np.asarray([0, 1, 504, 49151], dtype=np.int32)
    want = gguf.quants.dequantize(t.data[ids], t.tensor_type)
    assert np.array_equal(emb.lookup(ids), want)
    for _ in range(2):  # single-row path, uncached then cached
        assert np.array_equal(emb.lookup(ids[2:3]), want[2:3])


@pytest.fixture
def gemma_gguf(tmp_path: Path) -> Path:
    """A tiny random-weight GGUF of an architecture we cannot split (Gemma scales embeddings)."""
    return write_tiny_gemma(tmp_path / "tiny-gemma.gguf")


def test_unsplittable_architecture_is_reported_and_refused(gemma_gguf, shard_cache) -> None:
    from nodes.engine_factory import load_engine

    info = read_model_info(gemma_gguf)
    assert info.arch == "gemma" and info.n_layer == 2 and not info.splittable
    with pytest.raises(ShardFileError):
        materialize_shard(gemma_gguf, 0, 1)
    for backend in ("llama.cpp", "torch"):
        with pytest.raises(UnsupportedModelError):
            load_engine(backend, gemma_gguf, 0, 1)


def _short_of_disk(limit: int):  # a child whose files cannot grow past `limit` bytes (EFBIG), as on a full disk
    def apply() -> None:
        import resource
        import signal

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a failed write, not a killed process
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


def test_a_node_whose_cache_disk_is_full_says_so_in_one_line_and_leaves_no_partial_shard(
        model_path: Path, tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "MESHNET_CACHE": str(tmp_path / "cache")}
    got = subprocess.run([sys.executable, "-m", "nodes.main", "--model", str(model_path), "--layers", "0:10",
                          "--no-bus", "--port", "0"], cwd=root, env=env, capture_output=True, text=True,
                         timeout=120, preexec_fn=_short_of_disk(4 << 20))
    assert got.returncode == 2 and "Traceback" not in got.stderr, got.stderr[-3000:]
    assert "cannot write the file of layers [0,10)" in got.stderr and "MESHNET_CACHE" in got.stderr, got.stderr
    assert list((tmp_path / "cache" / "shards").iterdir()) == []  # no .tmp left behind


def test_a_revision_stamp_the_cache_cannot_hold_is_dropped_not_left_cut(model_path: Path, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    from artifacts import revision

    monkeypatch.setenv("MESHNET_CACHE", str(tmp_path))
    real = Path.write_text

    def full(self: Path, data: str, *a, **k) -> int:
        real(self, data[:3])  # what a full disk lets through
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full)
    revision._hash_file.cache_clear()
    digest = revision.model_revision(model_path)
    monkeypatch.setattr(Path, "write_text", real)
    revision._hash_file.cache_clear()
    assert list((tmp_path / "revisions").iterdir()) == []  # no 3-digit stamp to be read back as the revision
    assert revision.model_revision(model_path) == digest and len(digest) == 16
