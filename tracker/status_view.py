"""The tracker's status snapshot for monitors (mesh.tracker.status): nodes, coverage and
sessions as the book has them, rows capped."""

from __future__ import annotations

from collections.abc import Iterable

from schemas.tracker import CoverageSummary, NodeSummary, SessionSummary, TrackerStatus
from tracker.book import MeshBook
from tracker.coverage import CoverageMap
from tracker.registry import NodeState

STATUS_ROWS = 200  # rows of nodes/sessions in a status snapshot (n_nodes/n_sessions are exact)


def tracker_status(tracker_id: str, book: MeshBook, quarantined: Iterable[str], now: float) -> TrackerStatus:
    nodes = sorted(book.registry, key=lambda s: s.node_id)
    return TrackerStatus(
        tracker_id=tracker_id,
        n_nodes=len(nodes),
        nodes=[_node_summary(s, now) for s in nodes[:STATUS_ROWS]],
        coverage=[_coverage_summary(m) for m in book.coverage()],
        n_sessions=len(book.sessions),
        quarantined=sorted(quarantined),
        sessions=[
            SessionSummary(session_id=a.session.session_id, route_id=a.session.route_id, model=a.session.model,
                           nodes=[h.node_id for h in a.session.hops], age_s=round(now - a.opened_at, 3))
            for a in list(book.sessions.values())[:STATUS_ROWS]
        ],
    )


def _node_summary(state: NodeState, now: float) -> NodeSummary:
    cap, hb = state.capability, state.heartbeat
    return NodeSummary(
        node_id=state.node_id,
        model=cap.model_name,
        model_revision=cap.model_revision,
        activation_url=state.announcement.activation_url,
        layer_start=cap.layers.start,
        layer_end=cap.layers.end,
        n_layer=cap.layers.n_layer,
        decode_tokens_per_second=(hb.decode_tokens_per_second if hb else cap.decode_tokens_per_second),
        sessions=hb.sessions if hb else 0,
        cache_bytes=hb.cache_bytes if hb else 0,
        free_session_slots=hb.free_session_slots if hb else cap.max_sessions,
        age_s=round(state.age(now), 3),
    )


def _coverage_summary(m: CoverageMap) -> CoverageSummary:
    return CoverageSummary(
        model=m.model,
        model_revision=m.model_revision,
        cache_abi=m.cache_abi,
        n_layer=m.n_layer,
        status=m.status,
        routable=m.routable,
        min_replicas=m.min_replicas,
        target_replicas=m.target,
        gaps=list(m.gaps),
        under_provisioned=list(m.under_provisioned),
    )
