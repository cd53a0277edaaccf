"""Generation Telemetry: the live state of one Route Session."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from schemas.base import BusMessage
from schemas.route import Phase


class GenerationTelemetry(BusMessage):
    """Published on mesh.session.<id>.telemetry and streamed by the gateway as SSE."""

    TYPE: ClassVar[str] = "session.telemetry"
    session_id: str
    route_id: str | None = None
    model: str
    phase: Phase
    seq: int = 0  # monotonically increasing per session; SSE `id:`
    queue_position: int | None = Field(default=None, ge=1)  # 1-based place in the admission queue while queued
    prefill_tokens_done: int = 0
    prefill_tokens_total: int = 0
    generated_tokens: int = 0
    rolling_tokens_per_second: float = 0.0
    average_tokens_per_second: float = 0.0
    route_nodes: list[str] = Field(default_factory=list)
    route_policy: Literal["public", "private"] = "public"  # which nodes its routes could use
    last_phase: Phase | None = None  # on failure: where it failed
    failure_reason: str | None = None
    finish_reason: str | None = None
    restarts: int = 0  # new routes this session moved to after losing a hop
    moves: int = 0  # new routes it moved to because the tracker spread sessions over replicas
    restart_reason: str | None = None  # while (and after) restarting: why the last route was left
    lost_node_id: str | None = None  # the hop that route lost
    kept_nodes: list[str] = Field(default_factory=list)  # the restart's hops that kept the history (Kept Hops)
    # speculative decoding: the head's verify steps, their tokens per trip and kept fraction of
    # drafts, and the last step's draft length (0 and None while it has not drafted)
    spec_trips: int = 0
    spec_accepted_per_trip: float | None = None
    spec_acceptance: float | None = None
    spec_draft_length: int = 0
    spec_pipelined_trips: int = 0  # verify steps sent before the one before them was answered


HopPhase = Literal["prefill", "decode", "closed", "failed"]


class HopTelemetry(BusMessage):
    """One hop's view of a Route Session, published by its node on mesh.session.<id>.telemetry.

    Sent when the hop finishes the session's final prefill frame, at most once per second
    while it decodes, and once when the session ends on this hop. It has no `model` field,
    so it never validates as GenerationTelemetry; readers of the subject tell them apart by `type`.
    """

    TYPE: ClassVar[str] = "session.hop_telemetry"
    session_id: str
    route_id: str
    node_id: str
    hop_index: int
    layer_start: int
    layer_end: int
    phase: HopPhase
    position: int = 0  # tokens in this hop's KV cache after the last frame it finished
    prefill_tokens: int = 0
    decode_tokens: int = 0
    compute_ms: float = 0.0  # cumulative engine time of this session on this hop
    cache_bytes: int = 0  # 0 once the hop freed the session's cache
    reason: str | None = None  # how the session ended (closed/failed only)
