"""Rebalance planning: ask spare or redundant nodes to load gaps and under-provisioned shards."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from tracker.coverage import CoverageMap
from tracker.views import NodeView, SpareView


@dataclass(frozen=True, slots=True)
class RebalanceNeed:
    """A shard range of one group that should get one more replica."""

    model: str
    model_revision: str
    cache_abi: str
    n_layer: int
    start: int
    end: int
    reason: str
    gap: bool = False  # no node serves these layers (else: a range with too few replicas)

    @property
    def key(self) -> tuple[str, str, int, int]:
        return (self.model_revision, self.cache_abi, self.start, self.end)

    def halves(self) -> list[RebalanceNeed]:
        """A gap cut in two, for nodes that cannot hold it whole (pure)."""
        mid = (self.start + self.end) // 2
        return [RebalanceNeed(self.model, self.model_revision, self.cache_abi, self.n_layer, a, b,
                              f"{self.reason}: part [{a},{b}) (no node could take it whole)", gap=True)
                for a, b in ((self.start, mid), (mid, self.end))]


@dataclass(frozen=True, slots=True)
class RebalanceOrder:
    """Node `node_id` should load `need` (a spare fetches the pieces of `artifact_id`)."""

    node_id: str
    need: RebalanceNeed
    artifact_id: str | None = None


def needs_of(cov: CoverageMap) -> list[RebalanceNeed]:
    """Ranges to add: each gap as a whole, and each existing shard range that lies on an
    under-provisioned layer while it has fewer than target replicas itself (copying an existing
    range keeps the new replica chainable with its neighbours)."""
    needs: list[RebalanceNeed] = []
    base = (cov.model, cov.model_revision, cov.cache_abi, cov.n_layer)
    for a, b in cov.gaps:
        needs.append(RebalanceNeed(*base, a, b, f"gap: no node serves layers [{a},{b}) of {cov.model}", gap=True))
    for a, b in cov.under_provisioned:
        for start, end, count in cov.shards:
            if start < b and end > a and count < cov.target:
                needs.append(
                    RebalanceNeed(
                        *base,
                        start,
                        end,
                        f"under-provisioned: layers [{start},{end}) of {cov.model} have "
                        f"{count}/{cov.target} replicas",
                    )
                )
    unique = {n.key: n for n in needs}
    return [unique[k] for k in sorted(unique)]


def _donor_rank(v: NodeView) -> tuple[float, float, str]:
    return (v.sessions, v.load, v.node_id)


def plan_rebalance(
    nodes: Sequence[NodeView],
    maps: Iterable[CoverageMap],
    *,
    busy_nodes: Collection[str] = (),
    pending: Collection[tuple[str, str, int, int]] = (),
    spares: Sequence[SpareView] = (),
    refused: Collection[tuple[str, tuple[str, str, int, int]]] = (),
    too_large: Collection[tuple[str, tuple[str, str, int, int]]] | None = None,
) -> list[RebalanceOrder]:
    """At most one order per need and per donor. Donors: spare nodes that serve nothing yet
    (of the same revision and cache ABI) first, then serving nodes marked spare, then nodes
    whose own shard has more replicas than the target (it stays covered after they leave).
    Nodes in `busy_nodes`, needs in `pending` (already ordered) and (node, need) pairs in
    `refused` (the node said it cannot) are skipped. A gap every node asked refused, two or more
    of them (too large for each, say), is cut in halves, each planned as a need of its own: two
    spares then fill the gap two lost nodes left. A gap only one node refused is not cut: that
    node would take a fragment a larger spare joining later could have served with the rest.
    `too_large` (default: `refused`) are the refusals that count for cutting: for memory or
    disk, not an order that failed for want of seeders, which a smaller range would not cure."""
    maps = list(maps)
    shard_count: dict[tuple[str, str, int, int], int] = defaultdict(int)
    for v in nodes:
        shard_count[(v.model_revision, v.cache_abi, v.start, v.end)] += 1
    target_of = {(m.model_revision, m.cache_abi): m.target for m in maps}
    used: set[str] = set(busy_nodes)
    orders: list[RebalanceOrder] = []
    refusers: dict[tuple[str, str, int, int], set[str]] = defaultdict(set)
    for node, key in (refused if too_large is None else too_large):  # refusals a smaller range would meet
        refusers[key].add(node)
    for cov in maps:
        queue = needs_of(cov)
        while queue:
            need = queue.pop(0)
            if need.key in pending:
                continue
            idle = sorted((sp for sp in spares if sp.group == (need.model_revision, need.cache_abi)
                           and sp.node_id not in used and (sp.node_id, need.key) not in refused),
                          key=lambda sp: sp.node_id)
            if idle:
                used.add(idle[0].node_id)
                orders.append(RebalanceOrder(idle[0].node_id, need, idle[0].artifact_id))
                continue
            candidates = [v for v in nodes if (v.node_id, need.key) not in refused]
            donor = _pick_donor(candidates, need, used, shard_count, target_of)
            if donor is None:
                if need.gap and need.end - need.start > 1 and len(refusers.get(need.key, ())) >= 2:
                    queue[:0] = need.halves()  # nobody left to ask for it whole, and two to share it
                continue
            used.add(donor.node_id)
            shard_count[(donor.model_revision, donor.cache_abi, donor.start, donor.end)] -= 1
            orders.append(RebalanceOrder(donor.node_id, need))
    return orders


def _pick_donor(
    nodes: Sequence[NodeView],
    need: RebalanceNeed,
    used: set[str],
    shard_count: dict[tuple[str, str, int, int], int],
    target_of: dict[tuple[str, str], int],
) -> NodeView | None:
    same_model = [v for v in nodes if v.model == need.model and v.node_id not in used]
    spares = sorted((v for v in same_model if v.spare), key=_donor_rank)
    if spares:
        return spares[0]

    def redundant(v: NodeView) -> bool:
        own = (v.model_revision, v.cache_abi, v.start, v.end)
        if own[2:] == (need.start, need.end) and own[:2] == (need.model_revision, need.cache_abi):
            return False  # already serves exactly what is needed
        return shard_count[own] > target_of.get(own[:2], 1)

    donors = sorted((v for v in same_model if redundant(v)), key=_donor_rank)
    return donors[0] if donors else None
