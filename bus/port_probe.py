"""Is the server at a NATS URL speaking HTTP? A role pointed at nats-server's monitoring port
(8222, HTTP) instead of its client port (4222) waited for ever: the HTTP server accepts the
connection and waits for a request while nats-py waits for the server's INFO line, so every
try ended in a bare TimeoutError. One probe after the first such timeout tells them apart; a
NATS server says INFO first, and a frozen one (SIGSTOP) says nothing, so both are waited for."""

from __future__ import annotations

import asyncio
import contextlib
from urllib.parse import urlsplit

HTTP_PROBE_S = 2.0  # longest the probe takes
DEFAULT_NATS_PORT = 4222
NATS_SCHEMES = frozenset({"nats", "tls", "ws", "wss"})  # what nats-py connects to


def scheme_problem(url: str) -> str:
    """Why `url` is no NATS URL by its scheme ("" when it may be one) (pure): nats-py took
    http://host:8222, the monitoring page's address, and retried it for ever ('Name or service
    not known')."""
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if not scheme or scheme in NATS_SCHEMES:
        return ""
    hint = (" (an http:// address is nats-server's monitoring port; the client port is "
            f"{DEFAULT_NATS_PORT} by default)") if scheme in ("http", "https") else ""
    return f"{scheme}:// is not a NATS URL: give nats://host:port{hint}"


def host_port(url: str) -> tuple[str, int]:
    """Host and port of nats://host:port, host:port or a bare host (pure)."""
    parts = urlsplit(url if "://" in url else f"nats://{url}")
    return parts.hostname or "127.0.0.1", parts.port or DEFAULT_NATS_PORT


async def speaks_http(url: str, timeout: float = HTTP_PROBE_S) -> bool:
    """True when the server at `url` answers an HTTP request with an HTTP status line."""
    host, port = host_port(url)
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(host, port)
            try:
                writer.write(f"GET / HTTP/1.0\r\nHost: {host}\r\n\r\n".encode())
                await writer.drain()
                head = await reader.readexactly(5)
            finally:
                writer.close()
                with contextlib.suppress(Exception):
                    await writer.wait_closed()
    except (OSError, TimeoutError, asyncio.IncompleteReadError, ValueError):
        return False
    return head == b"HTTP/"


def http_port_hint() -> str:
    """Why a role stops when its NATS URL is an HTTP port (BusConnectError names the URL)."""
    return ("it answers HTTP, not NATS: it looks like nats-server's monitoring port (HTTP, 8222 by "
            f"default); give the client port instead ({DEFAULT_NATS_PORT} by default: `listen` in nats.conf, "
            "`meshnet nats --port`)")
