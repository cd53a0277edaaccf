"""Route Session ids at the HTTP edge: the header name, validation and fresh ids."""

from __future__ import annotations

import re
import uuid

from gateway.errors import InvalidRequestError

SESSION_HEADER = "x-route-session-id"
SESSION_ID_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")  # url-safe and a valid NATS subject token (whole string)


def new_session_id() -> str:
    """A fresh url-safe Route Session id."""
    return "sess-" + uuid.uuid4().hex


def is_valid_session_id(value: str) -> bool:
    """Whether `value` may be used as a Route Session id."""
    return SESSION_ID_RE.fullmatch(value) is not None


def check_session_id(value: str, param: str = SESSION_HEADER) -> str:
    """Accept a client-chosen session id if url-safe and at most 64 characters."""
    if not is_valid_session_id(value):
        raise InvalidRequestError(
            "a Route Session id must be 1-64 characters of A-Z a-z 0-9 _ -",
            param=param, code="invalid_session_id",
        )
    return value
