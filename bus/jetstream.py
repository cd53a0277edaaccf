"""JetStream beyond publishing: readers of the audit stream, and a key-value bucket.

- `DurableAuditReader`: a pull consumer with a durable name on MESH_AUDIT. The server keeps its
  position: a reader that stops (or a server that restarts) resumes after the last message it
  acknowledged. Messages come with their stream sequence, so a reader that persists "applied up
  to seq N" before it acknowledges counts every event exactly once.
- `read_recent`: the last N stored events of one subject (a tracker rebuilding what it knew).
- `KeyValueStore`: one JetStream KV bucket (file storage: it survives server restarts).
"""

from __future__ import annotations

import contextlib
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any

import nats.errors
import nats.js.errors
import orjson
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, KeyValueConfig, StorageType

from bus import subjects
from bus.client import Bus
from bus.errors import BusError
from bus.pull_link import PullLink, PullLinkError
from schemas.ledger import LEDGER_BUCKET, LEDGER_KEY, LedgerState

RECENT_IDLE_S = 30.0  # a read_recent consumer whose reader died is dropped by the server after this


class JetStreamError(BusError):
    """A JetStream call failed (the server may be restarting)."""


def refused_by_server(exc: BaseException) -> bool:
    """Whether `exc` is the server's own answer that it wrote nothing (no JetStream, or its API
    refused the call). Any other failure (no answer in time, a connection lost mid-call) leaves
    unknown whether a write landed."""
    return isinstance(exc, nats.js.errors.APIError | nats.errors.NoRespondersError)


@dataclass(frozen=True, slots=True)
class StoredEvent:
    """One audit event as stored: its stream sequence and its JSON."""

    seq: int
    data: dict[str, Any]
    reply: str  # where its acknowledgement goes ($JS.ACK.…)
    subject: str = ""  # the subject it was stored under (its publisher is bound to it)


def stream_seq(reply: str) -> int:
    """The stream sequence in a JetStream delivery's reply subject (pure):
    $JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<consumer seq>.<ts>.<pending>[...]"""
    parts = reply.split(".")
    if len(parts) < 9 or parts[:2] != ["$JS", "ACK"]:
        raise JetStreamError(f"not a JetStream delivery: {reply!r}")
    # the 12-token form (with domain and account hash) puts the stream at index 4
    return int(parts[5] if len(parts) == 9 else parts[7])


def _stored(payload: bytes, reply: str, subject: str) -> StoredEvent:
    """A JetStream delivery as a StoredEvent (a payload that is not a JSON object: {})."""
    try:
        data = orjson.loads(payload)
    except orjson.JSONDecodeError:
        data = {}
    return StoredEvent(stream_seq(reply), data if isinstance(data, dict) else {}, reply, subject)


class DurableAuditReader:
    """Reads MESH_AUDIT from where durable consumer `durable` left off.

    Batches are pulled with one `CONSUMER.MSG.NEXT` request each over a connection of the
    reader's own (bus/pull_link.py), and acknowledged with one publish per batch: nats-py's
    `fetch` made a task and a reply future per message, and its parser a Msg and a header
    dictionary, which capped the Work Ledger at about 4,400 and then 14,000 events/s
    (bench/ledger.py)."""

    def __init__(self, bus: Bus, durable: str, *, max_ack_pending: int = 4096,
                 filter_subject: str = subjects.AUDIT_ALL, from_start: bool = True,
                 ack_wait_s: float = 30.0, prefetch: bool = False) -> None:
        self.bus = bus
        self.prefetch = prefetch  # ask for the next batch while the caller handles one (a fast caller)
        self.durable = durable
        self.max_ack_pending = max_ack_pending
        self.filter_subject = filter_subject  # only these events (e.g. one kind: subjects.audit_kind)
        self.from_start = from_start  # a new consumer reads the whole stream (else: from now on)
        self.ack_wait_s = ack_wait_s  # an event not acknowledged this long comes back
        self._link: PullLink | None = None
        self._api = f"$JS.API.CONSUMER.MSG.NEXT.{subjects.AUDIT_STREAM}.{durable}"
        self._ack_all = False

    async def open(self, start_seq: int | None = None) -> None:
        """Make sure the consumer exists and connect; with `start_seq`, the durable consumer is
        made again to deliver from that stream sequence on: the caller's own record of what
        it has handled is then the truth, and events it fetched but never stored cannot be
        acknowledged past."""
        await self.bus.ensure_audit_stream()
        config = ConsumerConfig(durable_name=self.durable, ack_policy=AckPolicy.ALL,
                                deliver_policy=DeliverPolicy.ALL if self.from_start else DeliverPolicy.NEW,
                                max_ack_pending=self.max_ack_pending, ack_wait=self.ack_wait_s,
                                filter_subject=self.filter_subject)
        js = self.bus._js
        if start_seq is not None:
            config.deliver_policy, config.opt_start_seq = DeliverPolicy.BY_START_SEQUENCE, max(1, start_seq)
            try:
                await js.delete_consumer(subjects.AUDIT_STREAM, self.durable)
            except nats.js.errors.NotFoundError:
                pass
        try:
            info = await js.consumer_info(subjects.AUDIT_STREAM, self.durable)
        except nats.js.errors.NotFoundError:
            info = await js.add_consumer(subjects.AUDIT_STREAM, config)
        # a consumer made by an older build acknowledges each event; a new one all up to the last
        self._ack_all = info.config.ack_policy == AckPolicy.ALL
        user, password = self.bus._credentials
        try:
            self._link = await PullLink.open(self.bus.url, user=user, password=password,
                                             inbox_prefix=subjects.inbox_prefix(self.bus.role, self.bus.node_id),
                                             name=f"{self.bus.name or self.bus.role}-pull")
        except PullLinkError as exc:
            raise JetStreamError(str(exc)) from exc

    async def fetch(self, batch: int = 256, timeout: float = 1.0) -> list[StoredEvent]:
        """Up to `batch` events not yet acknowledged ([] when none came within timeout)."""
        if self._link is None:
            raise JetStreamError("the reader is not open")
        try:
            got = await self._link.pull(self._api, batch, timeout, prefetch=self.prefetch)
        except PullLinkError as exc:
            raise JetStreamError(str(exc)) from exc
        return [_stored(m.payload, m.reply, m.subject) for m in got]

    async def ack(self, events: list[StoredEvent]) -> None:
        """Acknowledge `events` (in delivery order): with AckPolicy.ALL one acknowledgement of
        the last acknowledges every one before it."""
        if not events:
            return
        if self._link is None:
            raise JetStreamError("the reader is not open")
        try:
            for e in [max(events, key=lambda e: e.seq)] if self._ack_all else events:
                self._link.ack(e.reply)
        except PullLinkError as exc:
            raise JetStreamError(str(exc)) from exc

    async def close(self) -> None:
        if self._link is not None:
            await self._link.close()
            self._link = None


async def audit_last_seq(bus: Bus) -> int:
    """The stream sequence of the last event stored in MESH_AUDIT (0: none yet)."""
    await bus.ensure_audit_stream()
    return int((await bus._js.stream_info(subjects.AUDIT_STREAM)).state.last_seq or 0)


async def read_recent(bus: Bus, filter_subject: str, limit: int, *, timeout: float = 2.0) -> list[StoredEvent]:
    """The last `limit` events stored in MESH_AUDIT under `filter_subject`, oldest first.

    An ephemeral consumer reads them (no acknowledgements; deleted afterwards, or by the server
    once idle). It starts at the stream's last sequence minus a window that widens fourfold
    until `limit` such events lie in it, so reading a sparse subject costs about `limit`
    deliveries, not a pass over the whole stream."""
    await bus.ensure_audit_stream()
    js = bus._js
    state = (await js.stream_info(subjects.AUDIT_STREAM)).state
    if limit <= 0 or not state.messages:
        return []
    first, last = max(1, int(state.first_seq)), int(state.last_seq)
    name = f"recent_{uuid.uuid4().hex}"
    window = limit
    while True:
        start = max(first, last - window + 1)
        info = await js.add_consumer(subjects.AUDIT_STREAM, ConsumerConfig(
            name=name, filter_subject=filter_subject, deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=start, ack_policy=AckPolicy.NONE, inactive_threshold=RECENT_IDLE_S, mem_storage=True))
        if (info.num_pending or 0) >= limit or start == first:
            break
        await js.delete_consumer(subjects.AUDIT_STREAM, name)
        window *= 4
    kept: deque[StoredEvent] = deque(maxlen=limit)
    sub = await js.pull_subscribe_bind(name, stream=subjects.AUDIT_STREAM)
    try:
        left = info.num_pending or 0  # events stored later arrive on the caller's own subscription
        while left > 0:
            try:
                msgs = await sub.fetch(min(left, 256), timeout=timeout)
            except nats.errors.TimeoutError:
                break
            left -= len(msgs)
            kept.extend(_stored(m.data, m.reply, m.subject) for m in msgs)
    finally:
        await sub.unsubscribe()
        with contextlib.suppress(nats.js.errors.NotFoundError):
            await js.delete_consumer(subjects.AUDIT_STREAM, name)
    return list(kept)


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

    async def replace_json(self, key: str, value: Any, revision: int) -> int:
        """Write `value` if the key is still at `revision` (0: absent) and return its new
        revision; 0 if another writer got there first (compare-and-set, so two writers never
        clobber each other)."""
        try:
            if revision:
                return int(await self._kv.update(key, orjson.dumps(value), last=revision))
            return int(await self._kv.create(key, orjson.dumps(value)))
        except nats.js.errors.KeyWrongLastSequenceError:
            return 0
        except nats.js.errors.BadRequestError:  # create of a key that exists meanwhile
            return 0


async def read_ledger(bus: Bus) -> LedgerState:
    """The Work Ledger as last stored (JetStreamError when no ledger ever ran on this server)."""
    kv = await KeyValueStore.open(bus, LEDGER_BUCKET, create=False)
    raw = await kv.get_json(LEDGER_KEY)
    return LedgerState.model_validate(raw) if raw else LedgerState()
