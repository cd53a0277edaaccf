"""Per-architecture exactness: tiny random-weight GGUFs (tests/fixtures/tiny_gguf.py) cut at
every boundary and 3 ways give the whole model's logits (max |diff| <= 1e-3) and its 32
greedy tokens. Each check runs llama.cpp in a child process (meshnet.audit's probes), so an
architecture that makes llama.cpp abort fails its test instead of the test run."""

from __future__ import annotations

from pathlib import Path

import pytest

from artifacts.architectures import SPLITTABLE, arch_support, split_reason, swa_pattern
from artifacts.shard_file import read_model_info
from gateway.route_client import RouteClient
from meshnet.audit import probe_prompt, run_probe
from tests.fixtures.mesh import Mesh
from tests.fixtures.tiny_gguf import write_tiny_gemma3, write_tiny_model

ARCHS = ["llama", "qwen2", "qwen3", "qwen3moe", "phi3", "gemma3"]
CASES = [(a, 0) for a in ARCHS] + [("llama", 4)]  # (arch, experts): llama with experts is Mixtral-style
N_LAYER = 8
# every cut of an 8-layer model but one, and 3-way splits; for gemma3 most of them move the
# il % 6 pattern of sliding-window layers (and their RoPE base) unless the shard rewrites it
SPLITS = ([1], [2], [3], [5], [6], [7], [2, 5], [3, 6])


def tiny(path: Path, arch: str, *, seed: int = 0, n_expert: int = 0) -> Path:
    if arch == "gemma3":
        return write_tiny_gemma3(path, n_layer=N_LAYER, seed=seed)
    return write_tiny_model(path, arch, n_layer=N_LAYER, seed=seed, n_expert=n_expert)


@pytest.mark.parametrize(("arch", "experts"), CASES)
def test_every_cut_and_a_three_way_split_equal_the_whole_model(tmp_path: Path, arch: str, experts: int) -> None:
    path = tiny(tmp_path / f"tiny-{arch}.gguf", arch, seed=len(arch) + experts, n_expert=experts)
    info = read_model_info(path)
    assert info.arch == arch and info.n_layer == N_LAYER and info.splittable
    for cuts in SPLITS:
        got, err = run_probe("cut", path, cuts, n_tokens=32)
        assert got is not None, f"{arch} {cuts}: {err}"
        assert got["max_abs_diff"] <= 1e-3, (arch, cuts, got["max_abs_diff"])
        assert got["tokens"] == got["whole_tokens"] and len(got["tokens"]) == 32, (arch, cuts)


def test_every_splittable_architecture_is_proven_here_and_others_say_why() -> None:
    assert set(SPLITTABLE) == set(ARCHS)  # a new entry needs its exactness test above
    assert arch_support("qwen2") is not None and not arch_support("qwen2").layer_input_capture
    assert "sqrt" in split_reason("gemma") and split_reason("gemma3") == ""
    assert arch_support("gemma3").scales_token_embeddings and arch_support("gemma3").swa_period == 6
    assert swa_pattern(6, 3, 9) == [True, True, False, True, True, True]  # layers 3..8: layer 5 is full
    assert "no exact layer-range support" in split_reason("mamba")


@pytest.mark.parametrize("arch", ["qwen2", "qwen3moe", "gemma3"])
async def test_a_model_served_by_two_real_nodes_gives_the_whole_models_tokens(
        mesh: Mesh, tmp_path: Path, arch: str) -> None:
    path = tiny(tmp_path / f"tiny-{arch}.gguf", arch, seed=7)
    whole, err = run_probe("whole", path, n_tokens=16)
    assert whole is not None, err
    mesh.model_path = path  # the nodes this test spawns serve the tiny model
    head, tail = await mesh.spawn((0, 3)), await mesh.spawn((3, N_LAYER))  # 3: not a multiple of 6
    prompt = probe_prompt(read_model_info(path).n_vocab)
    session = await mesh.route([head, tail], prompt_tokens=len(prompt))
    async with RouteClient(session, mesh.http, chunk_size=8, bus=mesh.bus) as rc:
        tokens = [(await rc.prefill(prompt)).token_id]
        while len(tokens) < 16:
            tokens.append((await rc.decode(tokens[-1])).token_id)
    assert tokens == whole["tokens"]


def test_the_torch_reference_refuses_what_it_does_not_implement(tmp_path: Path) -> None:
    from nodes.engine import UnsupportedModelError
    from nodes.engine_factory import load_engine

    for arch, experts in (("qwen2", 0), ("llama", 4)):
        path = write_tiny_model(tmp_path / f"t-{arch}-{experts}.gguf", arch, n_expert=experts)
        with pytest.raises(UnsupportedModelError, match="PyTorch reference"):
            load_engine("torch", path, 0, 2)


def test_the_exact_kv_profile_is_refused_where_a_q8_0_k_cannot_hold_a_head(tmp_path: Path) -> None:
    """A tiny model's heads of 16 values do not fill a q8_0 block: `--kv-profile exact` is a clear
    error there (and a node asked for nothing runs `default`; tests/test_node_cli.py)."""
    from nodes.engine import UnsupportedModelError
    from nodes.engine_factory import load_engine

    path = write_tiny_model(tmp_path / "t-llama.gguf", "llama")
    assert read_model_info(path).head_dim == 16
    with pytest.raises(UnsupportedModelError, match="head dimension is 16"):
        load_engine("llama.cpp", path, 0, 2, kv_profile="exact")
