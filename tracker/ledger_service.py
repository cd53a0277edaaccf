"""The ledger consumer: the audit stream, through a durable consumer, into the MESH_LEDGER bucket.

Each round fetches up to `batch` events, applies them (tracker/ledger.py), stores the whole
state in the bucket, and only then acknowledges them. A stop at any point loses nothing and
counts nothing twice: events applied but not acknowledged come back and are skipped by their
sequence (`last_seq` was stored with them); events not yet stored come back and are counted.
It runs inside the tracker (`meshnet tracker`, on by default) on the tracker's connection.
"""

from __future__ import annotations

import asyncio
import logging

from bus.client import Bus
from bus.errors import BusError
from bus.jetstream import DurableAuditReader, KeyValueStore
from schemas.ledger import LEDGER_BUCKET, LEDGER_KEY, LedgerState
from tracker.ledger import apply_event

log = logging.getLogger("meshnet.ledger")

LEDGER_DURABLE = "meshnet-ledger"


class LedgerConsumer:
    """Keeps the ledger up to date until cancelled."""

    def __init__(self, bus: Bus, *, batch: int = 256, idle_s: float = 1.0) -> None:
        self.bus = bus
        self.batch = batch
        self.idle_s = idle_s
        self.state = LedgerState()
        self.rounds = 0

    async def run(self) -> None:
        while True:
            try:
                await self._serve()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the server restarting, say: start over from the stored state
                log.warning("ledger consumer stopped (%s: %s); again in 1 s", type(exc).__name__, exc)
                await asyncio.sleep(1.0)

    async def _serve(self) -> None:
        kv = await KeyValueStore.open(self.bus, LEDGER_BUCKET, create=True)
        raw = await kv.get_json(LEDGER_KEY)
        self.state = LedgerState.model_validate(raw) if raw else LedgerState()
        reader = DurableAuditReader(self.bus, LEDGER_DURABLE)
        await reader.open()
        log.info("ledger: %d events counted so far (up to seq %d)", self.state.events, self.state.last_seq)
        try:
            while True:
                events = await reader.fetch(self.batch, timeout=self.idle_s)
                if not events:
                    continue
                changed = False
                for e in events:
                    changed |= apply_event(self.state, e.seq, e.data)
                await kv.put_json(LEDGER_KEY, self.state.model_dump(mode="json"))  # then ack: exactly once
                await reader.ack(events)
                self.rounds += 1
                if changed:
                    log.debug("ledger: up to seq %d", self.state.last_seq)
        finally:
            try:
                await reader.close()
            except BusError:
                pass
