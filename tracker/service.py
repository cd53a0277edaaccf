"""The Tracker: the bus edge of the control plane. It owns every subscription, responder and
task, and hands each message to the handler of its concern:

- nodes (frame keys, announcements, heartbeats, expiry): tracker/node_events.py;
- route requests, the route index and the session bucket: tracker/route_handler.py;
- route directives of other trackers and gateways: tracker/directive_handler.py;
- rebalance and spread orders: tracker/placement.py;
- the Shard Swarm's inventory: tracker/artifact_handler.py;
- validation verdicts and quarantine: tracker/quarantine_service.py;
- the Work Ledger: tracker/ledger_service.py.

They share one MeshBook (tracker/book.py): the nodes and the open routes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from bus import subjects
from bus.client import Bus, Responder, Subscription
from bus.errors import BusError
from bus.rtt import BusRtt, measure_rtt, watch_rtt
from bus.tasks import cancel_and_wait
from schemas.artifacts import (
    ArtifactHave,
    BadPieceReport,
    PeersReply,
    PeersRequest,
    RebalanceReply,
    SpareAnnouncement,
)
from schemas.base import BusMessage
from schemas.node import NodeAnnouncement, NodeHeartbeat, NodeKey
from schemas.rebalance import RebalanceDirective
from schemas.route import RouteDirective, RouteError, RouteReply, RouteRequest, RouteWithdrawal
from schemas.tracker import TrackerHello, TrackerStatus
from tracker.artifact_handler import ArtifactHandler
from tracker.asks import AskClaims
from tracker.audit_publisher import AuditPublisher
from tracker.awake import AwakeClock
from tracker.book import ActiveSession, MeshBook
from tracker.coverage import CoverageMap
from tracker.directive_handler import DirectiveHandler
from tracker.inventory import ArtifactInventory
from tracker.ledger_service import LedgerConsumer
from tracker.node_events import NodeEvents
from tracker.placement import Placement
from tracker.quarantine_service import QuarantineKeeper
from tracker.registry import Registry, RegistryConfig
from tracker.route_handler import RouteHandler
from tracker.routing import RoutingConfig
from tracker.spread import SpreadConfig
from tracker.status_view import tracker_status
from tracker.views import NodeView

log = logging.getLogger("meshnet.tracker")

M = TypeVar("M", bound=BusMessage)
# Trackers answer requests as one NATS queue group: each request reaches one live tracker.
# They share no state of their own: every tracker reads every announcement and heartbeat, and
# the open/close/abort directives of every route, whoever created it (docs/control-plane.md).
TRACKER_QUEUE = "trackers"


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


class Tracker:
    """`async with Tracker(bus, config):` runs the control plane until the block exits."""

    def __init__(
        self, bus: Bus, config: TrackerConfig | None = None, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.bus = bus
        self.config = cfg = config or TrackerConfig()
        tid = cfg.tracker_id
        # every age the tracker judges (node silence, session grace, cooldowns) is awake time:
        # a pause of its own (SIGSTOP, a blocked loop) counts for nobody's silence
        self.clock = AwakeClock(clock)
        self.rtt = BusRtt()  # its round trip to the server: what each awaited request there costs
        self.book = MeshBook(self.clock, RegistryConfig(cfg.heartbeat_interval, cfg.expire_after), cfg.target_replicas)
        self.quarantine = QuarantineKeeper(bus, tid, self.book.refresh_live)
        self.book.quarantined = self.quarantine.holds
        self.inventory = ArtifactInventory()
        self.audit = AuditPublisher(bus, tid, cfg.audit_queue)
        self.nodes = NodeEvents(bus, self.book, self.inventory, tracker_id=tid,
                                heartbeat_interval=cfg.heartbeat_interval, expire_after=cfg.expire_after,
                                hello_cooldown=cfg.hello_cooldown, session_grace=cfg.session_grace,
                                bus_rtt=self.rtt.seconds)
        self.routes = RouteHandler(bus, self.book, self.audit, tracker_id=tid, routing=cfg.routing,
                                   max_sessions=cfg.max_sessions, index_refresh=cfg.index_refresh,
                                   directives_pending=self._directives_pending)
        self.placement = Placement(bus, self.book, tracker_id=tid, expire_after=cfg.expire_after,
                                   rebalance_cooldown=cfg.rebalance_cooldown, spread=cfg.spread_config,
                                   quiet=self.nodes.rewarming)
        self.directives = DirectiveHandler(self.book, self.placement, tracker_id=tid)
        self.artifacts = ArtifactHandler(self.inventory, self.clock)
        self.ledger: LedgerConsumer | None = None
        self._stack: contextlib.AsyncExitStack | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._responders: list[Responder] = []
        self._directive_sub: Subscription[RouteDirective] | None = None

    # -- what the rest of the project reads -----------------------------------------------------

    @property
    def registry(self) -> Registry:
        return self.book.registry

    @property
    def sessions(self) -> dict[str, ActiveSession]:
        """Open routes by route id."""
        return self.book.sessions

    def views(self) -> list[NodeView]:
        return self.book.views()

    def coverage(self) -> list[CoverageMap]:
        return self.book.coverage()

    def status(self) -> TrackerStatus:
        """A snapshot for monitors: nodes, coverage, sessions (rows capped)."""
        status = tracker_status(self.config.tracker_id, self.book, self.quarantine.notices, self.clock())
        return status.model_copy(update={"bus_rtt_ms": round(self.rtt.seconds() * 1000, 1)})

    async def _on_announce(self, ann: NodeAnnouncement) -> None:
        await self.nodes.on_announce(ann)
        await self.placement.on_announce(ann)  # an ordered node serving its range ends that order's cooldown

    async def publish_status(self) -> None:
        """Publish a status snapshot on mesh.tracker.status."""
        await self.bus.publish(subjects.TRACKER_STATUS, self.status())

    async def handle_route_request(self, req: RouteRequest) -> RouteReply | None:
        return await self.routes.handle_request(req)

    # -- lifecycle ------------------------------------------------------------------------------

    async def __aenter__(self) -> Tracker:
        await self.start()
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        """Subscribe, serve route requests, start the timers, then ask every node to announce."""
        self._stack = stack = contextlib.AsyncExitStack()
        cfg = self.config
        handlers: list[tuple[str, type[BusMessage], Callable[[BusMessage], Awaitable[None]]]] = [
            (subjects.SPARE_ALL, SpareAnnouncement, self.placement.on_spare),
            (subjects.REBALANCE_REPLY_ALL, RebalanceReply, self.placement.on_rebalance_reply),
            (subjects.ARTIFACT_HAVE_ALL, ArtifactHave, self.artifacts.on_have),
            (subjects.ARTIFACT_BAD_ALL, BadPieceReport, self.artifacts.on_bad_piece),
            (subjects.NODE_KEY_ALL, NodeKey, self.nodes.on_key),
            (subjects.ANNOUNCE_ALL, NodeAnnouncement, self._on_announce),
            (subjects.HEARTBEAT_ALL, NodeHeartbeat, self.nodes.on_heartbeat),
            (subjects.DIRECTIVE_ALL, RouteDirective, self.directives.on_directive),
            (subjects.ROUTE_WITHDRAW, RouteWithdrawal, self.routes.on_withdrawal),
            (subjects.REBALANCE_ALL, RebalanceDirective, self.placement.on_rebalance_seen),
        ]  # type: ignore[list-item]
        for subject, schema, handle in handlers:
            sub = await stack.enter_async_context(self.bus.subscribe(subject, schema))
            if schema is RouteDirective:
                self._directive_sub = sub  # type: ignore[assignment]
            self._spawn(schema.__name__, self._consume(sub, handle))
        self._spawn("awake", self.clock.watch())
        await measure_rtt(self.bus, self.rtt)  # its first status already says how far its server is
        self._spawn("rtt", watch_rtt(self.bus, self.rtt))
        for i, (sub, handle) in enumerate(await self.quarantine.start(stack)):
            self._spawn(f"quarantine-{i}", self._consume(sub, handle))
        self._spawn("expiry", self._every(cfg.tick_interval, self._expire_tick))
        self._spawn("status", self._every(cfg.status_interval, self.publish_status))
        self._spawn("rebalance", self._every(cfg.rebalance_interval, self.placement.rebalance_tick))
        if cfg.spread:
            self._spawn("spread", self._every(cfg.spread_interval, self.placement.spread_tick))
        self._spawn("audit", self.audit.run())
        if cfg.ledger:
            self.ledger = LedgerConsumer(self.bus, owner=cfg.tracker_id)
            self._spawn("ledger", self.ledger.run())
        try:
            await self.bus.ensure_audit_stream()
        except Exception as exc:  # audit publishing retries on its own
            log.warning("audit stream not ready yet: %s", exc)
        await self.bus.flush()
        await self.bus.publish(subjects.TRACKER_HELLO, TrackerHello(tracker_id=cfg.tracker_id))
        await self.routes.load_sessions()
        self.routes.asks = await AskClaims.open(self.bus)
        self._spawn("session-bucket", self.routes.write_bucket())
        if cfg.warmup_s > 0:
            # a tracker joining a running group answers only once the nodes' announcements
            # (asked for by the hello) are in: before, it would refuse routes the group has
            self._spawn("serve", self._serve_after(cfg.warmup_s))
        else:
            await self._serve_requests()
        log.info("tracker %s started; asked all nodes to announce", cfg.tracker_id)

    async def _serve_requests(self) -> None:
        """Join the trackers' queue group for route and artifact-peer requests, and read every
        retried route request (the retry subject has no queue group: a frozen tracker cannot
        hold a retry from the live ones)."""
        def refusal(exc: Exception) -> RouteReply:
            return RouteReply(error=RouteError(code="bad_request", message=str(exc)[:500]))

        self._responders = [
            await self.bus.serve(subjects.ROUTE_CREATE, RouteRequest, self.routes.handle_request,
                                 queue=TRACKER_QUEUE, on_error=refusal),
            await self.bus.serve(subjects.ROUTE_RETRY, RouteRequest, self.routes.handle_retry, on_error=refusal),
            await self.bus.serve(subjects.ARTIFACT_PEERS, PeersRequest, self.artifacts.handle_peers_request,
                                 queue=TRACKER_QUEUE, on_error=lambda exc: PeersReply(artifact_id="invalid")),
        ]

    async def _serve_after(self, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        self.routes.end_loaded_of_gone_nodes()  # the nodes have announced by now
        await self._serve_requests()
        log.info("tracker %s answers route requests (%d node(s) known after %.1fs)",
                 self.config.tracker_id, len(self.book.registry), delay_s)

    async def _expire_tick(self) -> None:
        await self.nodes.expire_tick()
        self.routes.index(self.clock(), on_request=False)  # keep an expensive index fresh off the request path

    def _directives_pending(self) -> int:
        return self._directive_sub.pending if self._directive_sub is not None else 0

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
        self._directive_sub = None

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


@contextlib.asynccontextmanager
async def running_tracker(bus: Bus, config: TrackerConfig | None = None) -> AsyncIterator[Tracker]:
    """Run a Tracker on `bus` for the duration of the block."""
    tracker = Tracker(bus, config)
    await tracker.start()
    try:
        yield tracker
    finally:
        await tracker.stop()
