"""Placement: a tracker's handler of where shards and sessions should be. It orders spare or
willing nodes to load uncovered and under-provisioned ranges (tracker/rebalance.py plans) and
orders running sessions to move between a range's replicas to even them out (tracker/spread.py
plans), and follows the same orders from other trackers."""

from __future__ import annotations

import logging
from collections.abc import Callable

from bus import subjects
from bus.client import Bus
from schemas.artifacts import RebalanceReply, SpareAnnouncement
from schemas.node import NodeAnnouncement
from schemas.protocol import needs
from schemas.rebalance import RebalanceDirective
from schemas.route import RouteDirective, RouteSession
from tracker.book import MeshBook
from tracker.rebalance import plan_rebalance
from tracker.spread import SpreadConfig, SpreadSession, plan_spread
from tracker.views import SpareView

log = logging.getLogger("meshnet.tracker")

MOVE_ORDER_S = 10.0  # a move order the gateway did not follow by then (declined, or lost) is forgotten
RangeKey = tuple[str, str, int, int]  # (model revision, cache ABI, start, end)


class Placement:
    """Rebalance orders (with cooldowns per range and per node, and refusals remembered) and
    spread moves (with a cooldown per range). Nothing is ordered while `quiet()` is True."""

    def __init__(self, bus: Bus, book: MeshBook, *, tracker_id: str, expire_after: float,
                 rebalance_cooldown: float, spread: SpreadConfig, quiet: Callable[[], bool]) -> None:
        self.bus = bus
        self.book = book
        self.tracker_id = tracker_id
        self.expire_after = expire_after
        self.rebalance_cooldown = rebalance_cooldown  # do not re-order the same range/node within this
        self.spread = spread
        self.quiet = quiet  # the tracker is rewarming after a pause: other trackers' orders may wait unread
        self.spares: dict[str, tuple[SpareAnnouncement, float]] = {}  # node -> (announcement, seen at)
        self._pending: dict[RangeKey, float] = {}
        self._ordered: dict[RangeKey, str] = {}  # pending need -> the node ordered to load it
        self._nodes: dict[str, float] = {}
        self._refused: dict[tuple[str, RangeKey], float] = {}
        self._too_large: set[tuple[str, RangeKey]] = set()  # the refusals for memory or disk (of _refused)
        self._moving: dict[str, tuple[float, str]] = {}  # Route Session ids ordered to move -> (when, off which node)
        self._cooling: dict[RangeKey, float] = {}  # range -> last moves ordered
        self.moves_ordered = 0

    # -- rebalance ------------------------------------------------------------------------------

    async def on_rebalance_seen(self, d: RebalanceDirective) -> None:
        """Another tracker's order: that need and that node are taken, as if we had ordered it."""
        if d.issued_by == self.tracker_id or d.model_revision is None:
            return
        spare = self.spares.get(d.node_id)
        abi = spare[0].cache_abi if spare else next(
            (v.cache_abi for v in self.book.views() if v.model_revision == d.model_revision), "")
        now = self.book.clock()
        self._pending[(d.model_revision, abi, d.layer_start, d.layer_end)] = now
        self._ordered[(d.model_revision, abi, d.layer_start, d.layer_end)] = d.node_id
        self._nodes[d.node_id] = now

    async def on_spare(self, msg: SpareAnnouncement) -> None:
        if msg.node_id not in self.spares:
            log.info("spare %s joined: can load layers of %s (%s)", msg.node_id, msg.model, msg.artifact_id[:12])
        self.spares[msg.node_id] = (msg, self.book.clock())

    async def on_rebalance_reply(self, msg: RebalanceReply) -> None:
        need = next((k for k in self._pending
                     if k[0] == msg.model_revision and k[2:] == (msg.layer_start, msg.layer_end)), None)
        if msg.accepted:
            log.info("rebalance: %s accepted layers [%d,%d)", msg.node_id, msg.layer_start, msg.layer_end)
            if need is not None:  # it is fetching and loading now: the cooldown starts again
                self._pending[need] = self.book.clock()
            self._nodes[msg.node_id] = self.book.clock()
            return
        log.warning("rebalance: %s refused layers [%d,%d) (%s): %s; asking another node",
                    msg.node_id, msg.layer_start, msg.layer_end, msg.code, msg.message)
        if need is not None:
            self._refused[(msg.node_id, need)] = self.book.clock()
            if msg.code in ("insufficient_memory", "insufficient_disk"):
                self._too_large.add((msg.node_id, need))
            self._pending.pop(need, None)
        self._nodes.pop(msg.node_id, None)
        await self.rebalance_tick()

    def spare_views(self) -> list[SpareView]:
        """Live spares (heard from within the node expiry) that serve nothing yet."""
        now = self.book.clock()
        out = []
        for node_id, (a, seen) in list(self.spares.items()):
            if now - seen > self.expire_after or self.book.registry.get(node_id) is not None:
                del self.spares[node_id]  # gone, or serving now
                continue
            out.append(SpareView(node_id, a.artifact_id, a.model, a.model_revision, a.cache_abi, a.n_layer,
                                 a.memory_bytes, a.disk_bytes))
        return out

    async def on_announce(self, ann: NodeAnnouncement) -> None:
        """A node that announces the range it was ordered to load has carried the order out:
        the cooldown covers its fetch and load only, so a range that loses that node again is
        ordered to another at the next tick, not after the rest of the cooldown."""
        if ann.leaving:
            return
        cap = ann.capability
        key = (cap.model_revision, cap.cache_abi, cap.layers.start, cap.layers.end)
        if self._ordered.get(key) == ann.node_id:
            self._pending.pop(key, None)
            self._nodes.pop(ann.node_id, None)
            del self._ordered[key]

    async def rebalance_tick(self) -> list[RebalanceDirective]:
        """Order spare/redundant nodes to load gaps and under-provisioned ranges."""
        if self.quiet():
            return []
        now = self.book.clock()
        cooldown = self.rebalance_cooldown
        self._pending = {k: t for k, t in self._pending.items() if now - t < cooldown}
        self._ordered = {k: n for k, n in self._ordered.items() if k in self._pending}
        self._nodes = {k: t for k, t in self._nodes.items() if now - t < cooldown}
        self._refused = {k: t for k, t in self._refused.items() if now - t < cooldown}
        self._too_large &= set(self._refused)
        spares = self.spare_views()
        busy = set(self._nodes) | {n for n, r in self.book.routes_by_node.items() if r}
        offered = [(sp.model, sp.model_revision, sp.cache_abi, sp.n_layer) for sp in spares]
        # only nodes that act on orders are asked: spares, and serving nodes that said so (spare=True)
        willing = [v for v in self.book.views() if v.spare]
        orders = plan_rebalance(willing, self.book.coverage(offered), busy_nodes=busy, pending=set(self._pending),
                                spares=spares, refused=set(self._refused), too_large=self._too_large)
        sent: list[RebalanceDirective] = []
        for order in orders:
            need = order.need
            directive = RebalanceDirective(
                node_id=order.node_id, model=need.model, model_revision=need.model_revision, n_layer=need.n_layer,
                layer_start=need.start, layer_end=need.end, reason=need.reason, artifact_id=order.artifact_id,
                issued_by=self.tracker_id,
            )
            await self.bus.publish(subjects.rebalance(order.node_id), directive)
            self._pending[need.key] = now
            self._ordered[need.key] = order.node_id
            self._nodes[order.node_id] = now
            log.info("rebalance: %s -> load [%d,%d) (%s)", order.node_id, need.start, need.end, need.reason)
            sent.append(directive)
        return sent

    # -- spread ---------------------------------------------------------------------------------

    async def spread_tick(self) -> list[RouteDirective]:
        """Order moves that even out sessions over each range's replicas (tracker/spread.py):
        never while a restart's rebuild may still run (`quiet_s` after the last loss)."""
        cfg = self.spread
        now = self.book.clock()
        if self.quiet() or now - self.book.last_loss < cfg.quiet_s:
            return []
        self._moving = {k: m for k, m in self._moving.items() if now - m[0] < MOVE_ORDER_S}
        self._cooling = {k: t for k, t in self._cooling.items() if now - t < cfg.cooldown_s}
        actives = self.book.sessions.values()
        sessions = [SpreadSession(a.session.route_id, a.opened_at, tuple(h.node_id for h in a.session.hops),
                                  a.session.head_rtt_ms, needs(a.session.sampling)[0]) for a in actives]
        moving = {a.session.route_id: self._moving[a.session.session_id][1] for a in actives
                  if a.session.session_id in self._moving}
        moves = plan_spread(self.book.views(), sessions, live=self.book.live, now=now, config=cfg,
                            cooling=self._cooling, moving=moving)
        sent: list[RouteDirective] = []
        for m in moves:
            active = self.book.sessions.get(m.route_id)
            if active is None:
                continue
            a, b = m.range_key[2], m.range_key[3]
            directive = RouteDirective(
                action="move", session=active.session, lost_node_id=m.from_node, issued_by=self.tracker_id,
                reason=f"spreading sessions of layers [{a},{b}): {m.from_node} holds "
                       f"{self.book.route_count(m.from_node)}, {m.to_node} {self.book.route_count(m.to_node)}")
            self._moving[active.session.session_id] = (now, m.from_node)
            self._cooling[m.range_key] = now
            await self.bus.publish(subjects.route_directive(m.route_id), directive)
            log.info("move session %s off %s (%s)", active.session.session_id, m.from_node, directive.reason)
            self.moves_ordered += 1
            sent.append(directive)
        return sent

    def move_seen(self, session: RouteSession, node_id: str) -> None:
        """Another tracker ordered `session` off `node_id`: its range waits as if we had."""
        now = self.book.clock()
        self._moving[session.session_id] = (now, node_id)
        hop = next((h for h in session.hops if h.node_id == node_id), None)
        if hop is not None:
            self._cooling[(session.model_revision, session.cache_abi, hop.layer_start, hop.layer_end)] = now
