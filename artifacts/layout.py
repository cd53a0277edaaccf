"""Shard layout: where to cut a model's layers so that every Shard costs about the same per token.

A decode row costs a hop about one multiply-add per weight it reads: every weight of its layers
(of a MoE layer only the experts a token uses), and on the tail the output head's as well. So
cutting at equal layer counts leaves the tail the route's slowest hop: on SmolLM2-135M the output
head (the tied embedding, 49152 x 576) holds as many weights as 8 of its 30 layers. Measured
(docs/benchmarks.md, "Cutting by compute"), one decode row took 7.5 ms on [0, 15) and 10.0 ms on
[15, 30); cut at 19, 9.6 and 8.4 ms. Many sessions decoding at once on hops with cores of their
own run at the pace of the slowest hop; one stream's token pays every hop's compute either way.
Weights are counted, not timed: a weight type's speed is the machine's (the Q8_0 output head
costs about 5 Q4_1 layers' time here, not 8), so the cut is close to even, not exactly even.

`shard_layout` reads the costs from the GGUF header alone; `balanced_ranges` is the pure cut.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from artifacts.gguf_header import GGUFHeader
from artifacts.shard_file import EMBEDDING, tensor_layer, token_share

OUTPUT_HEAD = "output.weight"  # absent where the output head is the tied embedding


def layer_costs(h: GGUFHeader) -> tuple[list[int], int]:
    """Weights one token's row multiplies in each layer (of stacked experts only
    expert_used_count / expert_count), and in the tail's output head (pure)."""
    n_layer = int(h.get(f"{h.get('general.architecture', 'unknown')}.block_count", 0) or 0)
    share = token_share(h)
    costs = [0] * n_layer
    for t in h.tensors.values():
        layer = tensor_layer(t.name)
        if layer is not None and 0 <= layer < n_layer:
            costs[layer] += share(t.name, math.prod(t.dims))
    head = h.tensors.get(OUTPUT_HEAD) or h.tensors.get(EMBEDDING)
    return costs, math.prod(head.dims) if head is not None else 0


def balanced_ranges(costs: Sequence[int], n_parts: int, tail_extra: int = 0) -> list[tuple[int, int]]:
    """Contiguous half-open ranges covering every layer, one per part, whose costs (the last one
    with `tail_extra`) have the smallest maximum, and among those the smallest sum of squares
    (pure). Ties go to the cut with the later parts smaller: equal costs split like 8, 8, 7, 7."""
    n = len(costs)
    if not 1 <= n_parts <= n:
        raise ValueError(f"--nodes must be between 1 and {n}")
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def part(i: int, j: int) -> int:
        return prefix[j] - prefix[i] + (tail_extra if j == n else 0)

    # two passes over cuts of layers [0, j) into p parts: the smallest possible largest part,
    # then the smallest sum of squares with no part above it (one pass over both keys at once
    # is not exact: a prefix with a smaller largest part can carry a larger sum of squares)
    largest = _cut(n, n_parts, part, lambda acc, c: max(acc, c))[0]
    _, starts = _cut(n, n_parts, part, lambda acc, c: acc + c * c if c <= largest else math.inf)
    ranges, j = [], n
    for p in range(n_parts, 0, -1):
        i = starts[p][j]
        ranges.append((i, j))
        j = i
    return ranges[::-1]


def _cut(n: int, n_parts: int, part: Callable[[int, int], int],
         add: Callable[[float, int], float]) -> tuple[float, list[list[int]]]:
    """The best value of cutting [0, n) into `n_parts` parts, folding each part's cost into the
    value with `add`, and per (parts, end) where the best last part starts (pure)."""
    best = [[math.inf] * (n + 1) for _ in range(n_parts + 1)]
    starts = [[-1] * (n + 1) for _ in range(n_parts + 1)]
    best[0][0] = 0
    for p in range(1, n_parts + 1):
        for j in range(p, n - (n_parts - p) + 1):
            for i in range(j - 1, p - 2, -1):  # the last part shortest first: ties keep it shortest
                if best[p - 1][i] == math.inf:
                    continue
                value = add(best[p - 1][i], part(i, j))
                if value < best[p][j]:
                    best[p][j], starts[p][j] = value, i
    return best[n_parts][n], starts


def shard_layout(h: GGUFHeader, n_parts: int) -> list[tuple[int, int]]:
    """The layer ranges of `n_parts` Shards of about equal compute per token (pure)."""
    costs, head = layer_costs(h)
    if not costs:
        raise ValueError(f"the model names no layers (no {h.get('general.architecture', '?')}.block_count)")
    return balanced_ranges(costs, n_parts, head)
