"""`meshnet validator` on a user's own GGUF: the reference's KV profile follows the model, and a
file it cannot load is one error line, not a traceback."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.fixtures.tiny_gguf import write_tiny_model
from validator.main import _load_reference, build_parser, main


def test_the_reference_takes_the_kv_profile_a_node_of_the_model_runs(tmp_path: Path) -> None:
    """A model whose head dimension is no multiple of 32 (16 here) made the reference, exact by
    default, raise UnsupportedModelError: the validator died with a traceback."""
    path = write_tiny_model(tmp_path / "tiny.gguf", "llama", n_embd=64, n_head=4)  # head dim 16
    reference, profile = asyncio.run(_load_reference(build_parser().parse_args(["--model", str(path)])))
    assert profile == "default" and reference is not None
    reference.close()
    args = build_parser().parse_args(["--model", str(path), "--kv-profile", "default", "--reference", "none"])
    assert asyncio.run(_load_reference(args)) == (None, "default")


@pytest.mark.parametrize(("name", "says"), [("missing.gguf", "not found"), ("notes.gguf", "not a GGUF file")])
def test_a_model_the_validator_cannot_load_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                       name: str, says: str) -> None:
    (tmp_path / "notes.gguf").write_text("not a model\n" * 50)
    assert main(["--model", str(tmp_path / name), "--nice", "0", "--nats", "nats://127.0.0.1:1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("meshnet validator:") and says in err and "Traceback" not in err
