"""Versioned envelope shared by every bus message, and its JSON codec (orjson)."""

from __future__ import annotations

import time
from typing import ClassVar, Literal, TypeVar

import orjson
from pydantic import BaseModel, ConfigDict, ValidationError

SCHEMA_VERSION = 1

M = TypeVar("M", bound="BusMessage")


class SchemaError(ValueError):
    """A message that is not valid JSON, has an unknown schema version, or fails validation."""

    def __init__(self, message: str, *, kind: str, subject: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.subject = subject


class BusMessage(BaseModel):
    """Every message on NATS carries `v` (schema version), `type` and a timestamp."""

    model_config = ConfigDict(extra="ignore")

    TYPE: ClassVar[str] = "message"
    STRICT_TYPE: ClassVar[bool] = True  # reject JSON whose `type` names another message
    v: Literal[1] = SCHEMA_VERSION
    ts: float = 0.0

    def model_post_init(self, _ctx: object) -> None:
        if not self.ts:
            self.ts = time.time()

    def to_json(self) -> bytes:
        """Serialize to compact JSON bytes with a `type` field for readers of `nats sub`."""
        data = self.model_dump(mode="json")
        data["type"] = self.TYPE
        return orjson.dumps(data)

    @classmethod
    def from_json(cls: type[M], raw: bytes, subject: str | None = None) -> M:
        """Parse and validate; raise SchemaError (never anything else) on bad input."""
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise SchemaError(f"not JSON: {exc}", kind="malformed", subject=subject) from exc
        if not isinstance(data, dict):
            raise SchemaError("not a JSON object", kind="malformed", subject=subject)
        if data.get("v") != SCHEMA_VERSION:
            raise SchemaError(
                f"unknown schema version {data.get('v')!r} for {cls.TYPE}",
                kind="unknown_version",
                subject=subject,
            )
        kind = data.pop("type", None)
        if cls.STRICT_TYPE and kind is not None and kind != cls.TYPE:
            raise SchemaError(
                f"a {kind!r} message, not {cls.TYPE!r}", kind="other_type", subject=subject
            )
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(part) for part in first["loc"])
            raise SchemaError(
                f"invalid {cls.TYPE}: {exc.error_count()} error(s): {where + ': ' if where else ''}{first['msg']}",
                kind="invalid",
                subject=subject,
            ) from exc
