"""Bus: a thin typed layer over nats-py (publish, subscribe, request/serve, audit via JetStream)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Generic, TypeVar

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription as NatsSubscription
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig

from bus import subjects
from bus.errors import (
    AuditPublishError,
    BusClosedError,
    BusConnectError,
    BusError,
    BusNoRespondersError,
    BusPermissionError,
    BusTimeoutError,
    parse_permission_error,
)
from bus.port_probe import http_port_hint, scheme_problem, speaks_http
from bus.tasks import cancel_and_wait
from schemas.audit import AuditEvent
from schemas.base import BusMessage, SchemaError
from schemas.registry import parse_message

log = logging.getLogger("meshnet.bus")

M = TypeVar("M", bound=BusMessage)
Q = TypeVar("Q", bound=BusMessage)

AUDIT_STREAM = subjects.AUDIT_STREAM
DEFAULT_MAX_PENDING = 10_000  # messages buffered per subscription before the client drops
RECENT_ERRORS = 64
CONNECT_LOG_S = 10.0  # while no server answers a first connect, its error is logged this often
UNSUBSCRIBE_TIMEOUT_S = 2.0  # longest an unsubscribe may take before its owner goes on
NO_RESPONDERS_STATUS = "503"  # the server's status reply to a request nobody is subscribed to


class Subscription(Generic[M]):
    """An open subscription: iterate it for validated models; bad messages are logged and skipped."""

    def __init__(
        self,
        bus: Bus,
        subject: str,
        decode: Callable[[bytes, str], M],
        *,
        queue: str | None = None,
        max_pending: int = DEFAULT_MAX_PENDING,
    ) -> None:
        self.subject = subject
        self.last_subject: str | None = None
        self.schema_errors: collections.deque[SchemaError] = collections.deque(maxlen=RECENT_ERRORS)
        self.n_schema_errors = 0
        self._bus = bus
        self._decode = decode
        self._queue = queue
        self._max_pending = max_pending
        self._sub: NatsSubscription | None = None

    async def __aenter__(self) -> Subscription[M]:
        self._sub = await self._bus._nats_subscribe(self.subject, self._queue, self._max_pending)
        return self

    async def __aexit__(self, *_exc: object) -> None:
        sub, self._sub = self._sub, None
        if sub is not None:
            await _unsubscribe(sub)

    @property
    def pending(self) -> int:
        """Messages delivered by the server and not yet consumed."""
        return self._sub.pending_msgs if self._sub is not None else 0

    def __aiter__(self) -> AsyncIterator[M]:
        return self._models()

    async def _models(self) -> AsyncIterator[M]:
        async for _subject, msg in self.with_subjects():
            yield msg

    async def with_subjects(self) -> AsyncIterator[tuple[str, M]]:
        """Iterate (subject, model) pairs."""
        if self._sub is None:
            raise BusClosedError(f"subscription to {self.subject!r} is not open (use `async with`)")
        async for raw in self._sub.messages:
            try:
                msg = self._decode(raw.data, raw.subject)
                mismatch = subjects.binding_error(raw.subject, msg)
                if mismatch is not None:  # e.g. node B's announcement on node A's subject
                    raise SchemaError(mismatch, kind="subject_mismatch", subject=raw.subject)
            except SchemaError as exc:
                if exc.kind == "other_type":  # another message family on a shared subject
                    continue
                self.n_schema_errors += 1
                self.schema_errors.append(exc)
                log.warning("skipped %s message on %s: %s", exc.kind, raw.subject, exc)
                continue
            self.last_subject = raw.subject
            yield raw.subject, msg

    async def next(self, timeout: float | None = None) -> M:
        """The next valid message (raises TimeoutError after `timeout` seconds)."""
        async with asyncio.timeout(timeout):
            async for msg in self:
                return msg
        raise BusClosedError(f"subscription to {self.subject!r} ended")


def connection_node_id(role: str, node_id: str | None, name: str | None) -> str | None:
    """The node id a connection goes by (pure): given, else a node's `name` when that is a
    subject token, else a random `anon-…` one; None for the other roles."""
    if role != "node":
        return None
    if node_id is not None:
        return node_id
    if name is not None and subjects.is_token(name):
        return name
    return f"anon-{uuid.uuid4().hex[:8]}"


async def _unsubscribe(sub: NatsSubscription) -> None:
    """Unsubscribe, bounded: nats-py can wait on its own flusher here, and a caller shutting
    down must not hang on it (the connection's close cleans up)."""
    with contextlib.suppress(Exception):
        async with asyncio.timeout(UNSUBSCRIBE_TIMEOUT_S):
            await sub.unsubscribe()


class Responder:
    """A request/reply responder owned by a Bus; stop() ends it."""

    def __init__(self, subject: str, task: asyncio.Task[None], sub: NatsSubscription) -> None:
        self.subject = subject
        self._task = task
        self._sub = sub

    async def stop(self) -> None:
        """Unsubscribe and wait for the serving task to end."""
        await _unsubscribe(self._sub)
        await cancel_and_wait([self._task])


def _drop_socket(nc: nats.NATS) -> None:
    """Close the socket of a client whose connect failed or was cancelled. nats-py may have
    marked it closed before closing its socket (a refused login cancels the connect mid-close),
    and then its own close() does nothing."""
    transport = getattr(nc, "_transport", None)  # nats-py keeps it private
    if transport is not None:
        with contextlib.suppress(Exception):
            transport.close()


def describe_error(exc: BaseException) -> str:
    """An exception as a log line can show it: its message, or its type where the message is
    empty (a connect to a server that accepts TCP but never answers fails with a bare
    TimeoutError, which printed as nothing at all)."""
    text = str(exc)
    if text:
        return text
    if isinstance(exc, TimeoutError):
        return "TimeoutError (no answer from the server)"
    return type(exc).__name__


def _connect_callbacks(holder: dict[str, Bus], label: str, url: str, connecting: asyncio.Task[Any] | None,
                       refused: list[str], user: str | None = None) -> dict[str, Any]:
    """nats-py's callbacks for Bus.connect: errors go to the Bus once it exists (`holder`);
    before, an authorization violation, or a first timeout from a server that answers HTTP (the
    monitoring port), cancels the `connecting` task with its reason in `refused` (retrying cannot help)."""

    tries = {"n": 0, "said_at": float("-inf"), "probed": False}  # failed connects, last logged, HTTP probe done

    def give_up(reason: str) -> None:
        if not refused and connecting is not None:
            refused.append(reason)
            connecting.cancel()

    async def on_error(exc: Exception) -> None:
        bus = holder.get("bus")
        if bus is not None:
            bus._on_async_error(exc)
            return
        if "authorization violation" in str(exc).lower():
            # a wrong user or password: retrying cannot help, so the first connect gives up
            give_up(f"{exc} (user {user!r}: check the NATS user and password)")
            return
        if isinstance(exc, TimeoutError) and not tries["probed"] and connecting is not None:
            tries["probed"] = True  # once: a NATS server not up yet, or frozen, is still waited for
            if await speaks_http(url):
                give_up(http_port_hint())
                return
        if not refused:  # no server yet: it retries every reconnect_wait, and says so every CONNECT_LOG_S
            tries["n"] += 1
            now = time.monotonic()
            if now - tries["said_at"] >= CONNECT_LOG_S:
                tries["said_at"] = now
                log.warning("nats error during connect to %s: %s (waiting for the server; %d tries so far)",
                            url, describe_error(exc), tries["n"])

    async def on_disconnect() -> None:
        bus = holder.get("bus")
        if bus is None or not bus._closed:
            log.info("bus %s disconnected from %s (reconnecting)", label, url)

    async def on_reconnect() -> None:
        bus = holder.get("bus")
        if bus is not None:
            bus._up.set()
        log.info("bus %s reconnected to %s", label, url)

    async def on_closed() -> None:  # for good (close(), or nats-py gave up): wake waiters
        bus = holder.get("bus")
        if bus is not None:
            bus._up.set()
            if not bus._closed:
                bus._gave_up()


    return {"error_cb": on_error, "disconnected_cb": on_disconnect, "reconnected_cb": on_reconnect,
            "closed_cb": on_closed}


class Bus:
    """A reconnecting NATS connection speaking typed, versioned JSON messages."""

    def __init__(
        self, nc: NatsClient, *, url: str, role: str, name: str | None, node_id: str | None = None
    ) -> None:
        self.url = url
        self.role = role
        self.name = name
        self.node_id = node_id  # set for role "node": the id its subjects and inbox carry
        self.permission_errors: collections.deque[BusPermissionError] = collections.deque(
            maxlen=RECENT_ERRORS
        )
        self.errors: collections.deque[str] = collections.deque(maxlen=RECENT_ERRORS)
        self._nc = nc
        self._js = nc.jetstream()
        self._responders: set[Responder] = set()
        self._audit_stream_ready = False
        self._closed = False
        self._up = asyncio.Event()  # set while connected, and once closed (to wake waiters)
        self._up.set()
        # set when nats-py closed the connection for good by itself (a server -ERR it does not
        # retry, such as a control line too long): no reconnect follows, so the process ends
        # (`until_stopped`) and its supervisor starts it again, instead of living on without a bus
        self.lost = asyncio.Event()
        self._credentials: tuple[str | None, str | None] = (None, None)

    @classmethod
    async def connect(
        cls,
        url: str,
        *,
        role: str = "node",
        user: str | None = None,
        password: str | None = None,
        name: str | None = None,
        node_id: str | None = None,
        connect_timeout: float = 2.0,
        reconnect_wait: float = 0.25,
    ) -> Bus:
        """Connect and keep reconnecting forever; credentials default to the role's dev user.

        A node's `node_id` (default: `name`) picks its inbox prefix `_INBOX.node.<id>` and its
        audit subjects; other roles use `_INBOX.<role>`. nats.conf lets each user read only
        its own inbox prefix, so replies to one party are invisible to every other."""
        from bus.config import dev_credentials

        if why := scheme_problem(url):
            raise BusConnectError(url, why)
        if user is None:
            user, dev_password = dev_credentials(role)
            password = dev_password if password is None else password
        node_id = connection_node_id(role, node_id, name)
        inbox = subjects.inbox_prefix(role, node_id)
        holder: dict[str, Bus] = {}
        connecting, refused = asyncio.current_task(), list[str]()  # refused: the authorization error, once

        nc = nats.NATS()  # held here: a refused connect still has a socket to close
        try:
            await nc.connect(
                servers=[url],
                user=user,
                password=password,
                name=name or f"meshnet-{role}",
                inbox_prefix=inbox,
                connect_timeout=connect_timeout,
                allow_reconnect=True,
                max_reconnect_attempts=-1,
                reconnect_time_wait=reconnect_wait,
                **_connect_callbacks(holder, name or role, url, connecting, refused, user),
            )
        except asyncio.CancelledError:
            _drop_socket(nc)
            if not refused or connecting is None:
                raise
            connecting.uncancel()
            raise BusConnectError(url, refused[0]) from None
        except Exception as exc:  # nats-py raises several unrelated types here
            _drop_socket(nc)
            raise BusConnectError(url, f"{type(exc).__name__}: {exc}") from exc
        bus = cls(nc, url=url, role=role, name=name, node_id=node_id)
        bus._credentials = (user, password)
        holder["bus"] = bus
        return bus

    async def twin(self, *, name: str) -> Bus:
        """A second connection with this one's server, role and credentials, for the running
        loop (a Bus belongs to the loop that connected it)."""
        user, password = self._credentials
        return await Bus.connect(
            self.url, role=self.role, user=user, password=password, name=name, node_id=self.node_id
        )

    @property
    def audit_publisher(self) -> str:
        """Who this connection is in audit subjects: `tracker`, `gateway` or `node.<id>`."""
        return subjects.publisher(self.role, self.node_id)

    # -- state -----------------------------------------------------------------------------

    @property
    def is_connected(self) -> bool:
        """True while the TCP connection to the server is up."""
        return self._nc.is_connected

    @property
    def reconnects(self) -> int:
        """How often this connection came back after losing the server (nats-py's count): a
        reader that sees it change knows messages published meanwhile may have missed it."""
        return int(self._nc.stats["reconnects"])

    def _on_async_error(self, exc: Exception) -> None:
        text = describe_error(exc)
        self.errors.append(text)
        perm = parse_permission_error(text)
        if perm is not None:
            self.permission_errors.append(perm)
            log.warning("bus %s: %s", self.name or self.role, perm)
        elif isinstance(exc, OSError) or "unexpected eof" in text.lower():
            # the server went away; the client reconnects on its own (logged on reconnect)
            log.debug("bus %s: connection error: %s", self.name or self.role, text)
        else:
            log.warning("bus %s: async error: %s", self.name or self.role, text)

    def _gave_up(self) -> None:
        err = self._nc.last_error  # a server -ERR is not handed to the error callback first
        last = describe_error(err) if err is not None else self.errors[-1] if self.errors else "none reported"
        log.error("bus %s: the NATS client closed the connection for good (last error: %s)",
                  self.name or self.role, last)
        self.lost.set()

    def _check_open(self) -> None:
        if self._closed or self._nc.is_closed:
            raise BusClosedError("bus is closed")

    async def _until_connected(self) -> None:
        """Wait while the server is away (nats-py reconnects on its own); BusClosedError if the
        bus is closed meanwhile."""
        self._check_open()  # a closed bus raises at once (it never reconnects)
        while not self._nc.is_connected:
            self._up.clear()  # set again by the reconnect callback, or by close()
            if self._nc.is_connected:
                break
            await self._up.wait()
            self._check_open()

    # -- core pub/sub ------------------------------------------------------------------------

    async def publish(self, subject: str, msg: BusMessage, *, confirm: bool = False) -> None:
        """Publish msg as JSON; with confirm=True, round-trip to the server and raise
        BusPermissionError if the server refused it."""
        self._check_open()
        seen = len(self.permission_errors)
        try:
            await self._nc.publish(subject, msg.to_json())
        except nats.errors.ConnectionClosedError as exc:
            raise BusClosedError(str(exc)) from exc
        if confirm:
            await self.flush()
            for perm in list(self.permission_errors)[seen:]:
                # nats-py lower-cases server errors, so compare subjects case-insensitively
                if perm.operation == "publish" and perm.subject == subject.lower():
                    raise perm

    async def flush(self, timeout: float = 5.0) -> None:
        """Wait until the server has processed everything sent so far (a PING's PONG), at most
        `timeout` seconds in all (BusTimeoutError).

        Not nats-py's own flush: on a timeout it cancels the future its queue of awaited PONGs
        holds (nats-py 2.16), and the PONG that comes late (a partition that heals, a slow
        server) then sets a cancelled future's result, which raises InvalidStateError inside
        the read loop and ends that loop for good: the client stays "connected" and never
        reads again (docs/control-plane.md, "A partitioned tracker"). Here the queued future
        is never cancelled (only the wait on it is), so a late PONG completes it harmlessly,
        in order. A client whose read loop is gone cannot be flushed: that is an error too."""
        self._check_open()
        nc = self._nc
        send_ping = getattr(nc, "_send_ping", None)
        reading = getattr(nc, "_reading_task", None)
        if send_ping is None or not hasattr(nc, "_pongs"):  # another nats-py: its own flush
            try:
                await nc.flush(timeout=timeout)
            except nats.errors.TimeoutError as exc:
                raise BusTimeoutError("<flush>", timeout) from exc
            return
        if reading is None or reading.done():
            raise BusError("the bus client no longer reads from its connection")
        pong = asyncio.get_running_loop().create_future()
        try:
            async with asyncio.timeout(timeout):
                # nats-py writes the PING straight to the socket, ahead of commands still in its
                # pending buffer (e.g. a SUB), so push the buffer out first to keep order
                if nc.is_connected:
                    await nc._flush_pending(force_flush=True)
                await send_ping(pong)
                await asyncio.shield(pong)
        except TimeoutError as exc:
            raise BusTimeoutError("<flush>", timeout) from exc

    def subscribe(
        self,
        subject: str,
        model: type[M],
        *,
        queue: str | None = None,
        max_pending: int = DEFAULT_MAX_PENDING,
    ) -> Subscription[M]:
        """`async with bus.subscribe(subject, Model) as sub: async for msg in sub: ...`."""
        return Subscription(self, subject, model.from_json, queue=queue, max_pending=max_pending)

    async def may_subscribe(self, subject: str) -> bool:
        """Whether the server lets this connection's user subscribe to `subject` (subscribes,
        waits until the server has answered, unsubscribes)."""
        seen = len(self.permission_errors)
        async with self.subscribe_any(subject):
            await self.flush()
            await asyncio.sleep(0.05)  # the -ERR follows the PONG on some servers
            await self.flush()
        return not any(p.operation == "subscription" and p.subject == subject.lower()
                       for p in list(self.permission_errors)[seen:])

    def subscribe_any(
        self, subject: str, *, max_pending: int = DEFAULT_MAX_PENDING
    ) -> Subscription[BusMessage]:
        """Like subscribe, but decodes each message by its `type` (for monitors of mesh.>)."""
        return Subscription(self, subject, parse_message, max_pending=max_pending)

    async def _nats_subscribe(
        self, subject: str, queue: str | None, max_pending: int
    ) -> NatsSubscription:
        self._check_open()
        sub = await self._nc.subscribe(
            subject,
            queue=queue or "",
            pending_msgs_limit=max_pending,
            pending_bytes_limit=max_pending * 64 * 1024,
        )
        # the server knows the interest before this returns: a message published elsewhere
        # after subscribe() returned is never missed
        await self.flush(timeout=10.0)
        return sub

    # -- request / reply --------------------------------------------------------------------

    async def request(
        self, subject: str, msg: BusMessage, reply_model: type[M], timeout: float = 2.0
    ) -> M:
        """Send a request and wait for one typed reply (BusTimeoutError, SchemaError)."""
        self._check_open()
        try:
            raw = await self._nc.request(subject, msg.to_json(), timeout=timeout)
        except nats.errors.NoRespondersError as exc:
            raise BusNoRespondersError(subject, timeout) from exc
        except nats.errors.TimeoutError as exc:
            raise BusTimeoutError(subject, timeout) from exc
        except nats.errors.ConnectionClosedError as exc:
            raise BusClosedError(str(exc)) from exc
        return reply_model.from_json(raw.data, raw.subject)

    async def request_many(
        self, subject: str, msg: BusMessage, reply_model: type[M], *, timeout: float = 2.0,
        window: float = 0.5, max_replies: int = 64,
    ) -> list[M]:
        """Send a request every responder of `subject` answers, and gather their typed replies:
        up to `timeout` s for the first, then `window` s after it for the others (at most
        `max_replies`). BusNoRespondersError when nobody serves the subject, BusTimeoutError
        when nobody answered in time; a reply that does not parse is logged and left out."""
        self._check_open()
        inbox = self._nc.new_inbox()  # under this connection's inbox prefix: only its user reads it
        sub = await self._nats_subscribe(inbox, None, max_replies + 1)
        loop = asyncio.get_running_loop()
        replies: list[M] = []
        try:
            await self._nc.publish(subject, msg.to_json(), reply=inbox)
            deadline = loop.time() + timeout
            while len(replies) < max_replies and (left := deadline - loop.time()) > 0:
                try:
                    raw = await sub.next_msg(timeout=left)
                except nats.errors.TimeoutError:
                    break
                if raw.headers and raw.headers.get("Status") == NO_RESPONDERS_STATUS:
                    raise BusNoRespondersError(subject, timeout)
                try:
                    replies.append(reply_model.from_json(raw.data, raw.subject))
                except SchemaError as exc:
                    log.warning("left out a reply on %s: %s", subject, exc)
                    continue
                if len(replies) == 1:
                    deadline = loop.time() + window
        except nats.errors.ConnectionClosedError as exc:
            raise BusClosedError(str(exc)) from exc
        finally:
            await _unsubscribe(sub)
        if not replies:
            raise BusTimeoutError(subject, timeout)
        return replies

    async def serve(
        self,
        subject: str,
        request_model: type[Q],
        handler: Callable[[Q], Awaitable[BusMessage | None] | BusMessage | None],
        *,
        queue: str | None = None,
        on_error: Callable[[Exception], BusMessage | None] | None = None,
        max_pending: int = 1_000,
    ) -> Responder:
        """Answer requests on `subject` with handler(req) until stop() or close().

        A handler's None is no answer. A request that fails to parse, or a handler that raises,
        is answered with on_error(exc) when given (else left unanswered and logged)."""
        sub = await self._nats_subscribe(subject, queue, max_pending)
        task = asyncio.create_task(
            self._serve_loop(sub, request_model, handler, on_error), name=f"serve:{subject}"
        )
        responder = Responder(subject, task, sub)
        self._responders.add(responder)
        return responder

    async def _serve_loop(
        self,
        sub: NatsSubscription,
        request_model: type[Q],
        handler: Callable[[Q], Awaitable[BusMessage | None] | BusMessage | None],
        on_error: Callable[[Exception], BusMessage | None] | None,
    ) -> None:
        async for raw in sub.messages:
            reply = await self._handle_request(raw, request_model, handler, on_error)
            if reply is None or not raw.reply:
                continue
            try:
                await raw.respond(reply.to_json())
            except Exception as exc:  # a reply that cannot be sent must not stop the responder
                log.warning("reply on %s failed: %s", raw.subject, exc)

    async def _handle_request(
        self,
        raw: Msg,
        request_model: type[Q],
        handler: Callable[[Q], Awaitable[BusMessage | None] | BusMessage | None],
        on_error: Callable[[Exception], BusMessage | None] | None,
    ) -> BusMessage | None:
        try:
            req = request_model.from_json(raw.data, raw.subject)
            result = handler(req)
            return await result if asyncio.iscoroutine(result) else result  # type: ignore[return-value]
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if isinstance(exc, SchemaError):
                log.warning("bad request on %s: %s", raw.subject, exc)
            else:
                log.exception("handler for %s failed", raw.subject)
            return on_error(exc) if on_error is not None else None

    # -- audit (JetStream) ------------------------------------------------------------------

    async def ensure_audit_stream(self) -> None:
        """Create the MESH_AUDIT stream on mesh.audit.> if it does not exist (idempotent)."""
        try:
            await self._js.stream_info(AUDIT_STREAM)
        except nats.js.errors.NotFoundError:
            config = StreamConfig(
                name=AUDIT_STREAM,
                subjects=[subjects.AUDIT_ALL],
                storage=StorageType.FILE,
                retention=RetentionPolicy.LIMITS,
                discard=DiscardPolicy.OLD,
                max_bytes=256 * 1024 * 1024,
                max_age=30 * 24 * 3600,
                duplicate_window=120,
            )
            try:
                await self._js.add_stream(config)
            except nats.js.errors.BadRequestError:
                # created concurrently by another client with the same name
                await self._js.stream_info(AUDIT_STREAM)
        self._audit_stream_ready = True

    async def publish_audit(
        self, event: AuditEvent, *, attempts: int = 16, ack_timeout: float = 2.0
    ) -> int:
        """Store event in JetStream on mesh.audit.<kind>.<this publisher>; retry with backoff
        (de-duplicated by event_id). Returns the stream sequence number.

        While the server is away the event waits for the reconnect, however long that takes:
        `attempts` counts only tries made while connected (an unready stream, a lost ack), so
        an outage of any length costs at most the one try it cut short. Callers bound how many
        events wait.

        Raises ValueError (before sending) for an event whose `source` or `node_id` is not
        this connection: readers drop such events, and nats.conf forbids the subject anyway."""
        subject = subjects.audit(event.kind, self.audit_publisher)
        mismatch = subjects.binding_error(subject, event)
        if mismatch is not None:
            raise ValueError(f"audit event not sent on {subject}: {mismatch}")
        payload = event.to_json()
        delay, reason = 0.05, "not attempted"
        for attempt in range(1, attempts + 1):
            await self._until_connected()
            try:
                if not self._audit_stream_ready:
                    await self.ensure_audit_stream()
                ack = await self._js.publish(
                    subject, payload, timeout=ack_timeout, headers={"Nats-Msg-Id": event.event_id}
                )
                return int(ack.seq)
            except (nats.errors.ConnectionClosedError, BusClosedError) as exc:
                if self._closed:
                    raise BusClosedError("bus closed while publishing audit") from exc
                reason = f"{type(exc).__name__}: {exc}"
            except nats.js.errors.NoStreamResponseError as exc:
                self._audit_stream_ready = False
                reason = f"no stream: {exc}"
            except (nats.errors.Error, nats.js.errors.Error, TimeoutError, OSError) as exc:
                reason = f"{type(exc).__name__}: {exc}"
            log.info("audit publish %s attempt %d/%d failed: %s", subject, attempt, attempts, reason)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)
        raise AuditPublishError(subject, attempts, reason)

    async def audit_count(self, subject: str | None = None) -> int:
        """Messages in the audit stream (optionally only those on `subject`)."""
        self._check_open()
        try:
            if subject is None:
                info = await self._js.stream_info(AUDIT_STREAM)
            else:
                info = await self._js.stream_info(AUDIT_STREAM, subjects_filter=subject)
        except nats.js.errors.NotFoundError:
            return 0
        if subject is None:
            return int(info.state.messages)
        return sum((info.state.subjects or {}).values())

    async def audit_messages(self, limit: int = 10_000) -> list[dict[str, Any]]:
        """Read up to `limit` stored audit events back, in stream order, as raw dicts."""
        import orjson

        self._check_open()
        out: list[dict[str, Any]] = []
        info = await self._js.stream_info(AUDIT_STREAM)
        first, last = int(info.state.first_seq), int(info.state.last_seq)
        for seq in range(first, min(last, first + limit - 1) + 1):
            try:
                stored = await self._js.get_msg(AUDIT_STREAM, seq)
            except nats.js.errors.NotFoundError:
                continue
            out.append(orjson.loads(stored.data or b"{}"))
        return out

    # -- lifecycle --------------------------------------------------------------------------

    async def close(self) -> None:
        """Stop every responder and close the connection (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for responder in list(self._responders):
            await responder.stop()
        self._responders.clear()
        if self._nc.is_connected:
            with contextlib.suppress(Exception):
                await self._nc.flush(timeout=1.0)
        if not self._nc.is_closed:
            with contextlib.suppress(Exception):
                await self._nc.close()
        self._up.set()  # audit publishers waiting for a reconnect see the bus closed

    async def __aenter__(self) -> Bus:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.close()


async def connect_as(url: str, role: str, *, user: str | None, password: str | None, name: str,
                     node_id: str | None = None) -> Bus:
    """A bus for `role` (a node: `node_id`), once the server has shown that this user may act
    as it (only that role's, or that node's, user may read its inbox); BusConnectError otherwise.
    Before, a node given another node's user (or a seeder without --node-id) ran on with every
    announcement refused, never joining, and a gateway given the monitor's user answered every
    chat 'no tracker answered'."""
    bus = await Bus.connect(url, role=role, user=user, password=password, name=name, node_id=node_id)
    try:
        allowed = await bus.may_subscribe(f"{subjects.inbox_prefix(role, node_id)}.probe")
    except BusError:  # the connection was lost meanwhile: its owner sees bus.lost
        return bus
    if not allowed:
        await bus.close()
        what, own = (f"node {node_id!r}", f"node-{node_id}") if role == "node" else (f"the {role}", role)
        raise BusConnectError(url, f"NATS user {user!r} may not act as {what} (the server refuses its subjects): "
                                   f"start it with {what}'s own user ({own})"
                                   + (", or with the --node-id its user was made for" if role == "node" else ""))
    return bus


async def connect_node(url: str, *, user: str | None, password: str | None, node_id: str) -> Bus:
    """A node's bus (its subjects and inbox carry `node_id`): connect_as."""
    return await connect_as(url, "node", user=user, password=password, name=node_id, node_id=node_id)


async def until_stopped(stop: asyncio.Event, *buses: Bus | None) -> bool:
    """Wait until `stop` is set or one of `buses` is lost for good (Bus.lost); True when a bus
    was lost: the process then exits with an error, for its supervisor to start it again."""
    waits = [asyncio.ensure_future(stop.wait())]
    waits += [asyncio.ensure_future(b.lost.wait()) for b in buses if b is not None]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
        await asyncio.gather(*waits, return_exceptions=True)
    return any(b.lost.is_set() for b in buses if b is not None)


__all__ = [
    "AUDIT_STREAM",
    "Bus",
    "BusError",
    "BusTimeoutError",
    "Responder",
    "SchemaError",
    "Subscription",
    "until_stopped",
]
