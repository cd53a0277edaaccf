"""`meshnet gateway --model` with a file it cannot serve: one line naming the problem, exit 2
(a traceback from llama.cpp's loader or the model resolver before)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.main import main
from tests.fixtures.tiny_gguf import write_tiny_gemma


@pytest.mark.parametrize(("make", "says"), [
    (lambda d: d / "missing.gguf", "not found"),
    (lambda d: (d / "notes.gguf").write_text("not a model\n" * 50) and d / "notes.gguf", "not a GGUF file"),
    (lambda d: write_tiny_gemma(d / "no-tokenizer.gguf"), "could not load the vocabulary"),
])
def test_a_model_the_gateway_cannot_serve_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                      make, says: str) -> None:  # type: ignore[no-untyped-def]
    assert main(["--model", str(make(tmp_path)), "--port", "0", "--nats", "nats://127.0.0.1:1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("meshnet gateway:") and says in err and "Traceback" not in err
