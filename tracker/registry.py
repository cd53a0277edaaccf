"""Node registry: pure state built from announcements and heartbeats; time is passed in."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit

from schemas.capability import CapabilityReport
from schemas.node import NodeAnnouncement, NodeHeartbeat


@dataclass(frozen=True, slots=True)
class RegistryConfig:
    """Liveness: nodes heartbeat every `heartbeat_interval` s and expire after `expire_after` s."""

    heartbeat_interval: float = 1.0
    expire_after: float = 3.0


@dataclass(slots=True)
class NodeState:
    """What the tracker knows about one live node."""

    announcement: NodeAnnouncement
    announced_at: float  # tracker clock
    last_seen: float  # tracker clock of the last announcement or heartbeat
    heartbeat: NodeHeartbeat | None = None

    @property
    def node_id(self) -> str:
        return self.announcement.node_id

    @property
    def capability(self) -> CapabilityReport:
        return self.announcement.capability

    def age(self, now: float) -> float:
        """Seconds since the node was last heard from."""
        return now - self.last_seen


AnnounceResult = Literal["new", "changed", "refreshed", "refused"]


class Registry:
    """Live nodes by id. `version` bumps on joins, leaves and capability changes."""

    def __init__(self, config: RegistryConfig | None = None) -> None:
        self.config = config or RegistryConfig()
        self.version = 0
        self.metrics_version = 0
        self._nodes: dict[str, NodeState] = {}

    def __len__(self) -> int:
        return len(self._nodes)

    def __iter__(self) -> Iterator[NodeState]:
        return iter(self._nodes.values())

    def __contains__(self, node_id: object) -> bool:
        return node_id in self._nodes

    def get(self, node_id: str) -> NodeState | None:
        """The node's state, or None if unknown/expired."""
        return self._nodes.get(node_id)

    def announce(self, ann: NodeAnnouncement, now: float) -> AnnounceResult:
        """Record an announcement: a new node, a changed one (capability/url, or a restarted
        process), a refresh, or refused: a process that started before the registered one, so
        a second live process with the same id (a restart never starts in the past). The
        newest keeps the id; the other is heard again once the registered one expires."""
        state = self._nodes.get(ann.node_id)
        if state is None:
            self._nodes[ann.node_id] = NodeState(ann, announced_at=now, last_seen=now)
            self.version += 1
            return "new"
        old = state.announcement
        if ann.started_at < old.started_at:
            return "refused"
        changed = (
            old.capability != ann.capability
            or old.activation_url != ann.activation_url
            or old.started_at != ann.started_at
            or old.spare != ann.spare
        )
        state.announcement = ann
        state.last_seen = now
        if changed:
            state.announced_at = now
            state.heartbeat = None  # metrics of the previous incarnation no longer apply
            self.version += 1
            return "changed"
        return "refreshed"

    def leave(self, node_id: str, started_at: float) -> NodeState | None:
        """A node's process says it is shutting down: removed now when it is the registered
        process (a leaving message of an older duplicate removes nothing). Its state, or None."""
        state = self._nodes.get(node_id)
        if state is None or not self.same_process(node_id, started_at):
            return None
        del self._nodes[node_id]
        self.version += 1
        return state

    def heartbeat(self, hb: NodeHeartbeat, now: float) -> bool:
        """Record a heartbeat; False when the node is unknown (it must announce first) or the
        heartbeat names another process than the registered one (it keeps nothing alive)."""
        state = self._nodes.get(hb.node_id)
        if state is None or not self.same_process(hb.node_id, hb.started_at):
            return False
        state.heartbeat = hb
        state.last_seen = now
        self.metrics_version += 1
        return True

    def same_process(self, node_id: str, started_at: float) -> bool:
        """A message from the registered process of `node_id`, or one too old to say which (0)."""
        state = self._nodes.get(node_id)
        return state is None or not started_at or started_at == state.announcement.started_at

    def older_process(self, node_id: str, started_at: float) -> bool:
        """A message from a process that started before the registered one (a duplicate id)."""
        state = self._nodes.get(node_id)
        return state is not None and 0 < started_at < state.announcement.started_at

    def siblings(self, node_id: str) -> list[str]:
        """The other nodes served by the same process as `node_id` (a composite node's shards),
        which share its fate: the same announced process id and the same host. The host check
        keeps a node from tying itself to another machine's node by naming its process id."""
        state = self._nodes.get(node_id)
        if state is None or not state.announcement.process_id:
            return []
        ann = state.announcement
        host = urlsplit(ann.activation_url).hostname
        return sorted(s.node_id for s in self._nodes.values() if s.node_id != node_id
                      and s.announcement.process_id == ann.process_id
                      and urlsplit(s.announcement.activation_url).hostname == host)

    def expired(self, now: float) -> list[NodeState]:
        """Nodes not heard from for longer than expire_after (not removed)."""
        limit = self.config.expire_after
        return [s for s in self._nodes.values() if now - s.last_seen > limit]

    def expire(self, now: float) -> list[NodeState]:
        """Remove and return every expired node, in node_id order."""
        gone = sorted(self.expired(now), key=lambda s: s.node_id)
        for state in gone:
            del self._nodes[state.node_id]
        if gone:
            self.version += 1
        return gone

    def excuse(self, until: float) -> None:
        """Count every node as heard from at `until`: the tracker could hear nobody before
        then (its own bus was down), so their silence so far says nothing about them."""
        for state in self._nodes.values():
            state.last_seen = max(state.last_seen, until)

    def remove(self, node_id: str) -> NodeState | None:
        """Forget a node now (e.g. it said goodbye)."""
        state = self._nodes.pop(node_id, None)
        if state is not None:
            self.version += 1
        return state

