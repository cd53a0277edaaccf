"""NodeEvents: a tracker's handler of what nodes say about themselves (frame keys,
announcements, heartbeats) and of their silence (expiry, judged only while the tracker's own
bus answers)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from bus import subjects
from bus.client import Bus
from bus.errors import BusError
from schemas.node import NodeAnnouncement, NodeHeartbeat, NodeKey
from schemas.route import RouteDirective
from schemas.tracker import TrackerHello
from tracker.book import MeshBook
from tracker.inventory import ArtifactInventory
from tracker.registry import NodeState
from tracker.views import unheld_sessions

log = logging.getLogger("meshnet.tracker")


def answer_wait_s(expire_after: float, bus_rtt_s: float) -> float:
    """How long the round trip that precedes an expiry may take (pure): a third of the expiry
    (at most 1 s) plus two of the round trips measured before (a partition's never comes, a
    distant bus's does). Without them a tracker 1 s from its server, or 300 ms with jitter,
    took its own slow PONG for a partition and expired no node, or excused them all again."""
    return min(1.0, expire_after / 3) + 2 * bus_rtt_s


class NodeEvents:
    """Keeps the book's nodes current; aborts the routes of a node that went silent."""

    def __init__(self, bus: Bus, book: MeshBook, inventory: ArtifactInventory, *, tracker_id: str,
                 heartbeat_interval: float, expire_after: float, hello_cooldown: float,
                 session_grace: float, bus_rtt: Callable[[], float] = lambda: 0.0) -> None:
        self.bus = bus
        self.bus_rtt = bus_rtt  # this tracker's measured round trip to its server, in seconds (bus/rtt.py)
        self.book = book
        self.inventory = inventory
        self.tracker_id = tracker_id
        self.heartbeat_interval = heartbeat_interval
        self.expire_after = expire_after
        self.hello_cooldown = hello_cooldown  # per unknown node
        self.session_grace = session_grace
        self._hello_sent: dict[str, float] = {}
        self._bus_down = False  # an expiry check found the tracker's own bus disconnected
        self._bus_silent = False  # ... or connected but not answering a round trip (a partition)
        self._reconnects = bus.reconnects  # the bus's reconnect count the last check saw

    async def on_key(self, msg: NodeKey) -> None:
        # only X's own login may publish on meshkey.join.X (nats.conf), and the subscription
        # drops a key whose node_id disagrees with its subject (bus.subjects.binding_error)
        key = bytes.fromhex(msg.key)
        if self.book.registry.older_process(msg.node_id, msg.started_at):
            return  # a second process with the registered one's id: frames keep the registered key
        if self.book.frame_keys.get(msg.node_id) != key:
            self.book.frame_keys[msg.node_id] = key
            log.info("frame key of node %s %s", msg.node_id, "changed" if msg.node_id in self.book.live else "received")
        self.book.refresh_live(msg.node_id)

    async def on_announce(self, ann: NodeAnnouncement) -> None:
        if ann.leaving:
            await self._leave(ann)
            return
        result = self.book.registry.announce(ann, self.book.clock())
        if result == "refused":
            state = self.book.registry.get(ann.node_id)
            log.error("node id %s is announced by two live processes: keeping the newer one at %s, refusing "
                      "the one started earlier at %s (give each node its own --node-id)", ann.node_id,
                      state.announcement.activation_url if state else "?", ann.activation_url)
            return
        self._clear_suspicion(ann.node_id, self.book.clock(), ann.started_at)
        self.book.refresh_live(ann.node_id)
        if result != "refreshed":
            cap = ann.capability
            log.info(
                "node %s %s: %s %s layers %s at %s",
                ann.node_id, "joined" if result == "new" else "changed",
                cap.model_name, cap.model_revision[:12], cap.layers, ann.activation_url,
            )  # fmt: skip

    async def _leave(self, ann: NodeAnnouncement) -> None:
        """A node shutting down: out of every new route now, its routes aborted as a loss of it
        (their gateways restart them elsewhere), not routed to until its heartbeats expire."""
        state = self.book.registry.leave(ann.node_id, ann.started_at)
        if state is not None:
            self.inventory.forget_node(ann.node_id)
            await self.node_lost(state, f"node {ann.node_id} left the mesh (shutting down)")

    async def on_heartbeat(self, hb: NodeHeartbeat) -> None:
        now = self.book.clock()
        if self.book.registry.heartbeat(hb, now):
            self._clear_suspicion(hb.node_id, now, hb.started_at)
            if hb.session_ids is not None:
                self._end_unheld(hb.node_id, hb.session_ids, now)
            self.book.refresh_live(hb.node_id)
            return
        if self.book.registry.older_process(hb.node_id, hb.started_at):
            return  # a second process with a registered id: refused at its announcements
        last = self._hello_sent.get(hb.node_id, float("-inf"))
        if now - last >= self.hello_cooldown:
            self._hello_sent[hb.node_id] = now
            log.info("heartbeat from unknown node %s: asking it to announce", hb.node_id)
            await self.bus.publish(subjects.TRACKER_HELLO, TrackerHello(tracker_id=self.tracker_id, node_ids=[hb.node_id]))

    def _clear_suspicion(self, node_id: str, heard_at: float, started_at: float) -> None:
        """`heard_at`: when this tracker read the node's message, on the clock its reports are
        read on (the node's own `ts` is another machine's clock); `started_at`: its process's."""
        if self.book.clear_suspicion(node_id, heard_at, started_at):
            log.info("node %s is heard from again after it was reported lost", node_id)

    def _end_unheld(self, node_id: str, held: list[str], now: float) -> None:
        """End the sessions a node's heartbeat shows it no longer holds: their close (or abort)
        directive never reached this tracker, e.g. published while it was reconnecting."""
        actives = [self.book.sessions.get(r) for r in self.book.routes_by_node.get(node_id, ())]
        opened = [(a.session.session_id, a.opened_at) for a in actives if a is not None]
        for sid in unheld_sessions(set(held), opened, now, self.session_grace):
            route_id = self.book.session_routes.get(sid)
            if route_id is not None and self.book.end_session(route_id) is not None:
                log.warning("session %s is no longer held by node %s and no close reached the tracker: "
                            "ended", sid, node_id)

    def rewarming(self) -> bool:
        """True for two heartbeat intervals after a pause of the tracker's own: heartbeats sent
        meanwhile may still wait unread, so no node expires and no rebalance is ordered until
        every live node has been heard from since."""
        return self.book.clock.since_wake() < 2 * self.heartbeat_interval

    async def expire_tick(self) -> None:
        """Expire the nodes not heard from within `expire_after` and abort their routes."""
        if self._bus_outage() or self.rewarming():
            return
        now = self.book.clock()
        if (self._bus_silent or self.book.registry.expired(now)) and not await self._bus_answers():
            return  # the silence may be this tracker's own: judged again once the bus answers
        self.inventory.expire(now)
        for state in self.book.registry.expire(now):
            self.inventory.forget_node(state.node_id)
            await self.node_lost(state, f"node {state.node_id} expired: no heartbeat for {state.age(now):.1f}s")

    async def _bus_answers(self) -> bool:
        """Whether the server answers a round trip now. Before expiring a node the tracker asks:
        across a network partition its connection stays open (no reset reaches either end) and
        only goes silent, so every node would seem silent while the fault is the tracker's. An
        unanswered round trip counts as an outage, as a disconnect does (`_bus_outage`): once
        the bus answers again, every node gets `expire_after` to be heard from, as after a
        reconnect."""
        try:
            await self.bus.flush(timeout=answer_wait_s(self.expire_after, self.bus_rtt()))  # bounded in all
        except (BusError, OSError) as exc:
            if not self._bus_silent:
                log.warning("tracker bus gave no answer to a round trip (%s): no node expires until it does", exc)
            self._bus_silent = True
            return False
        if self._bus_silent:
            self._bus_silent = False
            self.book.registry.excuse(self.book.clock())
            log.info("tracker bus answers again: every node has %.1fs to be heard from", self.expire_after)
            return False
        return True

    def _bus_outage(self) -> bool:
        """True while the tracker's own bus is down: no heartbeat can reach it, so nobody is
        judged by their absence. The first check after a reconnect (seen as a disconnected
        check, or as a changed reconnect count when the outage fell between two checks)
        counts every node as heard from now: each gets `expire_after` to be heard again."""
        if not self.bus.is_connected:
            if not self._bus_down:
                log.warning("tracker bus disconnected: no node expires until it is back")
            self._bus_down = True
            return True
        if self._bus_down or self.bus.reconnects != self._reconnects:
            self._bus_down, self._reconnects, self._bus_silent = False, self.bus.reconnects, False
            self.book.registry.excuse(self.book.clock())
            log.info("tracker bus reconnected: every node has %.1fs to be heard from again", self.expire_after)
        return False

    async def node_lost(self, state: NodeState, reason: str) -> None:
        """A node is gone: out of the live map, and an abort directive for each of its routes."""
        book = self.book
        book.last_loss = book.clock()
        book.forget_node(state.node_id)
        routes = sorted(book.routes_by_node.pop(state.node_id, set()))
        log.warning("%s; aborting %d session(s)", reason, len(routes))
        for route_id in routes:
            active = book.sessions.get(route_id)
            if active is None:
                continue
            directive = RouteDirective(
                action="abort", session=active.session, reason=reason, issued_by=self.tracker_id,
                lost_node_id=state.node_id,
            )
            book.end_session(route_id)
            await self.bus.publish(subjects.route_directive(route_id), directive)
