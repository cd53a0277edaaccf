"""DriverWatch: a node frees the sessions whose driver went away.

Every Route Session names its driver (`RouteSession.driver_id`: the gateway that asked for it),
and every live gateway says it is alive on mesh.driver.<id>.alive once a second. A session
whose driver has been silent for DRIVER_SILENCE_S (8 s) is aborted here, and its Hot KV State
freed: a gateway that crashed no longer leaves its sessions on every hop for the idle lease
(600 s). The silence is judged only after a round trip on this node's own bus succeeds, so a
node cut off from the bus frees nothing; and once its bus is back (a round trip answered after
some that were not, or a reconnect), every driver counts as heard from then: the DriverAlive
sent meanwhile may still be on its way behind the round trip's answer (a NATS server paused or
restarted for more than 8 s would otherwise free every running stream of every live gateway the
moment it answers again). That round trip may take a second plus two of the round trips the node
measures every check (bus/rtt.py): a node far from the server gets its answer late, not never.
A session without a driver id waits for the lease.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Mapping

from bus import subjects
from bus.client import Bus
from bus.errors import BusError
from bus.rtt import BusRtt, measure_rtt
from nodes.server.hop_machine import HopPhase
from nodes.server.table import SessionTable
from schemas.route import DRIVER_SILENCE_S, DriverAlive

log = logging.getLogger("meshnet.node.drivers")

CHECK_S = 1.0
ANSWER_S = 1.0  # the round trip before a session is freed may take this, plus two measured round trips


def orphaned(sessions: Iterable[tuple[str, str, float]], seen: Mapping[str, float], now: float,
             silence_s: float = DRIVER_SILENCE_S) -> list[str]:
    """The sessions to free (pure): of (session id, driver id, opened at), those with a driver
    last heard from, or never heard from since the session opened, more than `silence_s` ago."""
    return [sid for sid, driver, opened in sessions
            if driver and now - max(seen.get(driver, opened), opened) > silence_s]


class DriverWatch:
    """When each driver was last heard from, and the check that frees its orphaned sessions."""

    def __init__(self, bus: Bus, table: SessionTable, silence_s: float = DRIVER_SILENCE_S) -> None:
        self.bus = bus
        self.table = table
        self.silence_s = silence_s
        self.seen: dict[str, float] = {}  # driver id -> when last heard (monotonic: a wall clock step frees nothing)
        self.freed = 0
        self.rtt = BusRtt()  # this node's round trip to the server: a distant bus answers late, not never
        self._deaf = False  # the last round trip on this node's bus went unanswered
        self._reconnects = bus.reconnects

    def excuse(self, now: float) -> None:
        """Count every driver of a live session as heard from at `now`: this node's bus heard
        nobody before, so their silence so far says nothing about them."""
        for hs in self.table.live.values():
            driver = hs.route.driver_id
            if driver:
                self.seen[driver] = max(self.seen.get(driver, now), now)

    def _orphans(self) -> list[str]:
        live = [(sid, hs.route.driver_id, hs.opened_at) for sid, hs in self.table.live.items()]
        return orphaned(live, self.seen, time.monotonic(), self.silence_s)

    async def check(self) -> list[str]:
        """Free the sessions whose driver is silent (after this node's bus answered a round trip)."""
        reconnects = self.bus.reconnects
        if reconnects != self._reconnects:  # the bus came back: nothing was heard while it was away
            self._reconnects = reconnects
            self.excuse(time.monotonic())
        if not self._orphans():
            return []
        try:
            await self.bus.flush(timeout=ANSWER_S + 2 * self.rtt.seconds())
        except (TimeoutError, BusError, OSError):
            self._deaf = True
            return []  # the silence may be this node's own
        if self._deaf:  # answered again: the DriverAlive held up meanwhile may still be coming
            self._deaf = False
            self.excuse(time.monotonic())
            return []
        freed = []
        for sid in self._orphans():  # again: a heartbeat may have come in meanwhile
            hs = self.table.live.get(sid)
            driver = hs.route.driver_id if hs is not None else "?"
            reason = f"its driver {driver} went away (silent for more than {self.silence_s:g} s)"
            if await self.table.end(sid, HopPhase.ABORTED, reason, park=False):
                log.warning("session %s: %s", sid, reason)
                freed.append(sid)
        self.freed += len(freed)
        return freed

    async def run(self) -> None:
        """Follow the drivers' heartbeats and check every CHECK_S (until cancelled)."""
        async with self.bus.subscribe(subjects.DRIVER_ALIVE_ALL, DriverAlive) as sub:
            follow = asyncio.create_task(self._follow(sub), name="driver-alive")
            try:
                while True:
                    await asyncio.sleep(CHECK_S)
                    await measure_rtt(self.bus, self.rtt)
                    await self.check()
            finally:
                follow.cancel()
                await asyncio.gather(follow, return_exceptions=True)

    async def _follow(self, sub: object) -> None:
        async for msg in sub:  # type: ignore[attr-defined]
            self.seen[msg.driver_id] = time.monotonic()
