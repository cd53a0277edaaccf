"""Tracker announcements: hello (please re-announce) and periodic status snapshots."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, Field

from schemas.base import BusMessage


class TrackerHello(BusMessage):
    """Published on mesh.tracker.hello: nodes listed (or every node if empty) re-announce now."""

    TYPE: ClassVar[str] = "tracker.hello"
    tracker_id: str
    node_ids: list[str] = Field(default_factory=list)


class NodeSummary(BaseModel):
    """One row of the tracker's node table."""

    node_id: str
    model: str
    model_revision: str = ""
    activation_url: str = ""  # where its frames go: nodes probe their candidates' round trips here
    layer_start: int
    layer_end: int
    n_layer: int
    decode_tokens_per_second: float = 0.0
    sessions: int = 0
    cache_bytes: int = 0
    free_session_slots: int = 0
    age_s: float = 0.0  # seconds since the last heartbeat


class CoverageSummary(BaseModel):
    """Coverage of one model revision: gap vs covered but under-provisioned."""

    model: str
    model_revision: str
    cache_abi: str
    n_layer: int
    status: Literal["covered", "under_provisioned", "gap"]
    routable: bool  # an exact chain of shards covers [0, n_layer)
    min_replicas: int
    target_replicas: int
    gaps: list[tuple[int, int]] = Field(default_factory=list)
    under_provisioned: list[tuple[int, int]] = Field(default_factory=list)


class SessionSummary(BaseModel):
    """One active Route Session as the tracker knows it."""

    session_id: str
    route_id: str
    model: str
    nodes: list[str]
    age_s: float = 0.0


class TrackerStatus(BusMessage):
    """Published on mesh.tracker.status every few seconds (for `meshnet watch`)."""

    TYPE: ClassVar[str] = "tracker.status"
    tracker_id: str
    n_nodes: int
    nodes: list[NodeSummary] = Field(default_factory=list)  # capped; n_nodes is the true count
    coverage: list[CoverageSummary] = Field(default_factory=list)
    n_sessions: int = 0
    quarantined: list[str] = Field(default_factory=list)  # nodes out of new routes (replay verdicts)
    sessions: list[SessionSummary] = Field(default_factory=list)  # capped
    bus_rtt_ms: float = 0.0  # the tracker's measured round trip to its NATS server (bus/rtt.py)
