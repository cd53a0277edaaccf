"""Ask the tracker for a Route Session and tell the route when it ends (the bus edge)."""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Literal, Protocol

from bus import subjects
from bus.errors import BusError, BusNoRespondersError, BusTimeoutError
from gateway.errors import InvalidRequestError, ModelNotFoundError, RouteUnavailableError
from schemas.base import BusMessage, SchemaError
from schemas.route import RouteDirective, RouteError, RouteReply, RouteRequest, RouteSession

log = logging.getLogger("meshnet.gateway.routing")

# tracker error code → HTTP status at the gateway
ROUTE_ERROR_STATUS: dict[str, int] = {
    "no_coverage": 503,
    "no_capacity": 503,
    "incompatible": 503,
    "unknown_model": 404,
    "bad_request": 400,
}


class BusLike(Protocol):
    """The part of bus.client.Bus the router uses (a seam for unit tests)."""

    async def request(
        self, subject: str, msg: BusMessage, reply_model: type[RouteReply],
        timeout: float = 2.0,
    ) -> RouteReply: ...

    async def publish(self, subject: str, msg: BusMessage) -> None: ...


def route_error_to_api(error: RouteError, model: str) -> Exception:
    """The client-facing error for a tracker RouteError."""
    if error.code == "unknown_model":
        return ModelNotFoundError(model)
    if error.code == "bad_request":
        return InvalidRequestError(f"the tracker refused the request: {error.message}",
                                   code="bad_request")
    detail = error.message
    if error.missing_ranges:
        detail += f" (missing layers {[list(r) for r in error.missing_ranges]})"
    return RouteUnavailableError(detail, code=error.code, status=ROUTE_ERROR_STATUS[error.code])


ATTEMPT_S = 2.0  # one ask of the tracker group; a longer wait means the tracker asked is gone


class Router:
    """Creates Route Sessions through the tracker and publishes close/abort directives."""

    def __init__(self, bus: BusLike, *, timeout: float = 5.0) -> None:
        self.bus = bus
        self.timeout = timeout

    async def create(self, request: RouteRequest) -> RouteSession:
        """A Route Session for `request`, or a typed ApiError (404/503/400).

        Trackers answer as a queue group, so a request reaches one of them. One that dies
        holding the request never answers: after ATTEMPT_S the same request (same session id)
        is asked again, and reaches a live tracker. That tracker gives back the route the dead
        one opened, if it had, or a new one, until `timeout` has passed in all. With no tracker
        at all, it asks again every 0.25 s until the timeout."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        if not request.request_id:  # one id for every try of this ask: only it is given the route again
            request = request.model_copy(update={"request_id": uuid.uuid4().hex})
        while True:
            left = deadline - loop.time()
            attempt = min(ATTEMPT_S, max(0.05, left))
            try:
                reply = await self.bus.request(subjects.ROUTE_CREATE, request, RouteReply, timeout=attempt)
                break
            except BusNoRespondersError as exc:
                if loop.time() + 0.25 >= deadline:
                    raise RouteUnavailableError("no tracker is running", code="no_tracker") from exc
                await asyncio.sleep(0.25)
            except BusTimeoutError as exc:
                if loop.time() >= deadline - 0.01:
                    raise RouteUnavailableError(
                        f"the tracker did not answer within {self.timeout:g}s", code="tracker_timeout"
                    ) from exc
                log.warning("no tracker answered route request for %s within %.1fs: asking again",
                            request.session_id, attempt)
            except (BusError, SchemaError) as exc:
                raise RouteUnavailableError(f"bus error: {exc}", code="bus_error") from exc
        if reply.error is not None:
            raise route_error_to_api(reply.error, request.model)
        if reply.session is None:
            raise RouteUnavailableError("the tracker sent an empty reply", code="bad_reply")
        return reply.session

    async def release(
        self, session: RouteSession, action: Literal["close", "abort"], reason: str | None = None
    ) -> None:
        """Publish a close/abort directive for the session's route (best effort, logged)."""
        msg = RouteDirective(action=action, session=session, reason=reason, issued_by="gateway")
        try:
            await self.bus.publish(subjects.route_directive(session.route_id), msg)
        except (BusError, ValueError) as exc:
            log.warning("could not publish %s for route %s: %s", action, session.route_id, exc)
