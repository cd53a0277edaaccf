"""Coverage Map: per model revision, which layers have how many healthy replicas.

A *gap* is a layer range no live node serves; *under-provisioned* is a range served by fewer
than `target` replicas. `routable` says whether shards chain exactly from 0 to n_layer
(overlapping shards that never meet at a boundary cover layers but do not make a route).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from tracker.views import NodeView

CoverageStatus = Literal["covered", "under_provisioned", "gap"]


@dataclass(frozen=True, slots=True)
class CoverageMap:
    """Coverage of one (model revision, cache ABI) group."""

    model: str
    model_revision: str
    cache_abi: str
    n_layer: int
    target: int
    replicas: tuple[int, ...]  # healthy replicas per layer
    gaps: tuple[tuple[int, int], ...]
    under_provisioned: tuple[tuple[int, int], ...]
    routable: bool
    shards: tuple[tuple[int, int, int], ...]  # (start, end, replicas) per distinct shard range

    @property
    def status(self) -> CoverageStatus:
        """gap if any layer has no replica, else under_provisioned if any is below target."""
        if self.gaps:
            return "gap"
        if self.under_provisioned:
            return "under_provisioned"
        return "covered"

    @property
    def min_replicas(self) -> int:
        return min(self.replicas) if self.replicas else 0


def layer_runs(values: Sequence[int], keep: callable) -> list[tuple[int, int]]:  # type: ignore[valid-type]
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


def chains_exactly(ranges: Iterable[tuple[int, int]], n_layer: int) -> bool:
    """True if some sequence of ranges meets exactly at boundaries from 0 to n_layer."""
    return furthest_boundary(ranges, n_layer) == n_layer


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


def coverage_for_group(nodes: Sequence[NodeView], target: int = 1) -> CoverageMap:
    """Coverage Map of nodes that all share one (model_revision, cache_abi)."""
    first = nodes[0]
    n_layer = first.n_layer
    replicas = [0] * n_layer
    shard_counts: dict[tuple[int, int], int] = defaultdict(int)
    for node in nodes:
        shard_counts[(node.start, node.end)] += 1
        for layer in range(node.start, min(node.end, n_layer)):
            replicas[layer] += 1
    return CoverageMap(
        model=first.model,
        model_revision=first.model_revision,
        cache_abi=first.cache_abi,
        n_layer=n_layer,
        target=target,
        replicas=tuple(replicas),
        gaps=tuple(layer_runs(replicas, lambda c: c == 0)),
        under_provisioned=tuple(layer_runs(replicas, lambda c: 0 < c < target)),
        routable=chains_exactly(shard_counts, n_layer),
        shards=tuple((s, e, c) for (s, e), c in sorted(shard_counts.items())),
    )


def empty_coverage(model: str, model_revision: str, cache_abi: str, n_layer: int, target: int = 1) -> CoverageMap:
    """The Coverage Map of a model no node serves yet (a spare offered it): one gap, everything."""
    return CoverageMap(model=model, model_revision=model_revision, cache_abi=cache_abi, n_layer=n_layer,
                       target=target, replicas=(0,) * n_layer, gaps=((0, n_layer),), under_provisioned=(),
                       routable=False, shards=())


def coverage_maps(nodes: Iterable[NodeView], target: int = 1,
                  offered: Iterable[tuple[str, str, str, int]] = ()) -> list[CoverageMap]:
    """One Coverage Map per (model revision, cache ABI), ordered by model then revision.
    `offered` (model, revision, cache ABI, n_layer), from spares, adds an all-gap map for a
    model no node serves yet."""
    groups: dict[tuple[str, str], list[NodeView]] = defaultdict(list)
    for node in nodes:
        groups[node.group].append(node)
    maps = [coverage_for_group(members, target) for members in groups.values()]
    for model, rev, abi, n_layer in set(offered):
        if (rev, abi) not in groups:
            maps.append(empty_coverage(model, rev, abi, n_layer, target))
    return sorted(maps, key=lambda m: (m.model, m.model_revision, m.cache_abi))
