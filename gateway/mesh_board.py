"""The console's Mesh State: every node heard of (lost ones too, for a while), coverage per
model, quarantine and recent validation verdicts, as one typed JSON document (GET /v1/mesh).

It holds only what a monitor on `mesh.>` sees: announcements, heartbeats, the tracker's status
and verdict events; the gateway adds its queue depth and its live sessions' telemetry.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, Field

from schemas.artifacts import ArtifactProgress
from schemas.audit import ValidationVerdict
from schemas.coverage import CoverageStatus, coverage_status, gap_runs, replica_counts, thin_runs
from schemas.node import NodeAnnouncement, NodeHeartbeat
from schemas.telemetry import GenerationTelemetry
from schemas.tracker import TrackerStatus

NodeState = Literal["loading", "fetching", "serving", "spare", "straggler", "late", "quarantined", "lost", "left"]
HEARTBEAT_S = 1.0  # a node's heartbeat interval (nodes/server/runtime.py)
LATE_AFTER = 2.5  # heartbeats missed before a node shows as late
STRAGGLER_RATIO = 0.5  # slower decode than this x its range's median: the tracker's default rule
MAX_VERDICTS = 20


class FetchProgress(BaseModel):
    """A node's fetch of the pieces of a layer range (a spare loading what the tracker asked)."""

    layer_start: int
    layer_end: int
    state: str
    pieces_done: int
    pieces_total: int
    bytes_done: int
    bytes_total: int
    rate_mb_s: float = 0.0
    eta_s: float | None = None


class NodeCard(BaseModel):
    """One node as the console draws it."""

    node_id: str
    model: str
    model_revision: str
    layer_start: int
    layer_end: int
    n_layer: int
    state: NodeState
    spare: bool = False
    decode_tokens_per_second: float = 0.0
    prefill_tokens_per_second: float = 0.0
    rtt_ms: float | None = None  # the smallest round trip a node that sends to it measured (inbound_rtts)
    load: float = 0.0
    sessions: int = 0
    max_sessions: int = 1
    free_session_slots: int = 0
    cache_bytes: int = 0
    kv_capacity_bytes: int = 0  # n_ctx x cache bytes per token: the KV its context can hold
    last_heartbeat: float | None = None  # wall-clock time of the last heartbeat (None: none yet)
    age_s: float = 0.0  # seconds since the node was last heard from
    fetch: FetchProgress | None = None  # its latest artifact fetch, while fetching or failed


class CoverageRow(BaseModel):
    """One model revision's Coverage Map: live replicas per layer, gaps, under-provisioning."""

    model: str
    model_revision: str
    n_layer: int
    status: CoverageStatus
    replicas: list[int]  # live (not lost) nodes serving each layer
    gaps: list[tuple[int, int]] = Field(default_factory=list)
    under_provisioned: list[tuple[int, int]] = Field(default_factory=list)


class SessionRow(BaseModel):
    """A live session this gateway drives."""

    session_id: str
    phase: str
    queue_position: int | None = None
    generated_tokens: int = 0
    rolling_tokens_per_second: float = 0.0
    route_nodes: list[str] = Field(default_factory=list)
    route_policy: str = "public"
    restarts: int = 0
    moves: int = 0


class VerdictRow(BaseModel):
    """A recent validation verdict (no digests or evidence keys)."""

    ts: float
    model: str
    outcome: str
    implicated: list[str] = Field(default_factory=list)
    cleared: list[str] = Field(default_factory=list)
    reason: str = ""


class MeshState(BaseModel):
    """GET /v1/mesh and each `mesh` event of GET /v1/mesh/events."""

    ts: float
    node_timeout: float
    queue_depth: int
    active_sessions: int
    max_sessions: int
    tracker_seen: bool  # a tracker status arrived within node_timeout
    nodes: list[NodeCard]
    coverage: list[CoverageRow]
    sessions: list[SessionRow]
    quarantined: list[str]
    verdicts: list[VerdictRow]


def node_state(age_s: float, *, heard: bool, spare: bool, quarantined: bool, node_timeout: float,
               fetching: bool = False, straggler: bool = False, left: bool = False) -> NodeState:
    """What colour a node is (pure): left when its process said it was shutting down, lost past
    its expiry, else quarantined, fetching pieces, loading before its first heartbeat, late after
    missed heartbeats, a straggler, spare, else serving."""
    if left:
        return "left"
    if age_s > node_timeout:
        return "lost"
    if quarantined:
        return "quarantined"
    if fetching:
        return "fetching"
    if not heard:
        return "loading"
    if age_s > LATE_AFTER * HEARTBEAT_S:
        return "late"
    if straggler:
        return "straggler"
    return "spare" if spare else "serving"


def stragglers(speeds: dict[str, tuple[tuple[str, int, int], float]]) -> set[str]:
    """Nodes whose measured decode tok/s is below STRAGGLER_RATIO x the median of the nodes
    serving the same (revision, range) (pure); unmeasured nodes (0) are never stragglers."""
    by_range: dict[tuple[str, int, int], list[float]] = {}
    for key, tps in speeds.values():
        if tps > 0:
            by_range.setdefault(key, []).append(tps)
    out = set()
    for node_id, (key, tps) in speeds.items():
        peers = sorted(by_range.get(key, []))
        if tps > 0 and len(peers) > 1 and tps < STRAGGLER_RATIO * peers[len(peers) // 2]:
            out.add(node_id)
    return out


def coverage_row(model: str, revision: str, n_layer: int, ranges: list[tuple[int, int]],
                 target_replicas: int = 1) -> CoverageRow:
    """The coverage of one model revision from its live nodes' ranges (pure)."""
    replicas = replica_counts(ranges, n_layer)
    gaps = gap_runs(replicas)
    under = thin_runs(replicas, target_replicas)
    return CoverageRow(model=model, model_revision=revision, n_layer=n_layer,
                       status=coverage_status(gaps, under),
                       replicas=replicas, gaps=gaps, under_provisioned=under)


@dataclass(slots=True)
class _Seen:
    announcement: NodeAnnouncement
    last_seen: float  # monotonic
    heartbeat: NodeHeartbeat | None = None
    heartbeat_wall: float | None = None
    fetch: ArtifactProgress | None = None
    left: bool = False  # its process announced it was leaving the mesh (a clean stop, not a crash)


def inbound_rtts(reports: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """Each node's smallest round trip as measured by the nodes that send to it (pure), from
    their heartbeats' `peer_rtt_ms`."""
    out: dict[str, float] = {}
    for report in reports:
        for node_id, ms in report.items():
            out[node_id] = min(ms, out.get(node_id, ms))
    return out


class MeshBoard:
    """Nodes, tracker status and verdicts as heard on the bus; `changed` wakes SSE followers."""

    def __init__(self, node_timeout: float = 5.0, forget_after: float = 600.0) -> None:
        self.node_timeout = node_timeout
        self.forget_after = forget_after  # a lost node leaves the board after this long
        self._nodes: dict[str, _Seen] = {}
        self._status: TrackerStatus | None = None
        self._status_at = float("-inf")
        self._verdicts: deque[VerdictRow] = deque(maxlen=MAX_VERDICTS)
        self.changed = asyncio.Event()

    def _signal(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()

    def on_announce(self, msg: NodeAnnouncement, now: float | None = None) -> None:
        """A node (re)announced: a new process starts over as loading until it heartbeats."""
        now = time.monotonic() if now is None else now
        old = self._nodes.get(msg.node_id)
        same = old is not None and old.announcement.started_at == msg.started_at
        if msg.leaving:  # a clean stop: the node stays on the board as left (an older duplicate's says nothing)
            if old is not None and same:
                old.left = True
                self._signal()
            return
        self._nodes[msg.node_id] = _Seen(msg, now, old.heartbeat if same else None,
                                         old.heartbeat_wall if same else None)
        self._signal()

    def on_heartbeat(self, msg: NodeHeartbeat, now: float | None = None) -> None:
        """A node is alive (unknown nodes wait for their announcement)."""
        seen = self._nodes.get(msg.node_id)
        if seen is not None and not seen.left:  # a leaving process's last beats keep nothing alive
            seen.last_seen = time.monotonic() if now is None else now
            seen.heartbeat, seen.heartbeat_wall = msg, time.time()
            self._signal()

    def on_status(self, msg: TrackerStatus, now: float | None = None) -> None:
        """The tracker's periodic snapshot (coverage targets, quarantine)."""
        self._status = msg
        self._status_at = time.monotonic() if now is None else now
        self._signal()

    def on_progress(self, msg: ArtifactProgress) -> None:
        """A node's fetch progress (nodes not announced yet wait for their announcement)."""
        seen = self._nodes.get(msg.node_id)
        if seen is not None:
            seen.fetch = None if msg.state == "done" else msg
            self._signal()

    def on_verdict(self, msg: ValidationVerdict) -> None:
        """A validator judged a sampled session."""
        self._verdicts.appendleft(VerdictRow(
            ts=msg.ts, model=msg.model, outcome=str(msg.outcome), implicated=msg.implicated,
            cleared=msg.cleared, reason=msg.reason))
        self._signal()

    def state(self, *, queue_depth: int, active: int, max_sessions: int,
              sessions: list[GenerationTelemetry], now: float | None = None) -> MeshState:
        """The whole Mesh State now."""
        now = time.monotonic() if now is None else now
        for nid in [n for n, s in self._nodes.items() if now - s.last_seen > self.forget_after]:
            del self._nodes[nid]
        status = self._status if now - self._status_at <= self.node_timeout else None
        quarantined = set(status.quarantined) if status else set()
        slow = stragglers({nid: ((s.announcement.capability.model_revision, s.announcement.capability.layers.start,
                                  s.announcement.capability.layers.end),
                                 s.heartbeat.decode_tokens_per_second if s.heartbeat else 0.0)
                           for nid, s in self._nodes.items() if now - s.last_seen <= self.node_timeout})
        into = inbound_rtts(s.heartbeat.peer_rtt_ms for s in self._nodes.values() if s.heartbeat is not None)
        cards = [self._card(s, now, s.announcement.node_id in quarantined, s.announcement.node_id in slow,
                            into.get(s.announcement.node_id))
                 for s in sorted(self._nodes.values(), key=lambda s: (
                     s.announcement.capability.layers.start, s.announcement.node_id))]
        return MeshState(
            ts=time.time(), node_timeout=self.node_timeout, queue_depth=queue_depth,
            active_sessions=active, max_sessions=max_sessions, tracker_seen=status is not None,
            nodes=cards, coverage=self._coverage(cards, status), quarantined=sorted(quarantined),
            sessions=[SessionRow(
                session_id=t.session_id, phase=str(t.phase), queue_position=t.queue_position,
                generated_tokens=t.generated_tokens, rolling_tokens_per_second=t.rolling_tokens_per_second,
                route_nodes=t.route_nodes, route_policy=t.route_policy, restarts=t.restarts, moves=t.moves,
            ) for t in sessions],
            verdicts=list(self._verdicts),
        )

    def _card(self, seen: _Seen, now: float, quarantined: bool, straggler: bool, rtt: float | None) -> NodeCard:
        a, hb = seen.announcement, seen.heartbeat
        cap = a.capability
        age = now - seen.last_seen
        return NodeCard(
            node_id=a.node_id, model=cap.model_name, model_revision=cap.model_revision,
            layer_start=cap.layers.start, layer_end=cap.layers.end, n_layer=cap.layers.n_layer,
            state=node_state(age, heard=hb is not None, spare=a.spare, quarantined=quarantined,
                             node_timeout=self.node_timeout, straggler=straggler,
                             fetching=seen.fetch is not None and seen.fetch.state == "fetching",
                             left=seen.left),
            spare=a.spare, rtt_ms=rtt, max_sessions=cap.max_sessions,
            kv_capacity_bytes=cap.n_ctx * cap.cache_bytes_per_token, last_heartbeat=seen.heartbeat_wall, age_s=round(age, 2),
            fetch=None if seen.fetch is None else FetchProgress(**seen.fetch.model_dump(include=set(
                FetchProgress.model_fields))),
            **({} if hb is None else {
                "decode_tokens_per_second": hb.decode_tokens_per_second,
                "prefill_tokens_per_second": hb.prefill_tokens_per_second, "load": hb.load,
                "sessions": hb.sessions, "free_session_slots": hb.free_session_slots,
                "cache_bytes": hb.cache_bytes}),
        )

    @staticmethod
    def _coverage(cards: list[NodeCard], status: TrackerStatus | None) -> list[CoverageRow]:
        groups: dict[tuple[str, str, int], list[tuple[int, int]]] = {}
        for c in cards:
            ranges = groups.setdefault((c.model, c.model_revision, c.n_layer), [])
            if c.state not in ("lost", "left", "quarantined", "fetching") and c.layer_end > c.layer_start:
                ranges.append((c.layer_start, c.layer_end))
        targets = {cov.model_revision: cov.target_replicas for cov in status.coverage} if status else {}
        return [coverage_row(model, rev, n_layer, ranges, targets.get(rev, 1))
                for (model, rev, n_layer), ranges in sorted(groups.items())]
