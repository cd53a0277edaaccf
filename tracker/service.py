"""The Tracker service: registry, route sessions, directives, rebalance and audit over the bus."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections import OrderedDict, defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from bus import subjects
from bus.client import Bus, Responder, Subscription
from bus.errors import BusError
from bus.jetstream import KeyValueStore
from bus.tasks import cancel_and_wait
from schemas.artifacts import (
    ArtifactHave,
    BadPieceReport,
    PeersReply,
    PeersRequest,
    RebalanceReply,
    SpareAnnouncement,
)
from schemas.audit import AuditEvent, RouteParticipation
from schemas.base import BusMessage
from schemas.credentials import CREDENTIAL_TTL_S
from schemas.node import NodeAnnouncement, NodeHeartbeat, NodeKey
from schemas.rebalance import RebalanceDirective
from schemas.route import RouteDirective, RouteError, RouteReply, RouteRequest, RouteSession
from schemas.tracker import (
    CoverageSummary,
    NodeSummary,
    SessionSummary,
    TrackerHello,
    TrackerStatus,
)
from tracker.asks import AskClaims, ask_expired
from tracker.awake import AwakeClock
from tracker.coverage import CoverageMap, coverage_maps
from tracker.credentials import grant_credentials
from tracker.inventory import ArtifactInventory
from tracker.ledger_service import LedgerConsumer
from tracker.quarantine_service import QuarantineKeeper
from tracker.rebalance import plan_rebalance
from tracker.registry import NodeState, Registry, RegistryConfig
from tracker.routing import RouteIndex, RoutingConfig, build_index, select_route
from tracker.spread import SpreadConfig, SpreadSession, plan_spread
from tracker.views import NodeView, SpareView, node_view, unheld_sessions

log = logging.getLogger("meshnet.tracker")

M = TypeVar("M", bound=BusMessage)
HELLO_SUBJECT = subjects.TRACKER_HELLO
STATUS_SUBJECT = subjects.TRACKER_STATUS
CHEAP_INDEX_S = 0.005  # an index that builds faster than this is rebuilt on every change
STATUS_ROWS = 200  # rows of nodes/sessions in a status snapshot (n_nodes/n_sessions are exact)
SETTLE_YIELDS = 8  # event-loop turns a capacity refusal gives the last directive taken off its queue
SETTLE_MAX_S = 0.05  # ... waiting at most this long (and SETTLE_MAX_TURNS turns) for queued ones
SETTLE_MAX_TURNS = 4096
# Trackers answer requests as one NATS queue group: each request reaches one live tracker.
# They share no state of their own: every tracker reads every announcement and heartbeat, and
# the open/close/abort directives of every route, whoever created it (docs/control-plane.md).
TRACKER_QUEUE = "trackers"
SESSION_BUCKET = "MESH_SESSIONS"  # every open route, by route id: a tracker that starts late reads them
RETRY_REFUSAL_DELAY_S = 0.1  # a refusal of a retried ask lets another tracker's route answer first
MOVE_ORDER_S = 10.0  # a move order the gateway did not follow by then (declined, or lost) is forgotten
ENDED_ROUTES = 10_000  # ended route ids remembered, so another tracker's late open cannot revive one


@dataclass(frozen=True, slots=True)
class TrackerConfig:
    """Timings and targets of the tracker (seconds)."""

    tracker_id: str = "tracker"
    heartbeat_interval: float = 1.0
    expire_after: float = 3.0
    target_replicas: int = 1
    tick_interval: float = 0.25  # how often expiry is checked
    status_interval: float = 2.0
    rebalance_interval: float = 5.0
    rebalance_cooldown: float = 30.0  # do not re-order the same range/node within this
    index_refresh: float = 0.5  # rebuild the route index for metric-only changes at most this often
    hello_cooldown: float = 2.0  # per unknown node
    # a session opened this long ago that a hop's heartbeat does not list has ended there; more
    # than a heartbeat can lag behind its node's table (nodes.server.liveness: 10 s at most)
    session_grace: float = 15.0
    max_sessions: int = 100_000
    audit_queue: int = 10_000
    warmup_s: float = 0.0  # wait this long after the hello before answering requests (meshnet tracker: 2 s)
    ledger: bool = False  # run the Work Ledger consumer (tracker/ledger_service.py); `meshnet tracker` turns it on
    # move running sessions between a range's replicas to even them out (tracker/spread.py);
    # `meshnet tracker` turns it on (--spread)
    spread: bool = False
    spread_interval: float = 0.25
    spread_config: SpreadConfig = field(default_factory=SpreadConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)


@dataclass(slots=True)
class ActiveSession:
    """A Route Session the tracker opened and nobody closed yet."""

    session: RouteSession
    opened_at: float


ID_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789"


def new_id() -> str:
    """A short url-safe id: 12 lower-case letters/digits (~62 bits), a valid NATS subject token."""
    return "".join(secrets.choice(ID_ALPHABET) for _ in range(12))


class Tracker:
    """`async with Tracker(bus, config):` runs the control plane until the block exits."""

    def __init__(
        self, bus: Bus, config: TrackerConfig | None = None, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.bus = bus
        self.config = config or TrackerConfig()
        # every age the tracker judges (node silence, session grace, cooldowns) is awake time:
        # a pause of its own (SIGSTOP, a blocked loop) counts for nobody's silence
        self.clock = AwakeClock(clock)
        self.registry = Registry(
            RegistryConfig(self.config.heartbeat_interval, self.config.expire_after)
        )
        self.sessions: dict[str, ActiveSession] = {}  # by route_id
        self._routes_by_node: dict[str, set[str]] = defaultdict(set)
        self._session_routes: dict[str, str] = {}  # session_id -> route_id
        self._ended: OrderedDict[str, None] = OrderedDict()  # route ids ended lately (ENDED_ROUTES)
        self._session_kv: KeyValueStore | None = None
        self._loaded: set[str] = set()  # routes read from the bucket, not yet seen to be on live nodes
        self._kv_writes: asyncio.Queue[tuple[str, RouteSession | None]] = asyncio.Queue()
        self._live: dict[str, int] = {}  # alive node -> free session slots
        self.frame_keys: dict[str, bytes] = {}  # node -> its frame key (meshkey.join.<node_id>)
        self.suspects: dict[str, float] = {}  # node reported lost -> when (wall clock of the report)
        self._index = RouteIndex()
        self._index_key: tuple[int, int] = (-1, -1)
        self._bus_down = False  # an expiry check found the tracker's own bus disconnected
        self._bus_silent = False  # ... or connected but not answering a round trip (a partition)
        self._reconnects = bus.reconnects  # the bus's reconnect count the last check saw
        self._index_built_at = float("-inf")
        self._index_build_s = 0.0
        self._hello_sent: dict[str, float] = {}
        self._rebalance_pending: dict[tuple[str, str, int, int], float] = {}
        self._rebalance_nodes: dict[str, float] = {}
        self._rebalance_refused: dict[tuple[str, tuple[str, str, int, int]], float] = {}
        self.spares: dict[str, tuple[SpareAnnouncement, float]] = {}  # node -> (announcement, seen at)
        self.inventory = ArtifactInventory()
        self.quarantine = QuarantineKeeper(bus, self.config.tracker_id, self._refresh_live)
        self._audit: asyncio.Queue[AuditEvent] = asyncio.Queue(maxsize=self.config.audit_queue)
        self._stack: contextlib.AsyncExitStack | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._responders: list[Responder] = []
        self._asks = AskClaims(None)
        self._route_lock = asyncio.Lock()  # one route chosen, claimed and counted at a time
        self._directives: Subscription[RouteDirective] | None = None
        self.audit_published = 0
        self.audit_dropped = 0
        self._last_loss = float("-inf")  # when a hop was last lost or a restart's route opened (spread quiet)
        self._moving: dict[str, tuple[float, str]] = {}  # Route Session ids ordered to move -> (when, off which node)
        self._spread_cooling: dict[tuple[str, str, int, int], float] = {}  # range -> last moves ordered
        self.moves_ordered = 0

    # -- lifecycle ----------------------------------------------------------------------------

    async def __aenter__(self) -> Tracker:
        await self.start()
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        """Subscribe, serve route requests, start the timers, then ask every node to announce."""
        stack = contextlib.AsyncExitStack()
        self._stack = stack
        announce = await stack.enter_async_context(
            self.bus.subscribe(subjects.ANNOUNCE_ALL, NodeAnnouncement)
        )
        heartbeat = await stack.enter_async_context(
            self.bus.subscribe(subjects.HEARTBEAT_ALL, NodeHeartbeat)
        )
        directive = await stack.enter_async_context(
            self.bus.subscribe(subjects.DIRECTIVE_ALL, RouteDirective)
        )
        keys = await stack.enter_async_context(self.bus.subscribe(subjects.NODE_KEY_ALL, NodeKey))
        spare = await stack.enter_async_context(self.bus.subscribe(subjects.SPARE_ALL, SpareAnnouncement))
        replies = await stack.enter_async_context(self.bus.subscribe(subjects.REBALANCE_REPLY_ALL, RebalanceReply))
        have = await stack.enter_async_context(self.bus.subscribe(subjects.ARTIFACT_HAVE_ALL, ArtifactHave))
        bad = await stack.enter_async_context(self.bus.subscribe(subjects.ARTIFACT_BAD_ALL, BadPieceReport))
        self._directives = directive
        self._spawn("awake", self.clock.watch())
        for i, (sub, handle) in enumerate(await self.quarantine.start(stack)):
            self._spawn(f"quarantine-{i}", self._consume(sub, handle))
        self._spawn("spare", self._consume(spare, self._on_spare))
        self._spawn("rebalance-reply", self._consume(replies, self._on_rebalance_reply))
        self._spawn("artifact-have", self._consume(have, self._on_have))
        self._spawn("artifact-bad", self._consume(bad, self._on_bad_piece))
        self._spawn("keys", self._consume(keys, self._on_key))
        self._spawn("announce", self._consume(announce, self._on_announce))
        self._spawn("heartbeat", self._consume(heartbeat, self._on_heartbeat))
        self._spawn("directive", self._consume(directive, self._on_directive))
        self._spawn("expiry", self._every(self.config.tick_interval, self._expire_tick))
        self._spawn("status", self._every(self.config.status_interval, self.publish_status))
        self._spawn("rebalance", self._every(self.config.rebalance_interval, self.rebalance_tick))
        if self.config.spread:
            self._spawn("spread", self._every(self.config.spread_interval, self.spread_tick))
        self._spawn("audit", self._audit_worker())
        self.ledger: LedgerConsumer | None = None
        if self.config.ledger:
            self.ledger = LedgerConsumer(self.bus, owner=self.config.tracker_id)
            self._spawn("ledger", self.ledger.run())
        rebalance = await stack.enter_async_context(self.bus.subscribe(subjects.REBALANCE_ALL, RebalanceDirective))
        self._spawn("rebalance-seen", self._consume(rebalance, self._on_rebalance_seen))
        try:
            await self.bus.ensure_audit_stream()
        except Exception as exc:  # audit publishing retries on its own
            log.warning("audit stream not ready yet: %s", exc)
        await self.bus.flush()
        await self.bus.publish(HELLO_SUBJECT, TrackerHello(tracker_id=self.config.tracker_id))
        await self._load_sessions()
        self._asks = await AskClaims.open(self.bus)
        self._spawn("session-bucket", self._session_writer())
        if self.config.warmup_s > 0:
            # a tracker joining a running group answers only once the nodes' announcements
            # (asked for by the hello) are in: before, it would refuse routes the group has
            self._spawn("serve", self._serve_after(self.config.warmup_s))
        else:
            await self._serve_requests()
        log.info("tracker %s started; asked all nodes to announce", self.config.tracker_id)

    async def _load_sessions(self) -> None:
        """Count the routes other trackers opened before this one started (the session bucket)."""
        try:
            self._session_kv = await KeyValueStore.open(self.bus, SESSION_BUCKET, create=True,
                                                        ttl_s=CREDENTIAL_TTL_S)  # no route outlives its credentials
            stored = await self._session_kv.items()
        except Exception as exc:  # no JetStream yet: directives still tell it of new routes
            log.warning("session bucket unavailable: %s", exc)
            return
        now = self.clock()
        for value in stored.values():
            try:
                s = RouteSession.model_validate(value)
            except ValueError:
                continue
            if s.route_id not in self.sessions and s.session_id not in self._session_routes:
                self._begin_session(s, now)
                self._loaded.add(s.route_id)
        if stored:
            log.info("tracker %s: %d open route(s) from the session bucket", self.config.tracker_id, len(stored))

    async def _session_writer(self) -> None:
        """Puts and deletes of the session bucket, in order, off the request path."""
        while True:
            route_id, session = await self._kv_writes.get()
            try:
                if self._session_kv is not None:
                    if session is not None:
                        await self._session_kv.put_json(route_id, session.model_dump(mode="json"))
                    else:
                        await self._session_kv.delete(route_id)
            except Exception as exc:
                log.warning("session bucket %s of %s failed: %s", "put" if session else "delete", route_id, exc)

    async def _serve_requests(self) -> None:
        """Join the trackers' queue group for route and artifact-peer requests, and read every
        retried route request (the retry subject has no queue group: a frozen tracker cannot
        hold a retry from the live ones)."""
        def refusal(exc: Exception) -> RouteReply:
            return RouteReply(error=RouteError(code="bad_request", message=str(exc)[:500]))

        self._responders = [
            await self.bus.serve(subjects.ROUTE_CREATE, RouteRequest, self.handle_route_request,
                                 queue=TRACKER_QUEUE, on_error=refusal),
            await self.bus.serve(subjects.ROUTE_RETRY, RouteRequest, self.handle_route_retry, on_error=refusal),
            await self.bus.serve(subjects.ARTIFACT_PEERS, PeersRequest, self.handle_peers_request,
                                 queue=TRACKER_QUEUE, on_error=lambda exc: PeersReply(artifact_id="invalid")),
        ]

    async def _serve_after(self, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        for route_id in sorted(self._loaded):  # the nodes have announced by now
            active = self.sessions.get(route_id)
            if active is not None and any(self.registry.get(h.node_id) is None for h in active.session.hops):
                self._end_session(route_id)  # a route of a node gone meanwhile (an earlier run's)
        self._loaded.clear()
        await self._serve_requests()
        log.info("tracker %s answers route requests (%d node(s) known after %.1fs)",
                 self.config.tracker_id, len(self.registry), delay_s)

    async def stop(self) -> None:
        """Stop serving, cancel and await every task, close subscriptions."""
        for responder in self._responders:
            await responder.stop()
        self._responders = []
        await self.quarantine.stop()
        await cancel_and_wait(self._tasks)
        self._tasks.clear()
        if self._stack is not None:
            await self._stack.aclose()
            self._stack = None
        self._directives = None

    def _spawn(self, name: str, coro: Awaitable[None]) -> None:
        self._tasks.append(asyncio.create_task(coro, name=f"tracker:{name}"))  # type: ignore[arg-type]

    async def _consume(self, sub: Subscription[M], handle: Callable[[M], Awaitable[None]]) -> None:
        async for msg in sub:
            try:
                await handle(msg)
            except BusError as exc:
                log.warning("bus error while handling %s: %s", type(msg).__name__, exc)
            except Exception:
                log.exception("handler failed for %s", type(msg).__name__)

    async def _every(self, interval: float, tick: Callable[[], Awaitable[object]]) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await tick()
            except BusError as exc:
                log.warning("periodic %s: bus error: %s", getattr(tick, "__name__", tick), exc)
            except Exception:
                log.exception("periodic %s failed", getattr(tick, "__name__", tick))

    # -- registry -----------------------------------------------------------------------------

    async def _on_key(self, msg: NodeKey) -> None:
        # only X's own login may publish on meshkey.join.X (nats.conf), and the subscription
        # drops a key whose node_id disagrees with its subject (bus.subjects.binding_error)
        key = bytes.fromhex(msg.key)
        if self.frame_keys.get(msg.node_id) != key:
            self.frame_keys[msg.node_id] = key
            log.info("frame key of node %s %s", msg.node_id, "changed" if msg.node_id in self._live else "received")
        self._refresh_live(msg.node_id)

    async def _on_announce(self, ann: NodeAnnouncement) -> None:
        result = self.registry.announce(ann, self.clock())
        self._clear_suspicion(ann.node_id, ann.ts)
        self._refresh_live(ann.node_id)
        if result != "refreshed":
            cap = ann.capability
            log.info(
                "node %s %s: %s %s layers %s at %s",
                ann.node_id, "joined" if result == "new" else "changed",
                cap.model_name, cap.model_revision[:12], cap.layers, ann.activation_url,
            )  # fmt: skip

    async def _on_rebalance_seen(self, d: RebalanceDirective) -> None:
        """Another tracker's order: that need and that node are taken, as if we had ordered it."""
        if d.issued_by == self.config.tracker_id or d.model_revision is None:
            return
        spare = self.spares.get(d.node_id)
        abi = spare[0].cache_abi if spare else next(
            (v.cache_abi for v in self.views() if v.model_revision == d.model_revision), "")
        now = self.clock()
        self._rebalance_pending[(d.model_revision, abi, d.layer_start, d.layer_end)] = now
        self._rebalance_nodes[d.node_id] = now

    async def _on_spare(self, msg: SpareAnnouncement) -> None:
        if msg.node_id not in self.spares:
            log.info("spare %s joined: can load layers of %s (%s)", msg.node_id, msg.model, msg.artifact_id[:12])
        self.spares[msg.node_id] = (msg, self.clock())

    async def _on_rebalance_reply(self, msg: RebalanceReply) -> None:
        need = next((k for k in self._rebalance_pending
                     if k[0] == msg.model_revision and k[2:] == (msg.layer_start, msg.layer_end)), None)
        if msg.accepted:
            log.info("rebalance: %s accepted layers [%d,%d)", msg.node_id, msg.layer_start, msg.layer_end)
            if need is not None:  # it is fetching and loading now: the cooldown starts again
                self._rebalance_pending[need] = self.clock()
            self._rebalance_nodes[msg.node_id] = self.clock()
            return
        log.warning("rebalance: %s refused layers [%d,%d) (%s): %s; asking another node",
                    msg.node_id, msg.layer_start, msg.layer_end, msg.code, msg.message)
        if need is not None:
            self._rebalance_refused[(msg.node_id, need)] = self.clock()
            self._rebalance_pending.pop(need, None)
        self._rebalance_nodes.pop(msg.node_id, None)
        await self.rebalance_tick()

    async def _on_have(self, msg: ArtifactHave) -> None:
        self.inventory.update(msg, self.clock())

    async def _on_bad_piece(self, msg: BadPieceReport) -> None:
        n = self.inventory.report_bad(msg)
        log.warning("artifact %s: %s reports a bad piece %s from %s (%s); %d bad from that peer",
                    msg.artifact_id[:12], msg.node_id, msg.piece_id[:16], msg.peer_node_id, msg.reason, n)

    def handle_peers_request(self, req: PeersRequest) -> PeersReply:
        """Who seeds an artifact (the asker left out; peers reported bad listed last)."""
        return self.inventory.peers(req.artifact_id, exclude=req.node_id, now=self.clock())

    def spare_views(self) -> list[SpareView]:
        """Live spares (heard from within the node expiry) that serve nothing yet."""
        now = self.clock()
        out = []
        for node_id, (a, seen) in list(self.spares.items()):
            if now - seen > self.config.expire_after or self.registry.get(node_id) is not None:
                del self.spares[node_id]  # gone, or serving now
                continue
            out.append(SpareView(node_id, a.artifact_id, a.model, a.model_revision, a.cache_abi, a.n_layer,
                                 a.memory_bytes, a.disk_bytes))
        return out

    async def _on_heartbeat(self, hb: NodeHeartbeat) -> None:
        now = self.clock()
        if self.registry.heartbeat(hb, now):
            self._clear_suspicion(hb.node_id, hb.ts)
            if hb.session_ids is not None:
                self._end_unheld(hb.node_id, hb.session_ids, now)
            self._refresh_live(hb.node_id)
            return
        last = self._hello_sent.get(hb.node_id, float("-inf"))
        if now - last >= self.config.hello_cooldown:
            self._hello_sent[hb.node_id] = now
            log.info("heartbeat from unknown node %s: asking it to announce", hb.node_id)
            await self.bus.publish(
                HELLO_SUBJECT, TrackerHello(tracker_id=self.config.tracker_id, node_ids=[hb.node_id])
            )

    def _end_unheld(self, node_id: str, held: list[str], now: float) -> None:
        """End the sessions a node's heartbeat shows it no longer holds: their close (or abort)
        directive never reached this tracker, e.g. published while it was reconnecting."""
        actives = [self.sessions.get(r) for r in self._routes_by_node.get(node_id, ())]
        opened = [(a.session.session_id, a.opened_at) for a in actives if a is not None]
        for sid in unheld_sessions(set(held), opened, now, self.config.session_grace):
            route_id = self._session_routes.get(sid)
            if route_id is not None and self._end_session(route_id) is not None:
                log.warning("session %s is no longer held by node %s and no close reached the tracker: "
                            "ended", sid, node_id)

    def _clear_suspicion(self, node_id: str, sent_at: float) -> None:
        """A node reported lost is back once it speaks again after the report."""
        reported = self.suspects.get(node_id)
        if reported is not None and sent_at > reported:
            del self.suspects[node_id]
            log.info("node %s is heard from again after it was reported lost", node_id)

    def _refresh_live(self, node_id: str) -> None:
        state = self.registry.get(node_id)
        if state is None or node_id in self.suspects or node_id not in self.frame_keys \
                or self.quarantine.holds(node_id):
            # no frame key: frames to it could carry no credential, so it is not routable yet;
            # a quarantined node computed wrong activations (replay verdicts): no new routes
            self._live.pop(node_id, None)
            return
        self._live[node_id] = node_view(state, len(self._routes_by_node.get(node_id, ()))).free_slots

    def rewarming(self) -> bool:
        """True for two heartbeat intervals after a pause of the tracker's own: heartbeats sent
        meanwhile may still wait unread, so no node expires and no rebalance is ordered until
        every live node has been heard from since."""
        return self.clock.since_wake() < 2 * self.config.heartbeat_interval

    async def _expire_tick(self) -> None:
        if self._bus_outage() or self.rewarming():
            return
        now = self.clock()
        if (self._bus_silent or self.registry.expired(now)) and not await self._bus_answers():
            return  # the silence may be this tracker's own: judged again once the bus answers
        self.inventory.expire(now)
        for state in self.registry.expire(now):
            self.inventory.forget_node(state.node_id)
            await self._node_lost(state, f"node {state.node_id} expired: no heartbeat for {state.age(now):.1f}s")
        self._route_index(now, on_request=False)  # keep an expensive index fresh off the request path

    async def _bus_answers(self) -> bool:
        """Whether the server answers a round trip now. Before expiring a node the tracker asks:
        across a network partition its connection stays open (no reset reaches either end) and
        only goes silent, so every node would seem silent while the fault is the tracker's. An
        unanswered round trip counts as an outage, as a disconnect does (`_bus_outage`): once the bus answers again,
        every node gets `expire_after` to be heard from, as after a reconnect."""
        try:
            await self.bus.flush(timeout=min(1.0, self.config.expire_after / 3))  # bounded in all
        except (BusError, OSError) as exc:
            if not self._bus_silent:
                log.warning("tracker bus gave no answer to a round trip (%s): no node expires until it does", exc)
            self._bus_silent = True
            return False
        if self._bus_silent:
            self._bus_silent = False
            self.registry.excuse(self.clock())
            log.info("tracker bus answers again: every node has %.1fs to be heard from", self.config.expire_after)
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
            self.registry.excuse(self.clock())
            log.info("tracker bus reconnected: every node has %.1fs to be heard from again",
                     self.config.expire_after)
        return False

    async def _node_lost(self, state: NodeState, reason: str) -> None:
        self._last_loss = self.clock()
        self._live.pop(state.node_id, None)
        self.suspects.pop(state.node_id, None)
        routes = sorted(self._routes_by_node.pop(state.node_id, set()))
        log.warning("%s; aborting %d session(s)", reason, len(routes))
        for route_id in routes:
            active = self.sessions.get(route_id)
            if active is None:
                continue
            directive = RouteDirective(
                action="abort", session=active.session, reason=reason, issued_by=self.config.tracker_id,
                lost_node_id=state.node_id,
            )
            self._end_session(route_id)
            await self.bus.publish(subjects.route_directive(route_id), directive)

    def views(self) -> list[NodeView]:
        """Every live node as plain data, with free slots as the tracker sees them."""
        return [node_view(s, len(self._routes_by_node.get(s.node_id, ()))) for s in self.registry]

    def coverage(self) -> list[CoverageMap]:
        """The Coverage Map of every model revision served right now."""
        return coverage_maps(self.views(), self.config.target_replicas)

    # -- routes -------------------------------------------------------------------------------

    def _route_index(self, now: float, *, on_request: bool = True) -> RouteIndex:
        """The route index, rebuilt when the registry changed. A cheap index (small registry)
        is rebuilt at once; an expensive one at most every `index_refresh` seconds, off the
        request path (liveness stays exact meanwhile: routing checks the live map)."""
        key = (self.registry.version, self.registry.metrics_version)
        if key == self._index_key:
            return self._index
        cheap = self._index_build_s < CHEAP_INDEX_S
        due = now - self._index_built_at >= self.config.index_refresh
        structural = key[0] != self._index_key[0]
        if (structural and cheap) or (due and (cheap or not on_request)):
            started = time.perf_counter()
            self._index = build_index(self.views(), self.config.routing)
            self._index_build_s = time.perf_counter() - started
            self._index_key = key
            self._index_built_at = now
        return self._index

    async def handle_route_retry(self, req: RouteRequest) -> RouteReply:
        """A request asked again of every tracker: the asker takes the first answer, so a
        refusal waits RETRY_REFUSAL_DELAY_S and a route another tracker gives wins the race
        (a refusal still comes when every tracker refuses)."""
        reply = await self.handle_route_request(req)
        if reply.error is not None:
            await asyncio.sleep(RETRY_REFUSAL_DELAY_S)
        return reply

    async def handle_route_request(self, req: RouteRequest) -> RouteReply:
        """Create a Route Session (publishing its open directive first) or reply a typed error."""
        now = self.clock()
        session_id = req.session_id or new_id()
        try:
            subjects.session_telemetry(session_id)
        except ValueError:
            return RouteReply(error=RouteError(code="bad_request", message=f"bad session_id {session_id!r}"))
        if session_id in self._session_routes:
            active = self.sessions.get(self._session_routes[session_id])
            again = self._give_again(req, active.session) if active is not None else None
            if again is not None:
                return again
            return RouteReply(
                error=RouteError(code="bad_request", message=f"session {session_id} already has a route")
            )
        if ask_expired(req, time.time()):  # read by a tracker that was frozen for longer than a claim lasts
            return RouteReply(error=RouteError(code="bad_request", message="route request too old"))
        if len(self.sessions) >= self.config.max_sessions:
            return RouteReply(error=RouteError(code="no_capacity", message="tracker session limit reached"))
        async with self._route_lock:  # the claim is awaited between choosing the route and counting it
            return await self._open_route(req, session_id, now)

    async def _open_route(self, req: RouteRequest, session_id: str, now: float) -> RouteReply:
        """Choose, claim and count a route for `req`, publish its open directive, reply."""
        def route() -> RouteSession | RouteError:
            return select_route(
                self._route_index(now), req, session_id=session_id, route_id=new_id(), live=self._live,
                config=self.config.routing,
            )

        result = route()
        if isinstance(result, RouteError) and result.code == "no_capacity":
            await self._settle_directives()
            result = route()
        if isinstance(result, RouteError):
            log.info("route for %s refused: %s %s", req.model, result.code, result.message)
            return RouteReply(error=result)
        result = result.model_copy(update={"request_id": req.request_id, "moved": req.move})
        result, credentials = grant_credentials(result, self.frame_keys, int(time.time()) + CREDENTIAL_TTL_S)
        holder = await self._asks.claim(result)
        if holder.route_id != result.route_id:  # another copy of this ask opened a route first
            again = self._give_again(req, holder)
            return again or RouteReply(error=RouteError(code="bad_request",
                                                        message=f"request {req.request_id} has a route"))
        self._begin_session(result, now)
        self._kv_writes.put_nowait((result.route_id, result))
        directive = RouteDirective(action="open", session=result, issued_by=self.config.tracker_id)
        await self.bus.publish(subjects.route_directive(result.route_id), directive)
        self._queue_audit(result)
        log.info(
            "route %s for session %s: %s",
            result.route_id, session_id,
            " -> ".join(f"{h.node_id}[{h.layer_start},{h.layer_end})" for h in result.hops),
        )  # fmt: skip
        return RouteReply(session=result, credentials=credentials)  # to the requester's inbox only

    def _give_again(self, req: RouteRequest, s: RouteSession) -> RouteReply | None:
        """The reply to a request asked again (a gateway whose first ask went to a tracker that
        died or froze before answering, and whose route some tracker had opened): the same route
        and its credentials, derived again from the frame keys. None if the request differs."""
        same = (bool(req.request_id) and req.request_id == s.request_id and s.epoch == req.epoch
                and s.sampling == req.sampling and req.model in (s.model, s.model_revision))
        if not same or not s.expires_at or any(h.node_id not in self.frame_keys for h in s.hops):
            return None
        session, credentials = grant_credentials(s, self.frame_keys, s.expires_at)
        log.info("route %s of session %s given again (asked twice)", s.route_id, s.session_id)
        return RouteReply(session=session, credentials=credentials)

    async def _settle_directives(self) -> None:
        """Let the directive consumer apply the close/abort directives delivered before this
        request: a gateway publishes a session's close, then asks for the next route on the
        same connection, and the close passes a few event-loop turns between the socket and
        `_on_directive`. The slot it frees is then free for that very request. Bounded."""
        deadline = time.monotonic() + SETTLE_MAX_S
        idle = 0  # turns since the directive queue was last seen empty
        for _ in range(SETTLE_MAX_TURNS):
            await asyncio.sleep(0)
            queued = self._directives.pending if self._directives is not None else 0
            idle = 0 if queued else idle + 1
            if idle >= SETTLE_YIELDS or time.monotonic() >= deadline:
                return

    def _begin_session(self, session: RouteSession, now: float) -> None:
        self.sessions[session.route_id] = ActiveSession(session, now)
        self._session_routes[session.session_id] = session.route_id
        if session.epoch > 1 and not session.moved:
            self._last_loss = now  # a restart's rebuild is running: no move for a while
        for hop in session.hops:
            self._routes_by_node[hop.node_id].add(session.route_id)
            self._refresh_live(hop.node_id)

    def _end_session(self, route_id: str) -> ActiveSession | None:
        active = self.sessions.pop(route_id, None)
        if active is None:
            return None
        self._ended[route_id] = None  # an open directive seen late (or twice) never revives it
        self._kv_writes.put_nowait((route_id, None))
        if len(self._ended) > ENDED_ROUTES:
            self._ended.popitem(last=False)
        self._session_routes.pop(active.session.session_id, None)
        for hop in active.session.hops:
            routes = self._routes_by_node.get(hop.node_id)
            if routes is not None:
                routes.discard(route_id)
                if not routes:
                    del self._routes_by_node[hop.node_id]
            self._refresh_live(hop.node_id)
        return active

    async def _on_directive(self, directive: RouteDirective) -> None:
        if directive.issued_by == self.config.tracker_id:
            return
        if directive.action == "open":  # another tracker's route: count it as if it were ours
            s = directive.session
            if s.route_id not in self.sessions and s.route_id not in self._ended \
                    and s.session_id not in self._session_routes:
                self._begin_session(s, self.clock())
            return
        lost = directive.lost_node_id
        if directive.action == "move":  # another tracker's order: its range waits as if it were ours
            if lost:
                self._moving[directive.session.session_id] = (self.clock(), lost)
                self._cool_range_of(directive.session, lost)
            return
        if directive.action == "abort" and lost and not directive.moved:
            self._last_loss = self.clock()
        if directive.action == "abort" and lost and not directive.moved and self.registry.get(lost) is not None:
            # a gateway lost this hop mid-session: no new route goes through it until it is
            # heard from again (a dead node never is, and expires as usual)
            self.suspects[lost] = directive.ts
            self._live.pop(lost, None)
            log.warning("node %s reported lost by %s (%s): out of new routes until heard from again",
                        lost, directive.issued_by, directive.reason)
        if self._end_session(directive.session.route_id) is not None:
            log.info(
                "session %s %sd by %s%s",
                directive.session.session_id, directive.action, directive.issued_by,
                f": {directive.reason}" if directive.reason else "",
            )  # fmt: skip

    # -- audit --------------------------------------------------------------------------------

    def _queue_audit(self, session: RouteSession) -> None:
        for i in range(len(session.hops)):
            event = RouteParticipation.for_hop(session, i, self.config.tracker_id)
            try:
                self._audit.put_nowait(event)
            except asyncio.QueueFull:
                self.audit_dropped += 1
                log.error("audit queue full: dropped route participation of %s", session.route_id)

    async def _audit_worker(self) -> None:
        while True:
            event = await self._audit.get()
            try:
                await self.bus.publish_audit(event)
                self.audit_published += 1
            except BusError as exc:
                self.audit_dropped += 1
                log.error("audit event %s lost: %s", event.event_id, exc)
            finally:
                self._audit.task_done()

    async def audit_drained(self) -> None:
        """Wait until every queued audit event was acknowledged or given up."""
        await self._audit.join()

    # -- rebalance and status -----------------------------------------------------------------

    async def rebalance_tick(self) -> list[RebalanceDirective]:
        """Order spare/redundant nodes to load gaps and under-provisioned ranges."""
        if self.rewarming():  # another tracker's orders may still wait unread
            return []
        now = self.clock()
        cooldown = self.config.rebalance_cooldown
        self._rebalance_pending = {k: t for k, t in self._rebalance_pending.items() if now - t < cooldown}
        self._rebalance_nodes = {k: t for k, t in self._rebalance_nodes.items() if now - t < cooldown}
        self._rebalance_refused = {k: t for k, t in self._rebalance_refused.items() if now - t < cooldown}
        views = self.views()
        spares = self.spare_views()
        busy = set(self._rebalance_nodes) | {n for n, r in self._routes_by_node.items() if r}
        offered = [(sp.model, sp.model_revision, sp.cache_abi, sp.n_layer) for sp in spares]
        # only nodes that act on orders are asked: spares, and serving nodes that said so (spare=True)
        willing = [v for v in views if v.spare]
        orders = plan_rebalance(
            willing, coverage_maps(views, self.config.target_replicas, offered),
            busy_nodes=busy, pending=set(self._rebalance_pending), spares=spares,
            refused=set(self._rebalance_refused),
        )  # fmt: skip
        sent: list[RebalanceDirective] = []
        for order in orders:
            need = order.need
            directive = RebalanceDirective(
                node_id=order.node_id,
                model=need.model,
                model_revision=need.model_revision,
                n_layer=need.n_layer,
                layer_start=need.start,
                layer_end=need.end,
                reason=need.reason,
                artifact_id=order.artifact_id,
                issued_by=self.config.tracker_id,
            )
            await self.bus.publish(subjects.rebalance(order.node_id), directive)
            self._rebalance_pending[need.key] = now
            self._rebalance_nodes[order.node_id] = now
            log.info("rebalance: %s -> load [%d,%d) (%s)", order.node_id, need.start, need.end, need.reason)
            sent.append(directive)
        return sent

    async def spread_tick(self) -> list[RouteDirective]:
        """Order moves that even out sessions over each range's replicas (tracker/spread.py):
        never while a restart's rebuild may still run (`quiet_s` after the last loss)."""
        cfg = self.config.spread_config
        now = self.clock()
        if self.rewarming() or now - self._last_loss < cfg.quiet_s:
            return []
        self._moving = {k: m for k, m in self._moving.items() if now - m[0] < MOVE_ORDER_S}
        self._spread_cooling = {k: t for k, t in self._spread_cooling.items() if now - t < cfg.cooldown_s}
        sessions = [SpreadSession(a.session.route_id, a.opened_at, tuple(h.node_id for h in a.session.hops))
                    for a in self.sessions.values()]
        moving = {a.session.route_id: self._moving[a.session.session_id][1] for a in self.sessions.values()
                  if a.session.session_id in self._moving}
        moves = plan_spread(self.views(), sessions, live=self._live, now=now, config=cfg,
                            cooling=self._spread_cooling, moving=moving)
        sent: list[RouteDirective] = []
        for m in moves:
            active = self.sessions.get(m.route_id)
            if active is None:
                continue
            a, b = m.range_key[2], m.range_key[3]
            directive = RouteDirective(
                action="move", session=active.session, lost_node_id=m.from_node, issued_by=self.config.tracker_id,
                reason=f"spreading sessions of layers [{a},{b}): {m.from_node} holds "
                       f"{len(self._routes_by_node.get(m.from_node, ()))}, {m.to_node} "
                       f"{len(self._routes_by_node.get(m.to_node, ()))}")
            self._moving[active.session.session_id] = (now, m.from_node)
            self._spread_cooling[m.range_key] = now
            await self.bus.publish(subjects.route_directive(m.route_id), directive)
            log.info("move session %s off %s (%s)", active.session.session_id, m.from_node, directive.reason)
            self.moves_ordered += 1
            sent.append(directive)
        return sent

    def _cool_range_of(self, session: RouteSession, node_id: str | None) -> None:
        """The range of `session`'s hop on `node_id` had moves ordered now (by another tracker)."""
        hop = next((h for h in session.hops if h.node_id == node_id), None)
        if hop is not None:
            self._spread_cooling[(session.model_revision, session.cache_abi, hop.layer_start,
                                  hop.layer_end)] = self.clock()

    def status(self) -> TrackerStatus:
        """A snapshot for monitors: nodes, coverage, sessions (rows capped)."""
        now = self.clock()
        nodes = sorted(self.registry, key=lambda s: s.node_id)
        return TrackerStatus(
            tracker_id=self.config.tracker_id,
            n_nodes=len(nodes),
            nodes=[_node_summary(s, now) for s in nodes[:STATUS_ROWS]],
            coverage=[_coverage_summary(m) for m in self.coverage()],
            n_sessions=len(self.sessions),
            quarantined=sorted(self.quarantine.notices),
            sessions=[
                SessionSummary(
                    session_id=a.session.session_id,
                    route_id=a.session.route_id,
                    model=a.session.model,
                    nodes=[h.node_id for h in a.session.hops],
                    age_s=round(now - a.opened_at, 3),
                )
                for a in list(self.sessions.values())[:STATUS_ROWS]
            ],
        )

    async def publish_status(self) -> None:
        """Publish a status snapshot on mesh.tracker.status."""
        await self.bus.publish(STATUS_SUBJECT, self.status())


def _node_summary(state: NodeState, now: float) -> NodeSummary:
    cap, hb = state.capability, state.heartbeat
    return NodeSummary(
        node_id=state.node_id,
        model=cap.model_name,
        layer_start=cap.layers.start,
        layer_end=cap.layers.end,
        n_layer=cap.layers.n_layer,
        decode_tokens_per_second=(hb.decode_tokens_per_second if hb else cap.decode_tokens_per_second),
        sessions=hb.sessions if hb else 0,
        cache_bytes=hb.cache_bytes if hb else 0,
        free_session_slots=hb.free_session_slots if hb else cap.max_sessions,
        age_s=round(state.age(now), 3),
    )


def _coverage_summary(m: CoverageMap) -> CoverageSummary:
    return CoverageSummary(
        model=m.model,
        model_revision=m.model_revision,
        cache_abi=m.cache_abi,
        n_layer=m.n_layer,
        status=m.status,
        routable=m.routable,
        min_replicas=m.min_replicas,
        target_replicas=m.target,
        gaps=list(m.gaps),
        under_provisioned=list(m.under_provisioned),
    )


@contextlib.asynccontextmanager
async def running_tracker(bus: Bus, config: TrackerConfig | None = None) -> AsyncIterator[Tracker]:
    """Run a Tracker on `bus` for the duration of the block."""
    tracker = Tracker(bus, config)
    await tracker.start()
    try:
        yield tracker
    finally:
        await tracker.stop()
