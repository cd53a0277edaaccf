"""A draft model on the route's head (`meshnet node --draft-model PATH.gguf`): the model itself
as its own draft drafts free text (where prompt lookup finds nothing), every draft is kept (it
runs the route's exact KV profile) and the tokens stay llama.cpp's greedy ones; a GGUF whose vocabulary differs is refused with a clear error."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from nodes.drafters import weightless
from tests.fixtures.mesh import Mesh
from tests.fixtures.tiny_gguf import write_tiny_model
from tests.test_route_exact import reference_greedy
from tests.test_speculative import EXACT, FREE, N, run, tokenize

ROOT = Path(__file__).resolve().parent.parent


async def test_the_model_as_its_own_draft_keeps_most_drafts_and_the_greedy_tokens(mesh: Mesh, model_path: Path) -> None:
    nodes = [await mesh.spawn((0, 15), args=(*EXACT, "--draft-model", str(model_path))),
             await mesh.spawn((15, 30), args=EXACT)]
    prompt = await asyncio.to_thread(tokenize, model_path, FREE)
    reference = await asyncio.to_thread(reference_greedy, model_path, prompt, N)
    tokens, drafted, accepted, _ = await run(mesh, nodes, prompt, draft=8)
    assert tokens == reference
    print(f"self-draft: {accepted} of {drafted} drafts kept")
    # the draft runs the route's exact KV profile, so its greedy tokens are the route's: all kept
    assert drafted > 0 and accepted == drafted, (drafted, accepted)


def test_a_draft_model_of_another_vocabulary_is_refused(model_path: Path, tmp_path: Path) -> None:
    tiny = write_tiny_model(tmp_path / "tiny.gguf", "llama")
    proc = subprocess.run([sys.executable, "-m", "meshnet.cli", "node", "--model", str(model_path), "--layers", "0:15",
                           "--no-bus", "--port", "0", "--draft-model", str(tiny)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "does not share the model's vocabulary" in proc.stderr and "tokens" in proc.stderr, proc.stderr


def test_a_draft_model_llama_cpp_cannot_read_is_refused_without_a_traceback(model_path: Path, tmp_path: Path) -> None:
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a model\n" * 8)
    proc = subprocess.run([sys.executable, "-m", "meshnet.cli", "node", "--model", str(model_path), "--layers", "0:15",
                           "--no-bus", "--port", "0", "--draft-model", str(junk)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "--draft-model: llama.cpp cannot read" in proc.stderr and str(junk) in proc.stderr, proc.stderr


def _vocabulary_only(model_path: Path, out: Path, block_count: int | None) -> Path:
    """The model's metadata, tokenizer included, without a tensor (as llama.cpp's ggml-vocab-*.gguf);
    `block_count` overrides the layer count it states."""
    import gguf

    from artifacts.source import open_source

    h = open_source(model_path).full_header()
    arch = str(h.get("general.architecture"))
    writer = gguf.GGUFWriter(str(out), arch=arch)
    for name, (vtype, item, value) in h.fields.items():
        if name == "general.architecture" or name.startswith("GGUF."):
            continue
        if name == f"{arch}.block_count" and block_count is not None:
            value = block_count
        writer.add_key_value(name, value, gguf.GGUFValueType(vtype),
                             sub_type=gguf.GGUFValueType(item) if item is not None else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.mark.parametrize("block_count", [None, 0], ids=["its-layers", "no-layers"])
def test_a_vocabulary_only_draft_model_is_refused_saying_it_has_no_weights(
        model_path: Path, tmp_path: Path, block_count: int | None) -> None:
    """A vocabulary-only GGUF shares the model's vocabulary, so it passed the check, then failed
    to load with 'llama.cpp could not load PATH' (or, stating 0 layers, 'layer range [0, 0) is not
    inside [0, 0)'): neither said what is wrong with the file."""
    vocab = _vocabulary_only(model_path, tmp_path / "ggml-vocab-smollm2.gguf", block_count)
    proc = subprocess.run([sys.executable, "-m", "meshnet.cli", "node", "--model", str(model_path), "--layers", "0:15",
                           "--no-bus", "--port", "0", "--kv-profile", "exact", "--draft-model", str(vocab)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"meshnet node: --draft-model: {vocab} cannot draft: it holds no tensors: a vocabulary-only GGUF (such "
        "as llama.cpp's ggml-vocab-*.gguf) has the tokenizer but no weights to draft with"), proc.stderr


def test_a_draft_model_needs_tensors_and_layers() -> None:
    assert weightless(0, 30).startswith("it holds no tensors")
    assert weightless(3, 0).startswith("it has no layers")
    assert weightless(272, 30) == ""


async def test_a_draft_model_holds_its_sessions_in_the_nodes_kv_budget(mesh: Mesh, model_path: Path) -> None:
    """The drafter sized its sessions from the default 1 GiB whatever --kv-memory said: a --ctx
    whose drafter session needs more was refused, telling the user to raise --kv-memory, which
    changed nothing. (The whole model as its drafter: some 1.1 GiB per 65,536-token session.)"""
    node = await mesh.spawn((0, 15), args=(*EXACT, "--draft-model", str(model_path), "--ctx", "65536",
                                           "--kv-memory", "2G", "--max-sessions", "1"))
    assert node.url


def test_a_draft_model_on_a_node_that_never_speculates_is_refused(model_path: Path) -> None:
    """A route speculates only when every hop runs the exact KV profile, so a head on the default
    profile would load the draft model, log "drafting with", and never draft: it is refused."""
    proc = subprocess.run([sys.executable, "-m", "meshnet.cli", "node", "--model", str(model_path), "--layers", "0:15",
                           "--no-bus", "--port", "0", "--kv-profile", "default", "--draft-model", str(model_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "drafting with" not in proc.stderr, proc.stderr
    assert "--draft-model:" in proc.stderr and "--kv-profile exact" in proc.stderr, proc.stderr
