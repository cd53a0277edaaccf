"""The bus exception tree: every nats-py error is translated into one of these at the boundary.

BusError
├── BusConnectError          cannot reach or authenticate with the server
├── BusClosedError           the Bus was closed
├── BusTimeoutError          no reply in time (request, JetStream ack)
│   └── BusNoRespondersError nobody is subscribed to the request subject
├── BusPermissionError       the server refused a publish/subscribe for this user
└── AuditPublishError        an audit event could not be stored after all retries
(schemas.base.SchemaError is raised for malformed/unknown-version/invalid messages.)
"""

from __future__ import annotations

import re


class BusError(Exception):
    """Base of every bus failure."""


class BusConnectError(BusError):
    """Could not connect (server down, wrong URL, bad credentials)."""

    def __init__(self, url: str, reason: str) -> None:
        super().__init__(f"cannot connect to {url}: {reason}")
        self.url = url
        self.reason = reason


class BusClosedError(BusError):
    """The Bus (or its connection) is closed."""


class BusTimeoutError(BusError):
    """A request got no reply within `timeout` seconds."""

    def __init__(self, subject: str, timeout: float, message: str | None = None) -> None:
        super().__init__(message or f"no reply on {subject!r} within {timeout:.3g}s")
        self.subject = subject
        self.timeout = timeout


class BusNoRespondersError(BusTimeoutError):
    """A request found no subscriber at all (e.g. the tracker is not running)."""

    def __init__(self, subject: str, timeout: float) -> None:
        super().__init__(subject, timeout, f"no responders on {subject!r}")


class BusPermissionError(BusError):
    """The server refused an operation on a subject for this connection's user."""

    def __init__(self, operation: str, subject: str, raw: str) -> None:
        super().__init__(f"permissions violation: {operation} to {subject!r}")
        self.operation = operation  # "publish" | "subscription"
        self.subject = subject
        self.raw = raw


class AuditPublishError(BusError):
    """An audit event was not acknowledged by JetStream after every retry."""

    def __init__(self, subject: str, attempts: int, reason: str) -> None:
        super().__init__(f"audit publish to {subject!r} failed after {attempts} attempts: {reason}")
        self.subject = subject
        self.attempts = attempts
        self.reason = reason


_PERMISSION = re.compile(r"permissions violation for (publish|subscription) to \"?([^\"']+)\"?", re.I)


def parse_permission_error(text: str) -> BusPermissionError | None:
    """Turn a server `-ERR 'Permissions Violation for ...'` text into a typed error."""
    m = _PERMISSION.search(text)
    if not m:
        return None
    return BusPermissionError(m.group(1).lower(), m.group(2).strip(), text)
