"""Generation Telemetry: the live state of one Route Session."""

from __future__ import annotations

from typing import ClassVar

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
    prefill_tokens_done: int = 0
    prefill_tokens_total: int = 0
    generated_tokens: int = 0
    rolling_tokens_per_second: float = 0.0
    average_tokens_per_second: float = 0.0
    route_nodes: list[str] = Field(default_factory=list)
    last_phase: Phase | None = None  # on failure: where it failed
    failure_reason: str | None = None
    finish_reason: str | None = None
