"""The gateway's exception tree; each error knows its OpenAI error body and HTTP status.

    ApiError                      → any client-facing error (status, type, param, code)
    ├── InvalidRequestError       → 400 invalid_request_error (bad JSON, bad parameter)
    ├── ContextLengthError        → 400 context_length_exceeded
    ├── ModelNotFoundError        → 404 model_not_found
    ├── SessionConflictError      → 409 session id already in use
    ├── TooManyStreamsError       → 429 too many open telemetry streams, with Retry-After
    ├── QueueRefusedError         → 503 with Retry-After: the admission queue refused the request
    │   ├── QueueFullError        →     queue_full: the queue already holds --max-queue requests
    │   └── QueueTimeoutError     →     queue_timeout: no route had room within --queue-timeout
    ├── RouteUnavailableError     → 503 the tracker has no route (no_coverage, incompatible, ...;
    │                                 no_nodes, with Retry-After: no node serves the model yet;
    │                                 revision_mismatch: nodes serve another GGUF of it)
    └── RouteFailedApiError       → 502 a hop failed during prefill/decode (names the phase)

    ClientGoneError               — not an ApiError: the HTTP client left; nothing is answered
"""

from __future__ import annotations

from typing import Any

from schemas.route import RouteFailure


class ApiError(Exception):
    """An error that becomes `{"error": {...}}` with an HTTP status at the edge."""

    status = 500
    type = "server_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        status: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        if status is not None:
            self.status = status

    def headers(self) -> dict[str, str]:
        """Extra HTTP headers of the error response (none by default)."""
        return {}

    def body(self) -> dict[str, Any]:
        """The OpenAI error body: {"error": {"message", "type", "param", "code"}}."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


# OpenAI's SDKs retry 408, 409, 429 and 5xx answers unless this header says not to: an
# error that the same request meets again however long it waits carries it
NO_RETRY = {"x-should-retry": "false"}


class InvalidRequestError(ApiError):
    status = 400
    type = "invalid_request_error"


def unsupported_field(path: str) -> InvalidRequestError:
    """The 400 for a field the gateway would have to ignore, named by its whole path."""
    return InvalidRequestError(f"{path} is not a parameter this gateway honours; leave it out", param=path,
                               code="unsupported_parameter")


def check_known_keys(obj: dict[str, Any], allowed: set[str], where: str) -> None:
    """unsupported_field for the first key of `obj` (found at `where`) not in `allowed`."""
    for key in obj:
        if key not in allowed:
            raise unsupported_field(f"{where}.{key}")


class ContextLengthError(InvalidRequestError):
    def __init__(self, message: str, *, n_ctx: int, requested: int, param: str = "messages") -> None:
        super().__init__(message, param=param, code="context_length_exceeded")
        self.n_ctx = n_ctx
        self.requested = requested


class ModelNotFoundError(ApiError):
    status = 404
    type = "invalid_request_error"

    def __init__(self, model: str) -> None:
        super().__init__(
            f"The model {model!r} does not exist or the mesh cannot route it",
            param="model",
            code="model_not_found",
        )
        self.model = model


class SessionNotFoundError(ApiError):
    status = 404
    type = "invalid_request_error"

    def __init__(self, session_id: str) -> None:
        super().__init__(
            f"no Route Session {session_id!r}", param="session_id", code="session_not_found"
        )
        self.session_id = session_id


class SessionConflictError(ApiError):
    status = 409
    type = "invalid_request_error"

    def __init__(self, session_id: str, kept_s: float | None = None) -> None:
        """`kept_s`: the session finished, and its telemetry keeps the id this much longer."""
        what = "is already in use" if kept_s is None else (
            f"belongs to a finished session whose telemetry is kept {kept_s:.0f} s more; choose another id")
        super().__init__(f"Route Session id {session_id!r} {what}", param="x-route-session-id", code="session_exists")
        self.session_id = session_id

    def headers(self) -> dict[str, str]:
        return dict(NO_RETRY)  # the id stays taken: a retry with it meets the same 409


class TooManyStreamsError(ApiError):
    """429 with Retry-After: streams end only when their clients leave, so the hint is a
    polling interval, not a promise."""

    status = 429
    type = "rate_limit_error"
    retry_after_s = 5

    def __init__(self, limit: int, *, per_client: bool = False) -> None:
        super().__init__(
            f"this client already holds {limit} telemetry streams; close one first" if per_client
            else f"the gateway already serves {limit} telemetry streams; retry later",
            code="too_many_streams",
        )
        self.limit = limit

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}


class ServiceUnavailableError(ApiError):
    """A 503 that is not about routing (`/v1/ledger` without a ledger or a bus)."""

    status = 503
    type = "service_unavailable"


class QueueRefusedError(ApiError):
    """The admission queue refused the request; `retry_after` seconds is the client's hint."""

    status = 503
    type = "service_unavailable"

    def __init__(self, message: str, *, code: str, retry_after: int) -> None:
        super().__init__(message, code=code)
        self.retry_after = retry_after

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after)}


class QueueFullError(QueueRefusedError):
    def __init__(self, max_queue: int, *, retry_after: int, key_share: int | None = None) -> None:
        """`key_share`: the request's API key already holds this many waiting places, its share
        of the queue (AdmissionQueue.join), while the queue itself still has room."""
        waiting = (f"{max_queue} requests already wait for one" if key_share is None else
                   f"this API key already has {key_share} requests waiting, its share of the {max_queue} places")
        super().__init__(f"all routes are busy and {waiting}; retry later", code="queue_full", retry_after=retry_after)
        self.max_queue = max_queue


class QueueTimeoutError(QueueRefusedError):
    def __init__(self, waited: float, *, retry_after: int) -> None:
        super().__init__(
            f"no route had room within {waited:g}s of waiting in the admission queue; retry later",
            code="queue_timeout", retry_after=retry_after,
        )
        self.waited = waited


class ClientGoneError(Exception):
    """The HTTP client went away; its request leaves the queue or its session is aborted."""


class RouteUnavailableError(ApiError):
    """The tracker could not give a route (or did not answer)."""

    status = 503
    type = "service_unavailable"

    def __init__(self, message: str, *, code: str, status: int | None = None, retry_after: int | None = None,
                 final: bool = False, held_nodes: tuple[str, ...] = (), held_s: float = 0.0) -> None:
        """`final`: no wait mends it (NO_RETRY); else `retry_after` seconds, when known.
        `held_nodes`, `held_s`: the tracker's `no_coverage` came only from nodes it holds out
        after a reported loss, for `held_s` more seconds (RouteError)."""
        super().__init__(f"routing failed: {message}", code=code, status=status)
        self.route_code = code
        self.retry_after = retry_after
        self.final = final
        self.held_nodes = held_nodes
        self.held_s = held_s

    def headers(self) -> dict[str, str]:
        if self.final:
            return dict(NO_RETRY)
        return {"Retry-After": str(self.retry_after)} if self.retry_after is not None else {}


class RouteFailedApiError(ApiError):
    """A hop failed after the route was made; the message names the failed phase."""

    status = 502
    type = "route_failed"

    def __init__(self, failure: RouteFailure) -> None:
        where = f" at hop {failure.hop_index}" if failure.hop_index is not None else ""
        node = f" (node {failure.node_id})" if failure.node_id else ""
        super().__init__(
            f"Route Session failed during {failure.phase}{where}{node}: {failure.reason}",
            code=failure.code or "route_failed",
        )
        self.failure = failure
