"""The gateway's own view of which models the mesh can route, from announcements + heartbeats."""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass

from schemas.coverage import chains_exactly, missing_ranges, widest_chain
from schemas.node import NodeAnnouncement, NodeHeartbeat
from schemas.tracker import TrackerStatus


@dataclass(slots=True, frozen=True)
class RoutableModel:
    """One model revision (and cache ABI) with a full chain of live shards."""

    name: str
    revision: str
    cache_abi: str
    n_layer: int
    n_ctx: int  # the longest context one chain of its live nodes serves (schemas.coverage.widest_chain)
    node_ids: tuple[str, ...]
    created: int


@dataclass(slots=True)
class _Entry:
    announcement: NodeAnnouncement
    last_seen: float
    first_seen_wall: float


class MeshView:
    """Live nodes (announced, heard from within `node_timeout` s) grouped into routable models.

    Nodes re-announce only every few seconds, so a gateway that starts after them also reads
    the tracker's status snapshots: a revision it has no announcement for yet is routable when
    the latest fresh snapshot says so.
    """

    def __init__(self, node_timeout: float = 5.0, default_n_ctx: int = 0) -> None:
        self.node_timeout = node_timeout
        self.default_n_ctx = default_n_ctx
        self._nodes: dict[str, _Entry] = {}
        self._status: TrackerStatus | None = None
        self._status_at = float("-inf")
        self._n_ctx: dict[str, int] = {}  # revision -> its routes' context, as last seen routable
        self._tracker_rtt: dict[str, tuple[float, float]] = {}  # tracker id -> (its bus round trip s, seen at)

    def on_status(self, msg: TrackerStatus, now: float | None = None) -> None:
        """The tracker's periodic snapshot (nodes, coverage)."""
        self._status = msg
        self._status_at = time.monotonic() if now is None else now
        self._tracker_rtt[msg.tracker_id] = (msg.bus_rtt_ms / 1000, self._status_at)

    def tracker_rtt_s(self, now: float | None = None) -> float:
        """The longest round trip to the bus of the trackers heard from within `node_timeout`
        (their status says it): what a route ask pays on the trackers' side."""
        now = time.monotonic() if now is None else now
        for tid in [t for t, (_, at) in self._tracker_rtt.items() if now - at > self.node_timeout]:
            del self._tracker_rtt[tid]
        return max((rtt for rtt, _ in self._tracker_rtt.values()), default=0.0)

    def on_announce(self, msg: NodeAnnouncement, now: float | None = None) -> None:
        """A node (re)announced its Capability Report."""
        now = time.monotonic() if now is None else now
        old = self._nodes.get(msg.node_id)
        if msg.leaving:  # shutting down: no longer live (an older duplicate's leaving removes nothing)
            if old is not None and old.announcement.started_at == msg.started_at:
                del self._nodes[msg.node_id]
            return
        first = old.first_seen_wall if old else time.time()
        self._nodes[msg.node_id] = _Entry(msg, now, first)

    def on_heartbeat(self, msg: NodeHeartbeat, now: float | None = None) -> None:
        """A node is alive (unknown nodes wait for their announcement)."""
        entry = self._nodes.get(msg.node_id)
        if entry is not None:
            entry.last_seen = time.monotonic() if now is None else now

    def live(self, now: float | None = None) -> list[NodeAnnouncement]:
        """Announcements of nodes heard from recently, dropping the stale ones."""
        now = time.monotonic() if now is None else now
        stale = [nid for nid, e in self._nodes.items() if now - e.last_seen > self.node_timeout]
        for nid in stale:
            del self._nodes[nid]
        return [e.announcement for e in self._nodes.values()]

    def groups(self, now: float | None = None) -> dict[tuple[str, str, str, int], list[NodeAnnouncement]]:
        """Live nodes by (model name, revision, cache ABI, n_layer)."""
        out: dict[tuple[str, str, str, int], list[NodeAnnouncement]] = {}
        for a in self.live(now):
            c = a.capability
            out.setdefault((c.model_name, c.model_revision, c.cache_abi, c.layers.n_layer), []).append(a)
        return out

    def routable(self, now: float | None = None) -> list[RoutableModel]:
        """Models for which a full route exists right now."""
        out = []
        for (name, rev, abi, n_layer), nodes in sorted(self.groups(now).items()):
            ranges = [(a.capability.layers.start, a.capability.layers.end) for a in nodes]
            if not chains_exactly(ranges, n_layer):
                continue
            created = min(self._nodes[a.node_id].first_seen_wall for a in nodes)
            self._n_ctx[rev] = widest_chain(
                ((a.capability.layers.start, a.capability.layers.end, a.capability.n_ctx) for a in nodes), n_layer)
            out.append(RoutableModel(
                name=name, revision=rev, cache_abi=abi, n_layer=n_layer,
                n_ctx=self._n_ctx[rev],
                node_ids=tuple(sorted(a.node_id for a in nodes)), created=int(created),
            ))
        return out

    def find(self, revision: str, now: float | None = None) -> RoutableModel | None:
        """The routable entry of one model revision, if any."""
        now = time.monotonic() if now is None else now
        for m in self.routable(now):
            if m.revision == revision:
                return m
        if any(k[1] == revision for k in self.groups(now)):
            return None  # our own view knows this revision's nodes: it is not routable
        return self._from_status(revision, now)

    def context_of(self, revision: str, now: float | None = None) -> int:
        """The context a prompt for `revision` must fit: its routes' now, else as last seen
        routable (nodes whose heartbeats are merely late, or a gateway that stood still, do not
        make a larger context appear), else the default (the model's training context)."""
        routable = self.find(revision, now)
        if routable is not None and routable.n_ctx:
            return routable.n_ctx
        return self._n_ctx.get(revision) or self.default_n_ctx

    def _from_status(self, revision: str, now: float) -> RoutableModel | None:
        status = self._status
        if status is None or now - self._status_at > self.node_timeout:
            return None
        for cov in status.coverage:
            if cov.model_revision == revision and cov.routable:
                nodes = tuple(sorted(n.node_id for n in status.nodes if n.model == cov.model))
                return RoutableModel(
                    name=cov.model, revision=revision, cache_abi=cov.cache_abi,
                    n_layer=cov.n_layer, n_ctx=self._n_ctx.get(revision) or self.default_n_ctx, node_ids=nodes,
                    created=int(status.ts),
                )
        return None

    def other_revisions(self, names: Collection[str], revision: str, now: float | None = None) -> list[str]:
        """Revisions other than `revision` that live nodes serve under one of `names` (lower
        case): the model's other GGUFs (another quantization or conversion), which a route for
        `revision` can never use."""
        return sorted({k[1] for k in self.groups(now) if k[0].lower() in names and k[1] != revision})

    def live_models(self, now: float | None = None) -> list[str]:
        """`name (revision)` of every model live nodes serve, whether or not a route exists."""
        return sorted({f"{k[0]} ({k[1]})" for k in self.groups(now)})

    def unroutable_reason(self, revision: str, now: float | None = None) -> str:
        """Why `revision` cannot be routed: no nodes, or which layers are missing."""
        groups = [(k, v) for k, v in self.groups(now).items() if k[1] == revision]
        if not groups:
            return f"no live node serves model revision {revision}"
        parts = []
        for (_, _, abi, n_layer), nodes in groups:
            ranges = [(a.capability.layers.start, a.capability.layers.end) for a in nodes]
            gaps = missing_ranges(ranges, n_layer) or "shards do not chain"
            parts.append(f"{abi}: missing layers {gaps}")
        return "no full route: " + "; ".join(parts)
