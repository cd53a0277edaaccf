"""A connection of its own for pulling batches of stored events out of JetStream, fast.

A durable reader of the audit stream (bus/jetstream.py) spends most of its time in nats-py's
per-message work: its protocol parser, a Msg object and a header dictionary for every
delivery (each stored audit event carries a Nats-Msg-Id header). The Work Ledger folds
events faster than that (bench/ledger.py), so its pulls go over this link instead: one TCP
connection to the same server with the same login, which speaks just the part of the NATS
client protocol a pull needs (CONNECT, SUB, PUB, PING/PONG, and MSG/HMSG deliveries), and
hands each delivery over as (subject, reply, payload) without looking at its headers other
than for a status line (404 no messages, 408 request expired, 409 ...).

Consumers are still made and removed through the Bus's JetStream API; this link only asks for
batches (`$JS.API.CONSUMER.MSG.NEXT`) and acknowledges them. A lost connection is an error
for the caller (the ledger's and validator's loops start over from what they stored).
"""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass

import orjson

from bus.errors import BusError

_CRLF = b"\r\n"


class PullLinkError(BusError):
    """The pull connection failed or the server refused it (login, permissions)."""


@dataclass(frozen=True, slots=True)
class Delivery:
    subject: str  # the subject the event was stored under
    reply: str  # $JS.ACK.… (stream sequence inside; acknowledgements go there)
    payload: bytes


def parse_deliveries(buf: bytearray | bytes, start: int = 0) -> tuple[list[tuple], int]:
    """Complete protocol items in `buf` from `start` (pure): a list of ("msg", subject, reply,
    payload), ("status", code, description), ("ping",), ("err", text) and ("other",) items, and the offset
    of the first byte not consumed (an incomplete item waits for more bytes)."""
    out: list[tuple] = []
    append = out.append
    subject_of: dict[bytes, str] = {}  # the few subjects a batch holds, decoded once
    pos = start
    n = len(buf)
    find = buf.find
    while pos < n:
        eol = find(_CRLF, pos)
        if eol < 0:
            break
        line = bytes(buf[pos:eol])
        head = line[:4]
        if head == b"HMSG" or head == b"MSG ":
            parts = line.split()
            # MSG subj sid [reply] size | HMSG subj sid [reply] hdr_size total_size
            if head == b"HMSG":
                hdr, total = int(parts[-2]), int(parts[-1])
                reply = parts[3] if len(parts) > 5 else b""
            else:
                hdr, total = 0, int(parts[-1])
                reply = parts[3] if len(parts) > 4 else b""
            body = eol + 2
            end = body + total
            if end + 2 > n:
                break  # the rest has not arrived yet
            if hdr and buf[body + 8] == 32:  # "NATS/1.0 404 No Messages": a status, not an event
                line_end = buf.find(_CRLF, body, body + hdr)
                text = bytes(buf[body + 13:line_end if line_end >= 0 else body + hdr]).decode(errors="replace")
                append(("status", int(buf[body + 9:body + 12]), text.strip()))
            else:
                subject = subject_of.get(parts[1])
                if subject is None:
                    subject = subject_of[parts[1]] = parts[1].decode()
                append(("msg", subject, reply.decode(), bytes(buf[body + hdr:end])))
            pos = end + 2
            continue
        pos = eol + 2
        if line == b"PING":
            append(("ping",))
        elif head == b"-ERR":
            append(("err", line[4:].strip().strip(b"'").decode(errors="replace")))
        else:  # +OK, PONG, INFO (cluster updates)
            append(("other", line))
    return out, pos


class _PullProtocol(asyncio.Protocol):
    def __init__(self, link: PullLink) -> None:
        self.link = link
        self.buf = bytearray()

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        items, used = parse_deliveries(buf)
        if used:
            del buf[:used]
        self.link._take(items)

    def connection_lost(self, exc: Exception | None) -> None:
        self.link._lost(exc)


class PullLink:
    """One NATS connection that pulls batches into a private inbox and acknowledges them."""

    def __init__(self) -> None:
        self._transport: asyncio.Transport | None = None
        self._inbox = ""
        self._got: list[Delivery] = []
        self._want = 0  # the caller waits for this many deliveries
        self._outstanding = 0  # deliveries the pull asked for last may still bring
        self._done = asyncio.Event()
        self._pong = asyncio.Event()
        self._error: str | None = None
        self._info: asyncio.Future | None = None  # set once the server's INFO came

    @classmethod
    async def open(cls, url: str, *, user: str | None, password: str | None, inbox_prefix: str,
                   name: str = "meshnet-pull", timeout: float = 5.0) -> PullLink:
        link = cls()
        host, port = _host_port(url)
        loop = asyncio.get_running_loop()
        link._info = loop.create_future()  # before connecting: INFO may come at once
        try:
            transport, _ = await asyncio.wait_for(
                loop.create_connection(lambda: _PullProtocol(link), host, port), timeout)
        except (OSError, TimeoutError) as exc:
            raise PullLinkError(f"cannot reach {url} for pulling: {exc}") from exc
        link._transport = transport
        try:
            if not await asyncio.wait_for(link._info, timeout):
                link._raise()
            connect = {"verbose": False, "pedantic": False, "lang": "python", "version": "meshnet",
                       "protocol": 1, "headers": True, "no_responders": True, "name": name}
            if user is not None:
                connect.update(user=user, **{"pass": password or ""})
            link._inbox = f"{inbox_prefix}.{secrets.token_hex(8)}"
            transport.write(b"CONNECT " + orjson.dumps(connect) + b"\r\nSUB " + link._inbox.encode()
                            + b" 1\r\nPING\r\n")
            await asyncio.wait_for(link._pong.wait(), timeout)
        except TimeoutError as exc:
            transport.close()
            raise PullLinkError(f"{url} did not answer the pull connection's login") from exc
        except PullLinkError:
            transport.close()
            raise
        if link._error is not None:  # refused (a login or permission error): the server may keep the socket
            transport.close()
            link._raise()
        return link

    def _take(self, items: list[tuple]) -> None:
        info = self._info
        for item in items:
            kind = item[0]
            if kind == "msg":
                self._got.append(Delivery(item[1], item[2], item[3]))
                self._outstanding = max(0, self._outstanding - 1)
            elif kind == "status":
                self._outstanding = 0  # the pull ended
                if _fatal_status(item[1], item[2]):  # the consumer or JetStream is gone: reopen
                    self._error = f"JetStream answered the pull with {item[1]} {item[2]}"
            elif kind == "ping":
                if self._transport is not None:
                    self._transport.write(b"PONG\r\n")
            elif kind == "err":
                self._error = item[1]
                self._outstanding = 0
                self._pong.set()
            elif item[1] == b"PONG":
                self._pong.set()
            elif item[1].startswith(b"INFO") and info is not None and not info.done():
                info.set_result(True)
        if len(self._got) >= self._want or not self._outstanding:
            self._done.set()

    def _lost(self, exc: Exception | None) -> None:
        self._error = self._error or f"connection lost ({exc or 'closed by the server'})"
        self._transport = None
        self._outstanding = 0
        self._done.set()
        self._pong.set()
        if self._info is not None and not self._info.done():
            self._info.set_result(False)

    def _raise(self) -> None:
        if self._error is not None:
            raise PullLinkError(self._error)

    async def pull(self, api_subject: str, batch: int, timeout: float, *, prefetch: bool = False) -> list[Delivery]:
        """Up to `batch` events: the server holds the request until `batch` came or `timeout`
        passed; fewer when the consumer had fewer, [] when none. With `prefetch`, after a full
        batch the next one is asked for at once (ending with what is there), so the server
        delivers it while the caller handles this one: for a caller that handles a batch
        quickly (their acknowledgement clock runs meanwhile)."""
        self._raise()
        if not self._outstanding and len(self._got) < batch:
            self._ask(api_subject, batch, timeout)
        self._want = batch
        self._done.clear()
        if len(self._got) >= batch or not self._outstanding:
            self._done.set()
        try:
            await asyncio.wait_for(self._done.wait(), timeout + 1.0)
        except TimeoutError:
            pass
        got, self._got, self._want = self._got[:batch], self._got[batch:], 0
        if not got:
            self._raise()
        elif prefetch and len(got) == batch and not self._outstanding:
            self._ask(api_subject, batch, timeout, no_wait=True)
        return got

    def _ask(self, api_subject: str, batch: int, timeout: float, *, no_wait: bool = False) -> None:
        request = orjson.dumps({"batch": batch, "expires": int(timeout * 1e9), "no_wait": no_wait})
        self._write(b"PUB %s %s %d\r\n%s\r\n" % (api_subject.encode(), self._inbox.encode(), len(request), request))
        self._outstanding = batch

    def ack(self, reply: str) -> None:
        self._write(b"PUB %s 4\r\n+ACK\r\n" % reply.encode())

    def _write(self, data: bytes) -> None:
        self._raise()
        if self._transport is None:
            raise PullLinkError("the pull connection is closed")
        self._transport.write(data)

    async def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
            self._transport = None
        self._error = self._error or "closed"


def _fatal_status(code: int, text: str) -> bool:
    """Whether a pull's status means the reader must reopen (pure): 404 (no events), 408
    (expired) and the passing 409s (too many waiting pulls, a leader change) end one pull;
    a 409 for a deleted consumer, or no responder (503: the consumer or JetStream gone) do not
    get better by pulling again."""
    if code in (404, 408):
        return False
    return code == 503 or (code == 409 and "consumer deleted" in text.lower())


def _host_port(url: str) -> tuple[str, int]:
    """host and port of nats://host:port (pure)."""
    rest = url.split("://", 1)[-1].split("@")[-1].rstrip("/")
    host, _, port = rest.rpartition(":")
    return (host or rest or "127.0.0.1").strip("[]"), int(port) if port.isdigit() else 4222
