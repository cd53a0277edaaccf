"""Layer coverage arithmetic that the tracker and the gateway share (pure).

Shards are half-open layer ranges [start, end). A layer's *replicas* are the shards that hold
it; a *gap* is a run of layers no shard holds; shards *chain* when some sequence of them meets
exactly at boundaries from 0 to n_layer (overlapping shards that never meet at a boundary hold
every layer but make no route).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from typing import Literal

CoverageStatus = Literal["covered", "under_provisioned", "gap"]


def replica_counts(ranges: Iterable[tuple[int, int]], n_layer: int) -> list[int]:
    """How many of `ranges` hold each layer of [0, n_layer) (a range listed twice counts twice)."""
    replicas = [0] * n_layer
    for start, end in ranges:
        for layer in range(max(start, 0), min(end, n_layer)):
            replicas[layer] += 1
    return replicas


def layer_runs(values: Sequence[int], keep: Callable[[int], bool]) -> list[tuple[int, int]]:
    """Maximal half-open runs [a, b) of indices whose value satisfies keep(value)."""
    runs: list[tuple[int, int]] = []
    start: int | None = None
    for i, v in enumerate(values):
        if keep(v):
            if start is None:
                start = i
        elif start is not None:
            runs.append((start, i))
            start = None
    if start is not None:
        runs.append((start, len(values)))
    return runs


def gap_runs(replicas: Sequence[int]) -> list[tuple[int, int]]:
    """Runs of layers with no replica."""
    return layer_runs(replicas, lambda c: c == 0)


def thin_runs(replicas: Sequence[int], target: int) -> list[tuple[int, int]]:
    """Runs of layers held by at least one replica but fewer than `target`."""
    return layer_runs(replicas, lambda c: 0 < c < target)


def missing_ranges(ranges: Iterable[tuple[int, int]], n_layer: int) -> list[tuple[int, int]]:
    """Layer ranges of [0, n_layer) that no range holds (gaps)."""
    return gap_runs(replica_counts(ranges, n_layer))


def furthest_boundary(ranges: Iterable[tuple[int, int]], n_layer: int) -> int:
    """The highest layer boundary reachable from 0 by chaining ranges exactly."""
    by_start: dict[int, list[int]] = defaultdict(list)
    for start, end in ranges:
        by_start[start].append(end)
    reached = {0}
    best = 0
    for start in sorted(by_start):
        if start in reached:
            for end in by_start[start]:
                reached.add(end)
                best = max(best, min(end, n_layer))
    return best


def chains_exactly(ranges: Iterable[tuple[int, int]], n_layer: int) -> bool:
    """True if some sequence of ranges meets exactly at boundaries from 0 to n_layer."""
    return furthest_boundary(ranges, n_layer) == n_layer


def widest_chain(spans: Iterable[tuple[int, int, int]], n_layer: int) -> int:
    """The largest w for which ranges `(start, end, value)` of value >= w chain exactly from 0 to
    n_layer (0 when none chains): a mesh's longest context, each node's `value` its n_ctx."""
    best: dict[int, float] = {0: float("inf")}
    for start, end, value in sorted(spans):
        if start in best:
            best[end] = max(best.get(end, 0), min(best[start], value))
    widest = best.get(n_layer, 0)
    return 0 if widest == float("inf") else int(widest)


def coverage_status(gaps: Sequence[tuple[int, int]], thin: Sequence[tuple[int, int]]) -> CoverageStatus:
    """gap if any layer has no replica, else under_provisioned if any is below target."""
    if gaps:
        return "gap"
    return "under_provisioned" if thin else "covered"
