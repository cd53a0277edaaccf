"""Ask the tracker for a Route Session and tell the route when it ends (the bus edge)."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from typing import Literal, Protocol

from bus import subjects
from bus.errors import BusError, BusNoRespondersError, BusTimeoutError
from gateway.errors import InvalidRequestError, RouteUnavailableError, SessionConflictError
from schemas.base import BusMessage, SchemaError
from schemas.protocol import FIRST, needs, what_sets
from schemas.route import (
    ANSWER_ROUND_TRIPS,
    FIRST_ANSWER_ROUND_TRIPS,
    ROUTE_ANSWER_S,
    SESSION_HAS_ROUTE,
    RouteDirective,
    RouteError,
    RouteReply,
    RouteRequest,
    RouteSession,
    RouteWithdrawal,
)

log = logging.getLogger("meshnet.gateway.routing")

# tracker error code → HTTP status at the gateway
ROUTE_ERROR_STATUS: dict[str, int] = {
    "no_coverage": 503,
    "no_capacity": 503,
    "incompatible": 503,
    "unknown_model": 503,
    "bad_request": 400,
}


class BusLike(Protocol):
    """The part of bus.client.Bus the router uses (a seam for unit tests)."""

    async def request(
        self, subject: str, msg: BusMessage, reply_model: type[RouteReply],
        timeout: float = 2.0,
    ) -> RouteReply: ...

    async def publish(self, subject: str, msg: BusMessage) -> None: ...


NO_NODES_RETRY_S = 2  # Retry-After while no node serves the model (a node loads in seconds)


EXTRA_FORBIDDEN = "Extra inputs are not permitted"  # pydantic's words for a field its reader does not know


def older_tracker(error: RouteError, request: RouteRequest) -> RouteError:
    """`error` as the client should read it (pure): a tracker's `bad_request` for a field it does
    not know, on a request using fields of a newer protocol (schemas/protocol.py), says the
    tracker runs an older Meshnet: `incompatible` (a 503), naming the fields and the protocol."""
    protocol, fields = needs(request)
    if error.code != "bad_request" or EXTRA_FORBIDDEN not in error.message or protocol <= FIRST:
        return error
    names = ", ".join(fields)
    return RouteError(code="incompatible", message=(
        f"this request's {names} needs mesh protocol {protocol}, and the tracker that answered runs an older "
        f"Meshnet (it refused: {error.message}). Upgrade the tracker, or send the request without {names} "
        f"({what_sets(fields)})"))


def session_taken(error: RouteError, request: RouteRequest) -> bool:
    """Whether the tracker refused `request` because its session id is another route's (pure):
    the client's id is in use on another gateway in front of the same mesh, the same conflict
    this gateway answers 409 session_exists for its own sessions (not a malformed request)."""
    return (error.code == "bad_request" and request.session_id is not None
            and error.message == f"session {request.session_id} {SESSION_HAS_ROUTE}")


def route_error_to_api(error: RouteError, model: str) -> Exception:
    """The client-facing error for a tracker RouteError. The gateway asks only for the model it
    serves, so the tracker's `unknown_model` means that no node serves it right now (the nodes
    are still loading, or have all left): a 503 to retry, like llama-server while it loads."""
    if error.code == "unknown_model":
        return RouteUnavailableError("no node serves this model right now (its nodes are still loading, or "
                                     "every one left or was lost); retry shortly",
                                     code="no_nodes", retry_after=NO_NODES_RETRY_S)
    if error.code == "bad_request":
        return InvalidRequestError(f"the tracker refused the request: {error.message}",
                                   code="bad_request")
    detail = error.message
    if error.missing_ranges and "missing layers" not in detail:  # the tracker's message may say it already
        detail += f" (missing layers {[list(r) for r in error.missing_ranges]})"
    # incompatible: only other nodes (or a tracker) mend it, never a client's quick retry (an OpenAI
    # SDK asks twice more on a 503 unless told not to)
    return RouteUnavailableError(detail, code=error.code, status=ROUTE_ERROR_STATUS[error.code],
                                 held_nodes=tuple(error.held_nodes), held_s=error.held_s,
                                 final=error.code == "incompatible")


def revision_mismatch_error(revision: str, others: list[str]) -> RouteUnavailableError:
    """The answer when no node serves this gateway's model revision but live nodes serve the
    same model from another GGUF: no wait mends that (a 503 without Retry-After)."""
    return RouteUnavailableError(
        f"no node serves this gateway's model revision {revision}; live nodes serve revision(s) "
        f"{', '.join(others)} of it. Start the gateway with the GGUF the nodes serve (or the nodes "
        "with the gateway's)", code="revision_mismatch", final=True)


def other_models_error(exc: RouteUnavailableError, models: list[str]) -> RouteUnavailableError:
    """`exc` (no node of this gateway's model) naming the models live nodes do serve: the
    gateway's nodes may be loading (so still a 503 with Retry-After), or its --model may not be
    the GGUF the nodes were started with, which no wait mends."""
    return RouteUnavailableError(
        f"{str(exc).removeprefix('routing failed: ')}; live nodes serve only other models: {', '.join(models)} "
        "(is the gateway's --model the GGUF the nodes serve?)", code=exc.route_code, status=exc.status,
        retry_after=exc.retry_after)


# The first ask goes to one tracker of the queue group. A live one answers within
# ROUTE_ANSWER_S; the other half of FIRST_ASK_S is for this loop and the bus. Longer means the
# tracker asked is dead or frozen: the ask is retried on ROUTE_RETRY, which every tracker reads,
# so a frozen one cannot hold the retry too. A retry waits ATTEMPT_S.
FIRST_ASK_S = 2 * ROUTE_ANSWER_S
ATTEMPT_S = 2.0
NO_TRACKER_WAIT_S = 0.25  # between asks while no tracker listens at all


def ask_waits(gateway_rtt_s: float, tracker_rtt_s: float) -> tuple[float, float]:
    """How long a first ask and a retry wait for their answer (pure), on a bus whose round trip
    is `gateway_rtt_s` from this gateway and `tracker_rtt_s` from the slowest tracker: each adds
    the round trips its answer crosses, the ask's own and the tracker's (schemas/route.py: a
    first ask's claim is first; a retry's may find another copy's). Without them, a gateway and
    a tracker 300 ms from the server asked every request twice."""
    return (FIRST_ASK_S + gateway_rtt_s + FIRST_ANSWER_ROUND_TRIPS * tracker_rtt_s,
            ATTEMPT_S + gateway_rtt_s + ANSWER_ROUND_TRIPS * tracker_rtt_s)


class Router:
    """Creates Route Sessions through the tracker and publishes close/abort directives."""

    def __init__(self, bus: BusLike, *, timeout: float = 5.0,
                 head_rtt: Callable[[], dict[str, float]] | None = None, driver_id: str = "",
                 bus_rtt: Callable[[], tuple[float, float]] = lambda: (0.0, 0.0)) -> None:
        self.bus = bus
        self.timeout = timeout
        self.bus_rtt = bus_rtt  # (this gateway's, the slowest tracker's) round trip to the bus, in seconds
        self.driver_id = driver_id  # this gateway as its routes' driver (DriverAlive)
        self.head_rtt = head_rtt  # the gateway's measured round trips to heads (gateway/head_probe.py)
        self._withdrawals: set[asyncio.Task[None]] = set()  # withdrawals being published (they own themselves)

    async def create(self, request: RouteRequest) -> RouteSession:
        """A Route Session for `request`, or a typed ApiError (404/503/400).

        Trackers answer as a queue group, so the first ask reaches one of them. One that died or
        froze holding it does not answer: after FIRST_ASK_S the same request (same request id)
        is asked again of every tracker (ROUTE_RETRY), and a live one answers. The trackers
        open one route per request id (tracker/asks.py): a tracker that reads another copy of it
        gives that route back. So with one tracker of the group dead or frozen, a route costs at
        most FIRST_ASK_S + one retry. Retries wait ATTEMPT_S each until `timeout` has passed in
        all. Both waits grow by the bus round trips the answer crosses (`ask_waits`). With no tracker at all, it asks again every NO_TRACKER_WAIT_S until the timeout.
        An ask given up on (no answer in time, a bus error, or the caller cancelled: its client
        left) is withdrawn: a tracker that reads it later (it was frozen, or the bus was down
        and delivers it on reconnecting) opens no route for it, or closes the one it opened."""
        # one id for every try of this ask (one route per id), and the time this ask began (a
        # request built once may be asked again much later, e.g. after waiting for capacity)
        request = request.model_copy(update={
            "request_id": request.request_id or uuid.uuid4().hex, "ts": time.time(),
            "driver_id": request.driver_id or self.driver_id,
            "head_rtt_ms": request.head_rtt_ms or (self.head_rtt() if self.head_rtt is not None else {})})
        try:
            reply = await self._ask(request)
        except BaseException as exc:
            self._withdraw(request, "the asker left" if isinstance(exc, asyncio.CancelledError) else str(exc))
            raise
        if reply.error is not None and session_taken(reply.error, request):
            raise SessionConflictError(request.session_id or "")
        if reply.error is not None:
            raise route_error_to_api(older_tracker(reply.error, request), request.model)
        if reply.session is None:
            raise RouteUnavailableError("the tracker sent an empty reply", code="bad_reply")
        return reply.session

    async def _ask(self, request: RouteRequest) -> RouteReply:
        """The trackers' reply to `request`, asked until one answers or the timeout has passed."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        first_wait, retry_wait = ask_waits(*self.bus_rtt())
        subject, wait = subjects.ROUTE_CREATE, first_wait
        while True:
            left = deadline - loop.time()
            attempt = min(wait, max(0.05, left))
            try:
                return await self.bus.request(subject, request, RouteReply, timeout=attempt)
            except BusNoRespondersError as exc:
                if loop.time() + NO_TRACKER_WAIT_S >= deadline:
                    raise RouteUnavailableError("no tracker is running", code="no_tracker") from exc
                await asyncio.sleep(NO_TRACKER_WAIT_S)
            except BusTimeoutError as exc:
                if loop.time() >= deadline - 0.01:
                    raise RouteUnavailableError(
                        f"no tracker answered within {self.timeout:g}s (the trackers, or the NATS server "
                        "between them and this gateway, are down or overloaded)", code="tracker_timeout"
                    ) from exc
                log.warning("no tracker answered route request %s within %.2fs: asking every tracker",
                            request.request_id, attempt)
                subject, wait = subjects.ROUTE_RETRY, retry_wait
            except (BusError, SchemaError) as exc:
                raise RouteUnavailableError(f"bus error: {exc}", code="bus_error") from exc

    def _withdraw(self, request: RouteRequest, reason: str) -> None:
        """Tell every tracker this ask is given up on (in the background: a cancelled caller
        does not wait for it; best effort, logged)."""
        msg = RouteWithdrawal(request_id=request.request_id, session_id=request.session_id, reason=reason[:200])

        async def publish() -> None:
            try:
                await self.bus.publish(subjects.ROUTE_WITHDRAW, msg)
            except (BusError, ValueError) as exc:
                log.warning("could not withdraw route request %s: %s", request.request_id, exc)

        task = asyncio.get_running_loop().create_task(publish(), name=f"withdraw-{request.request_id}")
        self._withdrawals.add(task)
        task.add_done_callback(self._withdrawals.discard)

    async def release(
        self, session: RouteSession, action: Literal["close", "abort"], reason: str | None = None
    ) -> None:
        """Publish a close/abort directive for the session's route (best effort, logged)."""
        msg = RouteDirective(action=action, session=session, reason=reason, issued_by="gateway")
        try:
            await self.bus.publish(subjects.route_directive(session.route_id), msg)
        except (BusError, ValueError) as exc:
            log.warning("could not publish %s for route %s: %s", action, session.route_id, exc)
