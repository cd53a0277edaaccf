"""Decode any bus message by its `type` field (for monitors that read all of mesh.>)."""

from __future__ import annotations

from typing import ClassVar

import orjson
from pydantic import ConfigDict

from schemas.audit import NodeWork, RouteParticipation, ValidationEvent, ValidationVerdict
from schemas.base import BusMessage, SchemaError
from schemas.node import NodeAnnouncement, NodeHeartbeat
from schemas.rebalance import RebalanceDirective
from schemas.route import DriverAlive, RouteDirective, RouteReply, RouteRequest, RouteWithdrawal
from schemas.telemetry import GenerationTelemetry, HopTelemetry
from schemas.tracker import TrackerHello, TrackerStatus
from schemas.validation import QuarantineNotice, ReplayRecordRequest, UnquarantineRequest

MESSAGE_TYPES: dict[str, type[BusMessage]] = {
    cls.TYPE: cls
    for cls in (
        NodeAnnouncement,
        NodeHeartbeat,
        RouteRequest,
        RouteReply,
        RouteWithdrawal,
        RouteDirective,
        DriverAlive,
        RebalanceDirective,
        GenerationTelemetry,
        HopTelemetry,
        TrackerHello,
        TrackerStatus,
        RouteParticipation,
        NodeWork,
        ValidationEvent,
        ValidationVerdict,
        ReplayRecordRequest,
        QuarantineNotice,
        UnquarantineRequest,
    )
}


class UnknownMessage(BusMessage):
    """A well-formed bus message whose `type` this build does not know; fields kept as-is."""

    model_config = ConfigDict(extra="allow")
    TYPE: ClassVar[str] = "unknown"
    STRICT_TYPE: ClassVar[bool] = False
    type_name: str = "unknown"


def register(cls: type[BusMessage]) -> type[BusMessage]:
    """Register a message class (usable as a decorator) so parse_message can decode it."""
    MESSAGE_TYPES[cls.TYPE] = cls
    return cls


def parse_message(raw: bytes, subject: str | None = None) -> BusMessage:
    """Decode by `type`; unknown types become UnknownMessage; bad input raises SchemaError."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise SchemaError(f"not JSON: {exc}", kind="malformed", subject=subject) from exc
    if not isinstance(data, dict):
        raise SchemaError("not a JSON object", kind="malformed", subject=subject)
    type_name = data.get("type")
    cls = MESSAGE_TYPES.get(type_name) if isinstance(type_name, str) else None
    if cls is None:
        msg = UnknownMessage.from_json(raw, subject)
        msg.type_name = str(type_name)
        return msg
    return cls.from_json(raw, subject)
