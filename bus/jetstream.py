"""JetStream beyond publishing: a durable reader of the audit stream, and a key-value bucket.

- `DurableAuditReader`: a pull consumer with a durable name on MESH_AUDIT. The server keeps its
  position: a reader that stops (or a server that restarts) resumes after the last message it
  acknowledged. Messages come with their stream sequence, so a reader that persists "applied up
  to seq N" before it acknowledges counts every event exactly once.
- `KeyValueStore`: one JetStream KV bucket (file storage: it survives server restarts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import nats.errors
import nats.js.errors
import orjson
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, KeyValueConfig, StorageType

from bus import subjects
from bus.client import Bus
from bus.errors import BusError
from schemas.ledger import LEDGER_BUCKET, LEDGER_KEY, LedgerState


class JetStreamError(BusError):
    """A JetStream call failed (the server may be restarting)."""


@dataclass(frozen=True, slots=True)
class StoredEvent:
    """One audit event as stored: its stream sequence and its JSON."""

    seq: int
    data: dict[str, Any]
    _msg: Any
    subject: str = ""  # the subject it was stored under (its publisher is bound to it)


class DurableAuditReader:
    """Reads MESH_AUDIT from where durable consumer `durable` left off."""

    def __init__(self, bus: Bus, durable: str, *, max_ack_pending: int = 4096,
                 filter_subject: str = subjects.AUDIT_ALL, from_start: bool = True,
                 ack_wait_s: float = 30.0) -> None:
        self.bus = bus
        self.durable = durable
        self.max_ack_pending = max_ack_pending
        self.filter_subject = filter_subject  # only these events (e.g. one kind: subjects.audit_kind)
        self.from_start = from_start  # a new consumer reads the whole stream (else: from now on)
        self.ack_wait_s = ack_wait_s  # an event not acknowledged this long comes back
        self._sub: Any = None

    async def open(self) -> None:
        await self.bus.ensure_audit_stream()
        config = ConsumerConfig(durable_name=self.durable, ack_policy=AckPolicy.EXPLICIT,
                                deliver_policy=DeliverPolicy.ALL if self.from_start else DeliverPolicy.NEW,
                                max_ack_pending=self.max_ack_pending, ack_wait=self.ack_wait_s,
                                filter_subject=self.filter_subject)
        self._sub = await self.bus._js.pull_subscribe(self.filter_subject, durable=self.durable,
                                                      stream=subjects.AUDIT_STREAM, config=config)

    async def fetch(self, batch: int = 256, timeout: float = 1.0) -> list[StoredEvent]:
        """Up to `batch` events not yet acknowledged ([] when none came within timeout)."""
        try:
            msgs = await self._sub.fetch(batch, timeout=timeout)
        except (nats.errors.TimeoutError, TimeoutError):
            return []
        out = []
        for m in msgs:
            try:
                data = orjson.loads(m.data)
            except orjson.JSONDecodeError:
                data = {}
            out.append(StoredEvent(int(m.metadata.sequence.stream), data if isinstance(data, dict) else {}, m,
                                   m.subject))
        return out

    @staticmethod
    async def ack(events: list[StoredEvent]) -> None:
        for e in events:
            await e._msg.ack()

    async def close(self) -> None:
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception:  # closing anyway
                pass
            self._sub = None


class KeyValueStore:
    """A JetStream key-value bucket holding JSON values."""

    def __init__(self, kv: Any, bucket: str) -> None:
        self._kv = kv
        self.bucket = bucket

    @classmethod
    async def open(cls, bus: Bus, bucket: str, *, create: bool, ttl_s: float | None = None) -> KeyValueStore:
        """The bucket; made (file storage, one value per key, values older than `ttl_s`
        dropped) when `create` and it is missing."""
        try:
            return cls(await bus._js.key_value(bucket), bucket)
        except (nats.js.errors.BucketNotFoundError, nats.js.errors.NotFoundError) as exc:
            if not create:
                raise JetStreamError(f"no key-value bucket {bucket!r} (is the tracker's ledger running?)") from exc
        kv = await bus._js.create_key_value(KeyValueConfig(bucket=bucket, history=1, storage=StorageType.FILE,
                                                           ttl=ttl_s))
        return cls(kv, bucket)

    async def get_json(self, key: str) -> Any | None:
        try:
            entry = await self._kv.get(key)
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
            return None
        return orjson.loads(entry.value) if entry.value else None

    async def put_json(self, key: str, value: Any) -> int:
        return int(await self._kv.put(key, orjson.dumps(value)))

    async def delete(self, key: str) -> None:
        await self._kv.delete(key)

    async def items(self) -> dict[str, Any]:
        """Every live key and its value (a bucket of modest size: it lists the keys first)."""
        try:
            keys = await self._kv.keys()
        except nats.js.errors.NoKeysError:
            return {}
        out = {}
        for k in keys:
            value = await self.get_json(k)
            if value is not None:
                out[k] = value
        return out

    async def get_with_revision(self, key: str) -> tuple[Any | None, int]:
        """(value, revision); (None, 0) for a key never written."""
        try:
            entry = await self._kv.get(key)
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
            return None, 0
        return (orjson.loads(entry.value) if entry.value else None), int(entry.revision or 0)

    async def replace_json(self, key: str, value: Any, revision: int) -> bool:
        """Write `value` if the key is still at `revision` (0: absent); False if another
        writer got there first (compare-and-set, so two writers never clobber each other)."""
        try:
            if revision:
                await self._kv.update(key, orjson.dumps(value), last=revision)
            else:
                await self._kv.create(key, orjson.dumps(value))
        except nats.js.errors.KeyWrongLastSequenceError:
            return False
        except nats.js.errors.BadRequestError:  # create of a key that exists meanwhile
            return False
        return True


async def read_ledger(bus: Bus) -> LedgerState:
    """The Work Ledger as last stored (JetStreamError when no ledger ever ran on this server)."""
    kv = await KeyValueStore.open(bus, LEDGER_BUCKET, create=False)
    raw = await kv.get_json(LEDGER_KEY)
    return LedgerState.model_validate(raw) if raw else LedgerState()
