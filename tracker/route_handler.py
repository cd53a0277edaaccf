"""RouteHandler: a tracker's answers to route requests. It chooses a route (tracker/routing.py,
pure), claims the ask across the tracker group, grants credentials, counts the route in the
book, stores it in the session bucket and publishes its open directive."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable

from bus import subjects
from bus.client import Bus
from bus.jetstream import KeyValueStore
from schemas.credentials import CREDENTIAL_TTL_S
from schemas.route import (
    SESSION_HAS_ROUTE,
    RouteDirective,
    RouteError,
    RouteErrorCode,
    RouteReply,
    RouteRequest,
    RouteSession,
    RouteWithdrawal,
)
from tracker.asks import AskClaims, ClaimUnsettled, ask_expired, skew_note
from tracker.audit_publisher import AuditPublisher
from tracker.book import MeshBook
from tracker.credentials import grant_credentials
from tracker.routing import RouteIndex, RoutingConfig, build_index, select_route

log = logging.getLogger("meshnet.tracker")

CHEAP_INDEX_S = 0.005  # an index that builds faster than this is rebuilt on every change
SETTLE_YIELDS = 8  # event-loop turns a capacity refusal gives the last directive taken off its queue
SETTLE_MAX_S = 0.12  # ... waiting at most this long (and SETTLE_MAX_TURNS turns) for queued ones
SETTLE_MAX_TURNS = 4096
SESSION_BUCKET = "MESH_SESSIONS"  # every open route, by route id: a tracker that starts late reads them
RETRY_REFUSAL_DELAY_S = 0.1  # a refusal of a retried ask lets another tracker's route answer first
ID_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789"
WITHDRAWN_KEPT = 10_000  # request ids given up on, remembered (the oldest forgotten first)


def new_id() -> str:
    """A short url-safe id: 12 lower-case letters/digits (~62 bits), a valid NATS subject token."""
    return "".join(secrets.choice(ID_ALPHABET) for _ in range(12))


def _refusal(code: RouteErrorCode, message: str) -> RouteReply:
    return RouteReply(error=RouteError(code=code, message=message))


def with_siblings_named(error: RouteError, siblings: frozenset[str]) -> RouteError:
    """A refusal that says which nodes were left out only as shards of an excluded node's
    process (pure): without it a validator's "no route without a, b" read "missing layers
    [0,30)" while the nodes serving those layers were up, excluded as siblings."""
    if not siblings or error.code not in ("no_coverage", "no_capacity"):
        return error
    note = f" (also left out: {', '.join(sorted(siblings))}, served by the same processes as the excluded nodes)"
    return error.model_copy(update={"message": error.message + note})


class RouteHandler:
    """Route requests and retries; the route index; the session bucket."""

    def __init__(self, bus: Bus, book: MeshBook, audit: AuditPublisher, *, tracker_id: str,
                 routing: RoutingConfig, max_sessions: int, index_refresh: float,
                 directives_pending: Callable[[], int]) -> None:
        self.bus = bus
        self.book = book
        self.audit = audit
        self.tracker_id = tracker_id
        self.routing = routing
        self.max_sessions = max_sessions
        self.index_refresh = index_refresh  # rebuild the index for metric-only changes at most this often
        self.directives_pending = directives_pending  # directives delivered but not yet handled
        self.asks = AskClaims(None)
        self._lock = asyncio.Lock()  # one route chosen, claimed and counted at a time
        self._index = RouteIndex()
        self._index_key: tuple[int, int] = (-1, -1)
        self._index_built_at = float("-inf")
        self._index_build_s = 0.0
        self._bucket: KeyValueStore | None = None
        self.loaded: set[str] = set()  # routes read from the bucket, not yet seen to be on live nodes
        self._withdrawn: OrderedDict[str, None] = OrderedDict()  # request ids their askers gave up on
        self._skew_logged: set[str] = set()  # drivers whose clock skew was logged

    # -- the session bucket ---------------------------------------------------------------------

    async def load_sessions(self) -> None:
        """Count the routes other trackers opened before this one started (the session bucket)."""
        try:
            self._bucket = await KeyValueStore.open(self.bus, SESSION_BUCKET, create=True,
                                                    ttl_s=CREDENTIAL_TTL_S)  # no route outlives its credentials
            stored = await self._bucket.items()
        except Exception as exc:  # no JetStream yet: directives still tell it of new routes
            log.warning("session bucket unavailable: %s", exc)
            return
        now = self.book.clock()
        for value in stored.values():
            try:
                s = RouteSession.model_validate(value)
            except ValueError:
                continue
            if s.route_id not in self.book.sessions and s.session_id not in self.book.session_routes:
                self.book.begin_session(s, now)
                self.loaded.add(s.route_id)
        if stored:
            log.info("tracker %s: %d open route(s) from the session bucket", self.tracker_id, len(stored))

    def end_loaded_of_gone_nodes(self) -> None:
        """After the warm-up: end the loaded routes of nodes that did not announce (an earlier run's)."""
        for route_id in sorted(self.loaded):
            active = self.book.sessions.get(route_id)
            if active is not None and any(self.book.registry.get(h.node_id) is None for h in active.session.hops):
                self.book.end_session(route_id)
        self.loaded.clear()

    async def write_bucket(self) -> None:
        """Puts and deletes of the session bucket, in order, off the request path (a task)."""
        while True:
            route_id, session = await self.book.bucket_writes.get()
            try:
                if self._bucket is not None:
                    if session is not None:
                        await self._bucket.put_json(route_id, session.model_dump(mode="json"))
                    else:
                        await self._bucket.delete(route_id)
            except Exception as exc:
                log.warning("session bucket %s of %s failed: %s", "put" if session else "delete", route_id, exc)

    # -- the route index ------------------------------------------------------------------------

    def index(self, now: float, *, on_request: bool = True) -> RouteIndex:
        """The route index, rebuilt when the registry changed. A cheap index (small registry)
        is rebuilt at once; an expensive one at most every `index_refresh` seconds, off the
        request path (liveness stays exact meanwhile: routing checks the live map)."""
        registry = self.book.registry
        key = (registry.version, registry.metrics_version)
        if key == self._index_key:
            return self._index
        cheap = self._index_build_s < CHEAP_INDEX_S
        due = now - self._index_built_at >= self.index_refresh
        structural = key[0] != self._index_key[0]
        if (structural and cheap) or (due and (cheap or not on_request)):
            started = time.perf_counter()
            self._index = build_index(self.book.views(), self.routing)
            self._index_build_s = time.perf_counter() - started
            self._index_key = key
            self._index_built_at = now
        return self._index

    # -- requests -------------------------------------------------------------------------------

    async def handle_retry(self, req: RouteRequest) -> RouteReply | None:
        """A request asked again of every tracker: the asker takes the first answer, so a
        refusal waits RETRY_REFUSAL_DELAY_S and a route another tracker gives wins the race
        (a refusal still comes when every tracker refuses)."""
        reply = await self.handle_request(req)
        if reply is not None and reply.error is not None:
            await asyncio.sleep(RETRY_REFUSAL_DELAY_S)
        return reply

    async def handle_request(self, req: RouteRequest) -> RouteReply | None:
        """Create a Route Session (publishing its open directive first) or reply a typed error;
        None (no reply) when its claim went unanswered (tracker/asks.py)."""
        now = self.book.clock()
        session_id = req.session_id or new_id()
        try:
            subjects.session_telemetry(session_id)
        except ValueError:
            return _refusal("bad_request", f"bad session_id {session_id!r}")
        if (refused := self._withdrawn_refusal(req)) is not None:  # read after its asker gave up
            return refused
        if session_id in self.book.session_routes:
            active = self.book.sessions.get(self.book.session_routes[session_id])
            again = self._give_again(req, active.session) if active is not None else None
            return again or _refusal("bad_request", f"session {session_id} {SESSION_HAS_ROUTE}")
        if (refused := self._stale_refusal(req, time.time())) is not None:
            return refused
        if len(self.book.sessions) >= self.max_sessions:
            return _refusal("no_capacity", "tracker session limit reached")
        async with self._lock:  # the claim is awaited between choosing the route and counting it
            return await self._open_route(req, session_id, now)

    def _stale_refusal(self, req: RouteRequest, now_wall: float) -> RouteReply | None:
        """A refusal of an ask read by a tracker that was frozen for longer than a claim lasts;
        an ask whose stamp is far off this tracker's clock otherwise is served and the skew logged."""
        unread = self.book.clock.unread_max_s()
        if ask_expired(req, now_wall, unread):
            return _refusal("bad_request", f"route request too old: stamped {now_wall - req.ts:.0f}s before this "
                            f"tracker read it, after a pause of {self.book.clock.last_pause_s:.0f}s")
        if (note := skew_note(req, now_wall)) is not None and req.driver_id not in self._skew_logged:
            if len(self._skew_logged) >= 1024:
                self._skew_logged.clear()
            self._skew_logged.add(req.driver_id)  # once per driver: one bad clock is one line
            log.warning(note)
        return None

    async def _open_route(self, req: RouteRequest, session_id: str, now: float) -> RouteReply | None:
        """Choose, claim and count a route for `req`, publish its open directive, reply."""
        # a restart leaves out the hop it lost, and the other shards of that hop's process with it
        siblings = frozenset(n for lost in req.policy.exclude_nodes for n in self.book.registry.siblings(lost))

        def route() -> RouteSession | RouteError:
            return select_route(self.index(now), req, session_id=session_id, route_id=new_id(),
                                live=self.book.live, config=self.routing, exclude=siblings)

        result = route()
        if isinstance(result, RouteError) and result.code == "no_capacity":
            await self._settle_directives()
            result = route()
        if isinstance(result, RouteError) and result.code == "no_coverage" and self.book.suspects:
            result = self._held(req, result, siblings, now)
        if isinstance(result, RouteError):
            result = with_siblings_named(result, siblings - frozenset(req.policy.exclude_nodes))
            log.info("route for %s refused: %s %s", req.model, result.code, result.message)
            return RouteReply(error=result)
        result = result.model_copy(update={"request_id": req.request_id, "moved": req.move, "driver_id": req.driver_id,
                                           "head_rtt_ms": req.head_rtt_ms})
        result, credentials = grant_credentials(result, self.book.frame_keys, int(time.time()) + CREDENTIAL_TTL_S)
        try:
            holder = await self.asks.claim(result)
        except ClaimUnsettled as exc:  # the asker hears nothing and asks every tracker again
            log.warning("%s: no route opened, no answer sent", exc)
            return None
        if (refused := self._withdrawn_refusal(req)) is not None:  # withdrawn while this copy waited
            return refused
        if holder.route_id != result.route_id:  # another copy of this ask opened a route first
            return self._give_again(req, holder) or _refusal("bad_request", f"request {req.request_id} has a route")
        self.book.begin_session(result, now)
        self.book.bucket_writes.put_nowait((result.route_id, result))
        directive = RouteDirective(action="open", session=result, issued_by=self.tracker_id)
        await self.bus.publish(subjects.route_directive(result.route_id), directive)
        self.audit.queue(result)
        log.info("route %s for session %s: %s", result.route_id, session_id,
                 " -> ".join(f"{h.node_id}[{h.layer_start},{h.layer_end})" for h in result.hops))
        return RouteReply(session=result, credentials=credentials)  # to the requester's inbox only

    def _held(self, req: RouteRequest, error: RouteError, siblings: frozenset[str], now: float) -> RouteError:
        """A `no_coverage` that only nodes held out after a reported loss cause names them and
        the longest hold left (`RouteError.held_nodes`, `held_s`): the asker may wait for them.
        A node that is gone for good expires and is no suspect any more: the refusal is plain."""
        found = select_route(self.index(now), req, session_id=req.session_id or "held", route_id="held",
                             live=self.book.live_with_suspects(), config=self.routing, exclude=siblings)
        if isinstance(found, RouteError) and found.code != "no_capacity":
            return error
        held = sorted(n for n in self.book.suspects if isinstance(found, RouteError)
                      or any(h.node_id == n for h in found.hops))
        held_s = max((self.book.hold_left(n, now) for n in held), default=0.0)
        return error.model_copy(update={
            "held_nodes": held, "held_s": round(held_s, 3),
            "message": f"{error.message} (held out after a reported loss: {', '.join(held)}; "
                       f"hold left {held_s:.1f} s, then until heard from again)"})

    def _withdrawn_refusal(self, req: RouteRequest) -> RouteReply | None:
        """The refusal of a request its asker withdrew (it may be read late: a frozen tracker,
        asks the bus delivers after an outage, a copy that waited for the lock), else None."""
        if req.request_id not in self._withdrawn:
            return None
        return _refusal("bad_request", f"route request {req.request_id} was withdrawn by its asker")

    async def on_withdrawal(self, msg: RouteWithdrawal) -> None:
        """An asker gave up on a request (gateway/routing.py): refuse it from now on, and close a
        route already opened for it, which nobody will drive (its hops would hold its slots
        until their idle lease)."""
        self._withdrawn[msg.request_id] = None
        if len(self._withdrawn) > WITHDRAWN_KEPT:
            self._withdrawn.popitem(last=False)
        opened = [a.session for a in self.book.sessions.values() if a.session.request_id == msg.request_id]
        for s in opened:
            self.book.end_session(s.route_id)
            reason = f"route request withdrawn by its asker: {msg.reason}"
            await self.bus.publish(subjects.route_directive(s.route_id),
                                   RouteDirective(action="close", session=s, reason=reason, issued_by=self.tracker_id))
            log.info("route %s of session %s closed: %s", s.route_id, s.session_id, reason)

    def _give_again(self, req: RouteRequest, s: RouteSession) -> RouteReply | None:
        """The reply to a request asked again (a gateway whose first ask went to a tracker that
        died or froze before answering, and whose route some tracker had opened): the same route
        and its credentials, derived again from the frame keys. None if the request differs."""
        same = (bool(req.request_id) and req.request_id == s.request_id and s.epoch == req.epoch
                and s.sampling == req.sampling and req.model in (s.model, s.model_revision))
        if not same or not s.expires_at or any(h.node_id not in self.book.frame_keys for h in s.hops):
            return None
        session, credentials = grant_credentials(s, self.book.frame_keys, s.expires_at)
        log.info("route %s of session %s given again (asked twice)", s.route_id, s.session_id)
        return RouteReply(session=session, credentials=credentials)

    async def _settle_directives(self) -> None:
        """Let the directive consumer apply the close/abort directives delivered before this
        request: a gateway publishes a session's close, then asks for the next route on the
        same connection, and the close passes a few event-loop turns between the socket and
        the directive handler. The slot it frees is then free for that very request. Bounded."""
        deadline = time.monotonic() + SETTLE_MAX_S
        idle = 0  # turns since the directive queue was last seen empty
        for _ in range(SETTLE_MAX_TURNS):
            await asyncio.sleep(0)
            idle = 0 if self.directives_pending() else idle + 1
            if idle >= SETTLE_YIELDS or time.monotonic() >= deadline:
                return
