"""A node's life on the bus: announce, heartbeat (with its round trips to the nodes after it),
follow directives, hop telemetry, audited work."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable

from bus import subjects
from bus.client import Bus
from bus.tasks import cancel_and_wait
from nodes.server.driver_watch import DriverWatch
from nodes.server.hop_evidence import EvidenceShelf
from nodes.server.hop_machine import HopPhase
from nodes.server.hop_telemetry import HopTelemetryPublisher
from nodes.server.liveness import HeartbeatThread
from nodes.server.peer_probe import PeerProbe
from nodes.server.runner import EngineRunner
from nodes.server.session import HopSession, claimed_decode_rows
from nodes.server.table import SessionTable
from schemas.audit import NodeWork, RouteParticipation
from schemas.capability import CapabilityReport
from schemas.node import MAX_LISTED_SESSIONS, NodeAnnouncement, NodeHeartbeat, NodeKey
from schemas.protocol import PROTOCOL
from schemas.route import RouteDirective, RouteFailure, RouteSession
from schemas.tracker import TrackerHello
from schemas.validation import HopEvidenceRequest

log = logging.getLogger("meshnet.node.bus")
PROCESS_ID = secrets.token_hex(8)  # this OS process: every shard it serves announces it

TRACKER_HELLO = getattr(subjects, "TRACKER_HELLO", f"{subjects.PREFIX}.tracker.hello")


def lost_hop_failure(d: RouteDirective, reason: str, phase: str) -> RouteFailure | None:
    """The failure an abort for a lost node means to the session's other hops: `hop_lost`,
    naming that node (so a restart leaves it out), or None for a plain abort."""
    lost = d.lost_node_id
    if lost is None:
        return None
    index = next((i for i, h in enumerate(d.session.hops) if h.node_id == lost), None)
    return RouteFailure(session_id=d.session.session_id, route_id=d.session.route_id, phase=phase,  # type: ignore[arg-type]
                        hop_index=index, node_id=lost, reason=f"session aborted: {reason}", code="hop_lost")


def my_hops(session: RouteSession, node_id: str, url: str) -> list[int]:
    """The hops of `session` this process serves (pure): named by its id and its address. A
    second process started with a registered --node-id (the tracker refuses it) finds the kept
    process's address in every route of that id, so it opens none of them."""
    return [i for i, h in enumerate(session.hops) if h.node_id == node_id and h.activation_url == url]


class Presence:
    """Publishes what the node serves and how it is; applies directives to the SessionTable."""

    def __init__(self, bus: Bus, *, node_id: str, url: str, capability: CapabilityReport,
                 table: SessionTable, runner: EngineRunner, heartbeat_s: float = 1.0,
                 announce_s: float = 10.0, frame_key: bytes = b"", evidence: EvidenceShelf | None = None,
                 window: int = 1) -> None:
        self.bus = bus
        self.evidence = evidence
        self.frame_key = frame_key
        self.node_id = node_id
        self.url = url
        self.capability = capability
        self.window = window  # the credit window its sessions grant (announced: senders start with it)
        self.table = table
        self.runner = runner
        self.heartbeat_s = heartbeat_s
        self.announce_s = announce_s
        self.started_at = time.time()
        self.leaving = False  # set once the process shuts down: every announcement says so
        self._last_busy = 0.0
        self._last_beat = time.monotonic()
        self.telemetry = HopTelemetryPublisher(bus)
        self.drivers = DriverWatch(bus, table)
        # directives being applied, the last one of each session (a session's run in order)
        self._applying: dict[str, asyncio.Task[None]] = {}
        layers = capability.layers
        self.probe = PeerProbe(node_id=node_id, model_revision=capability.model_revision,
                               layer_start=layers.start, layer_end=layers.end, n_layer=layers.n_layer)

    async def announce(self) -> None:
        """Publish this node's frame key (to the tracker only), then its Capability Report."""
        if self.frame_key:
            await self.bus.publish(subjects.node_key(self.node_id),
                                   NodeKey(node_id=self.node_id, key=self.frame_key.hex(), started_at=self.started_at))
        msg = NodeAnnouncement(node_id=self.node_id, activation_url=self.url, capability=self.capability,
                               started_at=self.started_at, process_id=PROCESS_ID, leaving=self.leaving,
                               protocol=PROTOCOL, window=self.window)
        await self.bus.publish(subjects.node_announce(self.node_id), msg)

    async def leave(self, timeout_s: float = 1.0) -> None:
        """Tell the trackers this node is shutting down, so no new route comes to it and its
        routes restart elsewhere at once; a bus that does not take it within `timeout_s` leaves
        it to the heartbeats' expiry."""
        self.leaving = True
        try:
            async with asyncio.timeout(timeout_s):
                await self.announce()
                await self.bus.flush(timeout=timeout_s)
        except Exception as exc:  # shutting down whatever the bus says
            log.warning("could not announce that %s is leaving: %s", self.node_id, exc)

    def heartbeat(self) -> NodeHeartbeat:
        """This node's current load, sessions and cache bytes."""
        m = self.runner.meter
        now = time.monotonic()
        load = min(1.0, (m.busy_s - self._last_busy) / max(1e-6, now - self._last_beat))
        self._last_busy, self._last_beat = m.busy_s, now
        live = list(self.table.live.values())
        cache = sum(h.cache_bytes_estimate for h in live)
        return NodeHeartbeat(
            node_id=self.node_id, load=max(0.0, load), queue_depth=m.queued,
            decode_tokens_per_second=m.decode_tps, prefill_tokens_per_second=m.prefill_tps,
            sessions=len(live), cache_bytes=cache, free_session_slots=self.table.free_slots,
            session_ids=sorted(self.table.live) if len(live) <= MAX_LISTED_SESSIONS else None,
            peer_rtt_ms=self.probe.rtt_ms(), started_at=self.started_at,
        )

    async def _announce_loop(self) -> None:
        while True:
            try:
                await self.announce()
            except Exception as exc:
                log.warning("announce failed: %s", exc)
            await asyncio.sleep(self.announce_s)

    async def _heartbeat_loop(self, sender: HeartbeatThread) -> None:
        """Hand the heartbeat thread a fresh heartbeat every interval (it publishes on its own
        schedule, so a model call holding this loop never delays a heartbeat)."""
        while True:
            sender.offer(self.heartbeat())
            await asyncio.sleep(self.heartbeat_s)

    async def _hello_loop(self) -> None:
        async with self.bus.subscribe(TRACKER_HELLO, TrackerHello) as sub:
            async for hello in sub:
                if not hello.node_ids or self.node_id in hello.node_ids:
                    await self.announce()

    async def _directive_loop(self, ready: asyncio.Event) -> None:
        """Apply each directive in a task of its own: an open waits for the engine's thread,
        behind the model call in progress, and a burst of opens must not queue behind each other
        (frames for a session wait only `grace_s` for its open). A session's directives still
        apply in the order they came (its close after its open)."""
        try:
            async with self.bus.subscribe(subjects.DIRECTIVE_ALL, RouteDirective) as sub:
                ready.set()
                async for d in sub:
                    sid = d.session.session_id
                    task = asyncio.create_task(self._apply_after(self._applying.get(sid), d), name=f"directive-{sid}")
                    self._applying[sid] = task
                    task.add_done_callback(lambda t, sid=sid: self._applying.pop(sid, None)
                                           if self._applying.get(sid) is t else None)
        finally:
            await cancel_and_wait(list(self._applying.values()))

    async def _apply_after(self, before: asyncio.Task[None] | None, d: RouteDirective) -> None:
        if before is not None:
            await asyncio.gather(before, return_exceptions=True)
        try:
            await self.apply(d)
        except Exception:
            log.exception("directive %s for session %s failed", d.action, d.session.session_id)

    async def apply(self, d: RouteDirective) -> None:
        """Open, close or abort this node's hop(s) of the directive's Route Session."""
        mine = my_hops(d.session, self.node_id, self.url)
        if not mine:
            return
        sid = d.session.session_id
        if d.action == "open":
            self.probe.on_route(d.session, mine[0])
            await self.table.open(d.session, mine[0])
            return
        if d.action == "move":
            return  # an order to the gateway driving the session: its abort (moved) follows
        if (hs := self.table.live.get(sid)) is not None and d.used_rows is not None and not d.lost_node_id:
            hs.used_rows = d.used_rows  # the rows the driver's answer used: the hop claims none beyond
        if d.action == "close":
            await self.table.end(sid, HopPhase.CLOSED, d.reason or f"close directive from {d.issued_by}")
        else:
            reason = d.reason or f"abort directive from {d.issued_by}"
            hs = self.table.live.get(sid)
            phase = hs.phase if hs is not None else "decode"
            await self.table.end(sid, HopPhase.ABORTED, reason, lost_hop_failure(d, reason, phase))

    async def report(self, hs: HopSession) -> None:
        """Publish the session's route participation and work (once, when it ends)."""
        s, hop = hs.route, hs.route.hops[hs.hop_index]
        c = hs.counters
        await self.bus.publish_audit(RouteParticipation.for_hop(s, hs.hop_index, self.node_id))
        await self.bus.publish_audit(NodeWork(
            source=self.node_id, session_id=s.session_id, route_id=s.route_id, node_id=self.node_id,
            model_revision=s.model_revision, layer_start=hop.layer_start, layer_end=hop.layer_end,
            prefill_tokens=c.prefill_tokens,
            decode_tokens=claimed_decode_rows(c.decode_tokens, hs.decode_from, hs.decode_end, hs.used_rows),
            active_param_bytes=getattr(self.runner.engine, "active_param_bytes", 0)))  # fakes in tests have none

    def tasks(self) -> Callable[[object], AsyncIterator[None]]:
        """A cleanup-context that runs every loop (directives subscribed before it yields)."""

        async def ctx(_app: object) -> AsyncIterator[None]:
            ready = asyncio.Event()
            sender = HeartbeatThread(self.bus, subjects.node_heartbeat(self.node_id), interval_s=self.heartbeat_s)
            sender.offer(self.heartbeat())
            await asyncio.to_thread(sender.start)
            loops = [
                asyncio.create_task(self._directive_loop(ready), name="directives"),
                asyncio.create_task(self._hello_loop(), name="tracker-hello"),
                asyncio.create_task(self._heartbeat_loop(sender), name="heartbeat"),
            ]
            try:
                await _until_subscribed(ready, loops[0])
            except BaseException:
                await cancel_and_wait(loops)
                await asyncio.to_thread(sender.stop)
                raise
            evidence = None
            if self.evidence is not None and self.evidence.enabled:
                evidence = await self.bus.serve(subjects.node_evidence(self.node_id), HopEvidenceRequest,
                                                self.evidence.answer)
            loops.append(asyncio.create_task(self._announce_loop(), name="announce"))
            loops.append(asyncio.create_task(self.telemetry.run(), name="hop-telemetry"))
            loops.append(asyncio.create_task(self.probe.run(self.bus), name="peer-probe"))
            loops.append(asyncio.create_task(self.drivers.run(), name="driver-watch"))
            self.table.on_ended.append(self._report_in_background)
            self.table.on_ended.append(self.telemetry.on_ended)
            self.table.on_frame.append(self.telemetry.on_frame)
            self._reports: set[asyncio.Task[None]] = set()
            try:
                yield
            finally:
                self.table.on_frame.remove(self.telemetry.on_frame)
                self.table.on_ended.remove(self.telemetry.on_ended)
                await cancel_and_wait(loops)
                if evidence is not None:
                    await evidence.stop()
                await asyncio.to_thread(sender.stop)
                if self._reports:
                    await asyncio.wait(self._reports, timeout=5.0)

        return ctx

    async def _report_in_background(self, hs: HopSession) -> None:
        task = asyncio.create_task(self._report_quietly(hs), name=f"audit-{hs.session_id}")
        self._reports.add(task)
        task.add_done_callback(self._reports.discard)

    async def _report_quietly(self, hs: HopSession) -> None:
        try:
            await self.report(hs)
        except Exception as exc:
            log.warning("audit for session %s not published: %s", hs.session_id, exc)


async def _until_subscribed(ready: asyncio.Event, directives: asyncio.Task[None], timeout_s: float = 10.0) -> None:
    """Wait until the directive subscription stands (`ready`). Its loop failing first (a bus
    closed for good) raises that failure at once, not a TimeoutError 10 s later."""
    waiting = asyncio.ensure_future(ready.wait())
    try:
        await asyncio.wait({waiting, directives}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiting.cancel()
    if ready.is_set():
        return
    if directives.done():
        directives.result()  # raises the loop's failure
        raise RuntimeError("the directive subscription ended before it stood")
    raise TimeoutError(f"the directive subscription did not stand within {timeout_s:g} s")

