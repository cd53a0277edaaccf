"""The Capability Report's weight bytes (artifacts/shard_file.py `shard_weights`): what a shard's
layers hold, and what one token reads of them. A MoE layer's token reads its router, its shared
tensors and expert_used_count of its expert_count experts; a dense shard's token reads all."""

from __future__ import annotations

from pathlib import Path

import pytest

from artifacts.gguf_header import read_header
from artifacts.shard_file import active_param_bytes, read_model_info, shard_weights
from tests.fixtures.tiny_gguf import write_tiny_model

N_LAYER, N_EMBD, N_FF, F32 = 4, 64, 96, 4
FFN = 3 * N_FF * N_EMBD * F32  # one dense FFN (gate, up, down): as large as one expert here
ROUTER = 4 * N_EMBD * F32  # ffn_gate_inp of 4 experts


@pytest.fixture
def tiny_pair(tmp_path: Path) -> tuple[Path, Path]:
    """A dense llama and a Mixtral-style one (4 experts, 2 per token) of the same shape."""
    return (write_tiny_model(tmp_path / "dense.gguf", "llama", n_layer=N_LAYER),
            write_tiny_model(tmp_path / "moe.gguf", "llama", n_layer=N_LAYER, n_expert=4, n_expert_used=2))


@pytest.mark.parametrize(("start", "end"), [(0, 4), (0, 1), (1, 3), (3, 4), (2, 4)])
def test_a_moe_token_reads_its_router_and_two_of_four_experts(
        tiny_pair: tuple[Path, Path], start: int, end: int) -> None:
    dense_h, moe_h = (read_header(p) for p in tiny_pair)
    dense, moe = shard_weights(dense_h, start, end), shard_weights(moe_h, start, end)
    n = end - start
    assert dense.active_bytes == dense.param_bytes
    assert moe.param_bytes == dense.param_bytes + n * (ROUTER + 3 * FFN)  # 4 experts instead of 1 FFN
    assert moe.active_bytes == dense.active_bytes + n * (ROUTER + FFN)  # 2 of them run
    assert active_param_bytes(moe_h, start, end) == moe.active_bytes  # the ledger's figure is the same


def test_ranges_add_up_and_shared_tensors_are_left_out(tiny_pair: tuple[Path, Path], model_path: Path) -> None:
    h = read_header(tiny_pair[1])
    whole, head, tail = shard_weights(h, 0, N_LAYER), shard_weights(h, 0, 2), shard_weights(h, 2, N_LAYER)
    assert (head.param_bytes + tail.param_bytes, head.active_bytes + tail.active_bytes) == (
        whole.param_bytes, whole.active_bytes)
    # every layer of the fixture is alike: neither the head's embedding nor the tail's LM head counts
    assert shard_weights(h, 0, 1) == shard_weights(h, 1, 2) == shard_weights(h, 3, 4)
    bundled = read_header(model_path)
    layers = sum(t.nbytes for name, t in bundled.tensors.items() if name.startswith("blk."))
    assert shard_weights(bundled, 0, 30).param_bytes == shard_weights(bundled, 0, 30).active_bytes == layers


def test_model_info_reads_the_expert_counts(tmp_path: Path, tiny_pair: tuple[Path, Path]) -> None:
    dense, moe = (read_model_info(p) for p in tiny_pair)
    assert (dense.expert_count, dense.expert_used_count) == (0, 0)
    assert (moe.expert_count, moe.expert_used_count) == (4, 2)
    qwen = read_model_info(write_tiny_model(tmp_path / "q.gguf", "qwen3moe"))
    assert (qwen.expert_count, qwen.expert_used_count) == (4, 2)


def test_both_engines_report_them(tiny_pair: tuple[Path, Path], shard_cache: Path) -> None:
    from nodes.llama_engine import LlamaShardEngine
    from nodes.torch_engine import TorchShardEngine

    dense, moe = tiny_pair
    with LlamaShardEngine(moe, 1, N_LAYER, n_ctx=64, max_sessions=1, n_threads=1, measure=False) as e:
        cap = e.capability()
    want = shard_weights(read_header(moe), 1, N_LAYER)
    assert (cap.param_bytes, cap.active_param_bytes_per_token, cap.expert_count, cap.expert_used_count) == (
        want.param_bytes, want.active_bytes, 4, 2)
    assert e.active_param_bytes == want.active_bytes  # what its node_work events state for the ledger
    torch_engine = TorchShardEngine(dense, 0, 2, n_ctx=64, max_sessions=1, n_threads=1)
    try:
        cap = torch_engine.capability()
    finally:
        torch_engine.close()
    want = shard_weights(read_header(dense), 0, 2)
    assert (cap.param_bytes, cap.active_param_bytes_per_token, cap.expert_count) == (
        want.param_bytes, want.param_bytes, 0)
