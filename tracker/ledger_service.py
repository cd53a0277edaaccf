"""The ledger consumer: the audit stream, through a durable consumer, into the MESH_LEDGER bucket.

Each round fetches up to `batch` events, applies them (tracker/ledger.py), stores the whole
state in the bucket, and only then acknowledges them. A stop at any point loses nothing and
counts nothing twice: events applied but not acknowledged come back and are skipped by their
sequence (`last_seq` was stored with them); events not yet stored come back and are counted.
It runs inside the tracker (`meshnet tracker`, on by default) on the tracker's connection.

Several trackers each keep a complete ledger of their own: a durable consumer and a key per
tracker id (`ledger.<tracker_id>`), each reading the whole stream in order. The shared key
`ledger`, which readers read, is written compare-and-set by whichever is furthest along, so
it is always one complete ledger, never a mix of two.
"""

from __future__ import annotations

import asyncio
import logging
import re

from bus.client import Bus
from bus.errors import BusError
from bus.jetstream import DurableAuditReader, KeyValueStore
from schemas.ledger import LEDGER_BUCKET, LEDGER_KEY, LedgerState
from tracker.ledger import apply_event, stored_value

log = logging.getLogger("meshnet.ledger")

LEDGER_DURABLE = "meshnet-ledger"  # + "-<tracker_id>"


class LedgerConsumer:
    """Keeps the ledger up to date until cancelled."""

    def __init__(self, bus: Bus, *, owner: str = "tracker", batch: int = 256, idle_s: float = 1.0) -> None:
        self.bus = bus
        self.owner = re.sub(r"[^A-Za-z0-9_-]", "_", owner)  # a key token and a consumer name
        self.own_key = f"{LEDGER_KEY}.{self.owner}"
        self.durable = f"{LEDGER_DURABLE}-{self.owner}"
        self.batch = batch
        self.idle_s = idle_s
        self.state = LedgerState()
        self.rounds = 0
        self._shared_revision = 0  # of the shared key as this consumer last wrote it (0: unknown)

    async def run(self) -> None:
        while True:
            try:
                await self._serve()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the server restarting, say: start over from the stored state
                log.warning("ledger consumer stopped (%s: %s); again in 1 s", type(exc).__name__, exc)
                await asyncio.sleep(1.0)

    async def _publish(self, kv: KeyValueStore, value: dict) -> None:
        """Make this ledger the shared one unless another tracker's is further along. The
        revision this consumer last wrote is tried first: only when another writer came in
        between is the shared value read again (it is as large as the ledger)."""
        if self._shared_revision:
            self._shared_revision = await kv.replace_json(LEDGER_KEY, value, self._shared_revision)
            if self._shared_revision:
                return
        for _ in range(3):
            shared, revision = await kv.get_with_revision(LEDGER_KEY)
            if shared is not None and int(shared.get("last_seq", 0)) > self.state.last_seq:
                return
            self._shared_revision = await kv.replace_json(LEDGER_KEY, value, revision)
            if self._shared_revision:
                return

    async def _serve(self) -> None:
        kv = await KeyValueStore.open(self.bus, LEDGER_BUCKET, create=True)
        self._shared_revision = 0  # the state is read again: compare with the shared ledger first
        raw = await kv.get_json(self.own_key)
        self.state = LedgerState.model_validate(raw) if raw else LedgerState()
        reader = DurableAuditReader(self.bus, self.durable, prefetch=True)  # a batch folds in ms
        # the stored state says what is counted: deliver from the event after it (a batch
        # fetched but not stored before a failure comes again, never acknowledged past)
        await reader.open(start_seq=self.state.last_seq + 1)
        log.info("ledger: %d events counted so far (up to seq %d)", self.state.events, self.state.last_seq)
        try:
            while True:
                events = await reader.fetch(self.batch, timeout=self.idle_s)
                if not events:
                    continue
                changed = False
                for e in events:
                    changed |= apply_event(self.state, e.seq, e.data, e.subject)
                value = stored_value(self.state)  # within the bucket's value size
                await kv.put_json(self.own_key, value)  # then ack: exactly once
                await reader.ack(events)
                await self._publish(kv, value)
                self.rounds += 1
                if changed:
                    log.debug("ledger: up to seq %d", self.state.last_seq)
        finally:
            try:
                await reader.close()
            except BusError:
                pass
