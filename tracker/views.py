"""NodeView: the plain data routing and coverage decide on (no pydantic, no I/O)."""

from __future__ import annotations

from dataclasses import dataclass

from tracker.registry import NodeState


@dataclass(frozen=True, slots=True)
class NodeView:
    """One live node serving one Shard, with its latest measured figures."""

    node_id: str
    activation_url: str
    model: str
    model_revision: str
    cache_abi: str
    start: int
    end: int
    n_layer: int
    hidden_size: int = 0
    n_ctx: int = 0
    decode_tps: float = 0.0  # measured decode tok/s for this shard; 0 = unknown
    prefill_tps: float = 0.0
    load: float = 0.0
    queue_depth: int = 0
    latency_ms: float = 0.0
    free_slots: int = 1
    max_sessions: int = 1
    sessions: int = 0
    cache_bytes: int = 0
    spare: bool = False

    @property
    def group(self) -> tuple[str, str]:
        """Routes never mix these: (model_revision, cache_abi)."""
        return (self.model_revision, self.cache_abi)


def node_view(state: NodeState, active_sessions: int = 0) -> NodeView:
    """Flatten a registry entry; free slots are the tighter of the node's and the tracker's count."""
    cap = state.capability
    hb = state.heartbeat
    by_tracker = max(0, cap.max_sessions - active_sessions)
    free = min(hb.free_session_slots, by_tracker) if hb is not None else by_tracker
    return NodeView(
        node_id=state.node_id,
        activation_url=state.announcement.activation_url,
        model=cap.model_name,
        model_revision=cap.model_revision,
        cache_abi=cap.cache_abi,
        start=cap.layers.start,
        end=cap.layers.end,
        n_layer=cap.layers.n_layer,
        hidden_size=cap.hidden_size,
        n_ctx=cap.n_ctx,
        decode_tps=(hb.decode_tokens_per_second if hb and hb.decode_tokens_per_second else 0.0)
        or cap.decode_tokens_per_second,
        prefill_tps=(hb.prefill_tokens_per_second if hb and hb.prefill_tokens_per_second else 0.0)
        or cap.prefill_tokens_per_second,
        load=hb.load if hb else 0.0,
        queue_depth=hb.queue_depth if hb else 0,
        latency_ms=hb.latency_ms if hb else 0.0,
        free_slots=free,
        max_sessions=cap.max_sessions,
        sessions=hb.sessions if hb else active_sessions,
        cache_bytes=hb.cache_bytes if hb else 0,
        spare=state.announcement.spare,
    )
