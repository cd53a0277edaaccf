"""`meshnet audit`: measured support facts about a GGUF, on the bundled model (split exactly
at two cuts), a tiny GGUF llama.cpp cannot run, and a download cut short."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from artifacts.gguf_header import read_header
from meshnet.audit import (
    ArtifactCheck,
    CutCheck,
    LayerRangeCheck,
    WholeModelCheck,
    audit_cuts,
    verdict,
)
from tests.fixtures.tiny_gguf import write_tiny_gemma, write_tiny_gemma3, write_tiny_model

ROOT = Path(__file__).resolve().parent.parent


def run_audit(path: Path) -> tuple[int, dict]:
    done = subprocess.run([sys.executable, "-m", "meshnet.cli", "audit", str(path), "--json"], cwd=ROOT,
                          capture_output=True, text=True, timeout=900, check=False)
    return done.returncode, json.loads(done.stdout)


def test_cuts_and_verdicts() -> None:
    assert audit_cuts(30) == [10, 20] and audit_cuts(2) == [1] and audit_cuts(1) == []
    art, bad_art = ArtifactCheck(complete=True, file_bytes=1, tensors=1), ArtifactCheck(complete=False, file_bytes=1, tensors=0)
    ok = WholeModelCheck(ok=True)
    exact = LayerRangeCheck(supported=True, cuts=[CutCheck(cut=1, ok=True, max_abs_diff=0.0, tokens_equal=True)])
    inexact = LayerRangeCheck(supported=True, cuts=[CutCheck(cut=1, ok=True, max_abs_diff=0.5, tokens_equal=True)])
    crashed = LayerRangeCheck(supported=True, cuts=[CutCheck(cut=1, ok=False, error="killed by signal 6")])
    assert verdict(art, ok, exact).startswith("ready to split")
    assert "NOT exact" in verdict(art, ok, inexact) and "NOT exact" in verdict(art, ok, crashed)
    assert verdict(bad_art, ok, exact).startswith("incomplete")
    assert "cannot run" in verdict(art, WholeModelCheck(ok=False), exact)
    assert "one node only" in verdict(art, ok, LayerRangeCheck(supported=False, reason="x"))


def test_the_bundled_model_splits_exactly_at_both_cuts(model_path: Path) -> None:
    code, r = run_audit(model_path)
    assert code == 0 and r["arch"] == "llama" and r["n_layer"] == 30 and r["experts"] == 0
    assert r["artifact"]["complete"] and r["whole_model"]["ok"] and len(r["whole_model"]["tokens"]) == 8
    assert [c["cut"] for c in r["layer_ranges"]["cuts"]] == [10, 20]
    for c in r["layer_ranges"]["cuts"]:
        assert c["ok"] and c["tokens_equal"] and c["max_abs_diff"] <= 1e-3
    # the exact KV profile, as a node runs it: layers × kv width × (q8_0 K: 34 bytes per 32 values + f16 V)
    assert r["whole_model"]["kv_bytes_per_token"] == 30 * 3 * 64 * (34 / 32 + 2)
    # dense: a token reads every weight of every layer
    layers = sum(t.nbytes for name, t in read_header(model_path).tensors.items() if name.startswith("blk."))
    assert r["param_bytes"] == r["active_param_bytes_per_token"] == layers
    assert r["verdict"].startswith("ready to split")


def test_a_file_llama_cpp_cannot_run_and_a_cut_short_download(tmp_path: Path, model_path: Path) -> None:
    tiny = write_tiny_gemma(tmp_path / "tiny-gemma.gguf")
    code, r = run_audit(tiny)
    assert code == 1 and r["arch"] == "gemma" and r["artifact"]["complete"]
    assert not r["whole_model"]["ok"] and "could not load" in r["whole_model"]["error"]
    assert not r["layer_ranges"]["supported"] and "gemma" in r["layer_ranges"]["reason"].lower()

    cut = tmp_path / "cut.gguf"
    data = model_path.read_bytes()
    cut.write_bytes(data[:-1_000_000])
    code, r = run_audit(cut)
    assert code == 1 and not r["artifact"]["complete"]
    assert any("past the end of the file" in p for p in r["artifact"]["problems"])
    assert not r["whole_model"]["ok"] and r["verdict"].startswith("incomplete")


@pytest.mark.parametrize("keep", [100, 30_000_000])
def test_meshnet_node_refuses_a_cut_short_gguf_with_one_line(tmp_path: Path, model_path: Path, keep: int) -> None:
    """A truncated model file: a one-line error naming the file and exit code 2, no traceback."""
    cut = tmp_path / "cut.gguf"
    with model_path.open("rb") as f:
        cut.write_bytes(f.read(keep))
    done = subprocess.run([sys.executable, "-m", "meshnet.cli", "node", "--model", str(cut), "--layers", "0:15",
                           "--no-bus", "--port", "0"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 2, done.stderr
    assert f"meshnet node: {cut}:" in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert ("truncated" if keep > 100 else "unreadable GGUF header") in done.stderr


@pytest.mark.parametrize("junk", [b"", b"not a gguf at all"])
def test_not_a_gguf_is_a_clear_error(tmp_path: Path, junk: bytes) -> None:
    p = tmp_path / "junk.gguf"
    p.write_bytes(junk)
    done = subprocess.run([sys.executable, "-m", "meshnet.cli", "audit", str(p)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 1 and "not a GGUF file" in done.stderr


@pytest.mark.parametrize(("arch", "experts"), [("llama", 0), ("llama", 4), ("qwen2", 0), ("qwen3", 0),
                                               ("qwen3moe", 0), ("phi3", 0), ("gemma3", 0)])
def test_one_fixture_per_architecture_audits_as_exactly_splittable(tmp_path: Path, arch: str, experts: int) -> None:
    if arch == "gemma3":
        path = write_tiny_gemma3(tmp_path / "g3.gguf")
    else:
        path = write_tiny_model(tmp_path / f"{arch}.gguf", arch, n_expert=experts)
    code, r = run_audit(path)
    assert code == 0 and r["arch"] == arch and r["experts"] == (experts or (4 if arch == "qwen3moe" else 0))
    assert r["verdict"].startswith("ready to split"), r
    # a MoE token reads 2 of its 4 experts: 4 layers × 2 unread experts × gate, up, down (f32)
    unread = 4 * 2 * 3 * 96 * 64 * 4 if r["experts"] else 0
    assert r["param_bytes"] - r["active_param_bytes_per_token"] == unread
