"""Shard layout (artifacts/layout.py): cuts of about equal compute per token, the tail's output
head counted."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest

from artifacts.gguf_header import GGUFHeader, read_header
from artifacts.layout import balanced_ranges, layer_costs, shard_layout
from tests.fixtures.tiny_gguf import write_tiny_model


@pytest.mark.parametrize(("costs", "parts", "tail", "expected"), [
    ([1] * 30, 1, 0, [(0, 30)]),
    ([1] * 30, 2, 0, [(0, 15), (15, 30)]),
    ([1] * 30, 4, 0, [(0, 8), (8, 16), (16, 23), (23, 30)]),  # equal costs: the later parts smaller
    ([1] * 30, 2, 8, [(0, 19), (19, 30)]),  # an output head of 8 layers' weight: the tail takes fewer
    ([1] * 30, 3, 8, [(0, 13), (13, 26), (26, 30)]),
    ([1] * 30, 5, 8, [(0, 8), (8, 15), (15, 22), (22, 29), (29, 30)]),  # a tail of one layer and the head
    ([5, 1, 1, 1, 1, 1], 2, 0, [(0, 1), (1, 6)]),  # one heavy layer (a dense layer before MoE ones)
    ([1, 1, 1, 1], 4, 100, [(0, 1), (1, 2), (2, 3), (3, 4)]),  # every part gets a layer, however heavy the tail
])
def test_balanced_ranges(costs: list[int], parts: int, tail: int, expected: list[tuple[int, int]]) -> None:
    ranges = balanced_ranges(costs, parts, tail)
    assert ranges == expected
    assert ranges[0][0] == 0 and ranges[-1][1] == len(costs)
    assert all(a < b for a, b in ranges) and all(ranges[i][1] == ranges[i + 1][0] for i in range(len(ranges) - 1))


def _key(costs: list[int], tail: int, ranges: list[tuple[int, int]]) -> tuple[int, int]:
    parts = [sum(costs[a:b]) + (tail if b == len(costs) else 0) for a, b in ranges]
    return max(parts), sum(c * c for c in parts)


@pytest.mark.parametrize("seed", range(12))
def test_no_cut_has_a_smaller_largest_part_or_then_a_smaller_sum_of_squares(seed: int) -> None:
    rng = random.Random(seed)
    n, parts = rng.randint(1, 9), rng.randint(1, 5)
    parts = min(parts, n)
    costs, tail = [rng.choice([0, 1, 2, 3, 5, 8]) for _ in range(n)], rng.choice([0, 3, 7])
    every = [list(zip((0, *cuts), (*cuts, n), strict=True))
             for cuts in itertools.combinations(range(1, n), parts - 1)]
    assert _key(costs, tail, balanced_ranges(costs, parts, tail)) == min(_key(costs, tail, r) for r in every)


def test_a_smaller_largest_part_early_does_not_hide_a_smaller_sum_of_squares() -> None:
    # parts 6, 3, 2, 7 (sum of squares 98), not 1, 5, 5, 7 (100): the tail's part is the largest either way
    assert balanced_ranges([1, 5, 3, 2, 0], 4, 7) == [(0, 2), (2, 3), (3, 4), (4, 5)]


def test_more_parts_than_layers_is_refused() -> None:
    for parts in (0, 31):
        with pytest.raises(ValueError, match="between 1 and 30"):
            balanced_ranges([1] * 30, parts)


def test_a_model_without_layers_is_refused_by_name() -> None:
    header = GGUFHeader(path=Path("x.gguf"), version=3, fields={}, tensors={}, alignment=32)
    with pytest.raises(ValueError, match="block_count"):
        shard_layout(header, 2)


def test_the_bundled_models_tail_counts_its_output_head(model_path: Path) -> None:
    header = read_header(model_path)
    costs, head = layer_costs(header)
    assert len(costs) == 30 and len(set(costs)) == 1
    assert head == 49152 * 576  # the tied embedding is SmolLM2's output head: 8 layers' weight
    assert shard_layout(header, 2) == [(0, 19), (19, 30)]
    assert shard_layout(header, 1) == [(0, 30)]


def test_a_moe_layer_costs_the_experts_a_token_uses(tmp_path: Path) -> None:
    dense = layer_costs(read_header(write_tiny_model(tmp_path / "dense.gguf", "llama", n_expert=0)))[0]
    moe = layer_costs(read_header(write_tiny_model(tmp_path / "moe.gguf", "llama", n_expert=4, n_expert_used=2)))[0]
    n_embd, n_ff = 64, 96
    # two of four experts' FFNs per token, plus the router, against one dense FFN
    assert moe[0] - dense[0] == 2 * 3 * n_embd * n_ff - 3 * n_embd * n_ff + 4 * n_embd


def test_meshnet_artifact_layout_prints_each_nodes_layers(model_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from meshnet.artifact import main

    assert main(["layout", str(model_path), "--nodes", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("--layers 0:19 ") and lines[1].startswith("--layers 19:30 ")
    assert "output head" in lines[1] and "output head" not in lines[0]
    assert main(["layout", str(model_path), "--nodes", "31"]) == 2
    assert "between 1 and 30" in capsys.readouterr().err


def test_meshnet_artifact_layout_refuses_an_architecture_no_node_can_split(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """It printed `--layers` ranges for a `mamba` GGUF, which every node then refused to load."""
    from meshnet.artifact import main

    path = write_tiny_model(tmp_path / "m.gguf", "mamba")
    assert main(["layout", str(path), "--nodes", "2"]) == 2
    out = capsys.readouterr()
    assert "'mamba' has no exact layer-range support" in out.err and "--layers" not in out.out
    assert main(["layout", str(path), "--nodes", "1"]) == 0  # the whole model is no cut
