"""NodeView: the plain data routing and coverage decide on (no pydantic, no I/O)."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field

from schemas.protocol import PROTOCOL
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
    # decode_tps comes from serving (heartbeats), not only from the node's self-measurement at
    # load, which may have run beside another process's work: only a served figure makes a
    # straggler (tracker/routing.py), else a replica started during a busy spell got no route
    # ever again, and so never measured itself while serving
    speed_served: bool = True
    prefill_tps: float = 0.0
    load: float = 0.0
    queue_depth: int = 0
    # measured round trips (ms) from this node to the nodes after it (its heartbeat's)
    peer_rtt_ms: Mapping[str, float] = field(default_factory=dict)
    free_slots: int = 1
    max_sessions: int = 1
    sessions: int = 0
    cache_bytes: int = 0
    spare: bool = False
    # weight bytes one token reads through this shard (Capability Report); 0 = not reported.
    # The cost of a hop nobody has measured yet comes from it (tracker/routing.py)
    active_bytes: int = 0
    kv_profile: str = "default"  # the Capability Report's; routes may mix profiles (each hop's KV is its own)
    # the mesh protocol its code reads (its announcement's, schemas/protocol.py): a request
    # that needs a newer one is not routed through it
    protocol: int = PROTOCOL
    window: int = 1  # the credit window its new sessions grant (its announcement's)

    @property
    def group(self) -> tuple[str, str]:
        """Routes never mix these: (model_revision, cache_abi)."""
        return (self.model_revision, self.cache_abi)


@dataclass(frozen=True, slots=True)
class SpareView:
    """A node that serves nothing yet and will load any range of one artifact it is ordered to."""

    node_id: str
    artifact_id: str
    model: str
    model_revision: str
    cache_abi: str
    n_layer: int
    memory_bytes: int = 0
    disk_bytes: int = 0

    @property
    def group(self) -> tuple[str, str]:
        return (self.model_revision, self.cache_abi)


def free_slots(max_sessions: int, open_routes: int) -> int:
    """Session slots a node has left as the tracker counts them (pure): the node's advertised
    `max_sessions` minus the routes the tracker opened on it and has not seen end.

    Exact by construction: the tracker opens every route, so a close or abort it sees frees
    the slot for the very next request. A heartbeat's `free_session_slots` is not mixed in:
    it lags by up to a heartbeat interval and would hold a freed slot back that long."""
    return max(0, max_sessions - open_routes)


def unheld_sessions(
    held: Collection[str], opened: Iterable[tuple[str, float]], now: float, grace: float
) -> list[str]:
    """Of the sessions the tracker has open on a node, as (session_id, opened_at), those opened
    more than `grace` seconds ago that the node's heartbeat no longer holds (pure, sorted):
    the node ended them, and the close directive that would have told the tracker was lost.
    `grace` covers a heartbeat built before the node had opened the session."""
    return sorted(sid for sid, at in opened if sid not in held and now - at > grace)


def node_view(state: NodeState, active_sessions: int = 0) -> NodeView:
    """Flatten a registry entry; `active_sessions` is the tracker's count of open routes on it."""
    cap = state.capability
    hb = state.heartbeat
    free = free_slots(cap.max_sessions, active_sessions)
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
        speed_served=bool(hb and hb.decode_tokens_per_second),
        prefill_tps=(hb.prefill_tokens_per_second if hb and hb.prefill_tokens_per_second else 0.0)
        or cap.prefill_tokens_per_second,
        load=hb.load if hb else 0.0,
        queue_depth=hb.queue_depth if hb else 0,
        peer_rtt_ms=hb.peer_rtt_ms if hb else {},
        free_slots=free,
        max_sessions=cap.max_sessions,
        sessions=hb.sessions if hb else active_sessions,
        cache_bytes=hb.cache_bytes if hb else 0,
        spare=state.announcement.spare,
        active_bytes=cap.active_param_bytes_per_token,
        kv_profile=cap.kv_profile,
        protocol=state.announcement.protocol,
        window=state.announcement.window,
    )
