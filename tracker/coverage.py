"""Coverage Map: per model revision, which layers have how many healthy replicas.

A *gap* is a layer range no live node serves; *under-provisioned* is a range served by fewer
than `target` replicas. `routable` says whether shards chain exactly from 0 to n_layer
(overlapping shards that never meet at a boundary cover layers but do not make a route).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from schemas.coverage import (
    CoverageStatus,
    chains_exactly,
    coverage_status,
    gap_runs,
    replica_counts,
    thin_runs,
)
from tracker.views import NodeView


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
        return coverage_status(self.gaps, self.under_provisioned)

    @property
    def min_replicas(self) -> int:
        return min(self.replicas) if self.replicas else 0


def coverage_for_group(nodes: Sequence[NodeView], target: int = 1) -> CoverageMap:
    """Coverage Map of nodes that all share one (model_revision, cache_abi)."""
    first = nodes[0]
    n_layer = first.n_layer
    replicas = replica_counts(((node.start, node.end) for node in nodes), n_layer)
    shard_counts: dict[tuple[int, int], int] = defaultdict(int)
    for node in nodes:
        shard_counts[(node.start, node.end)] += 1
    return CoverageMap(
        model=first.model,
        model_revision=first.model_revision,
        cache_abi=first.cache_abi,
        n_layer=n_layer,
        target=target,
        replicas=tuple(replicas),
        gaps=tuple(gap_runs(replicas)),
        under_provisioned=tuple(thin_runs(replicas, target)),
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
