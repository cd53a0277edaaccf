"""One keep-alive HTTP/1.1 connection to a seeder, for fetching pieces on a worker thread.

The Shard Swarm's cost on a small machine is CPU, not the network: every byte is received,
hashed (sha256) and written. Through aiohttp each received chunk also went through the event
loop (a few hundred Python steps per MB), and the hash and the write waited on one absorber
thread, so a fetch ran at about 0.7x a plain GET (docs/benchmarks.md). Here a piece is
fetched by one blocking loop on a thread: `recv_into` a reused buffer, hash it, `pwrite` it.
Each of those calls releases the GIL, so the pieces in flight (several per peer) hash and
write on both cores at once while the event loop stays free.

Only what the seeders (artifacts/seeder.py) send is understood: a status line, headers with
Content-Length, and the body. A piece resumed at an offset is asked for with a Range.
"""

from __future__ import annotations

import os
import socket
from typing import Any
from urllib.parse import urlsplit

BUFFER = 1 << 20  # bytes per recv_into: large enough that per-call costs vanish, small enough for L2
HEAD_LIMIT = 64 << 10  # a response head longer than this is not a seeder's


class PieceLinkError(OSError):
    """The connection failed or the peer did not speak HTTP as a seeder does (a peer failure)."""


class PieceStatusError(Exception):
    """The seeder answered with another status than 200/206 (`status`, a short `body`)."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"HTTP {status}: {body[:200]!r}")
        self.status = status
        self.body = body


class LocalWriteError(Exception):
    """Writing or reading this node's own piece file failed (disk full, say): not the peer's
    fault (deliberately not an OSError, which callers take for a failed peer)."""


class TooLongError(Exception):
    """The seeder announced more bytes than the piece has."""


class PieceLink:
    """A connection to one seeder, used by one thread at a time."""

    def __init__(self, base_url: str, *, headers: dict[str, str] | None = None,
                 connect_timeout: float = 5.0, read_timeout: float = 15.0) -> None:
        u = urlsplit(base_url)
        if u.scheme != "http" or not u.hostname:
            raise ValueError(f"a seeder URL is http://host:port, not {base_url!r}")
        self.host = u.hostname
        self.port = u.port or 80
        self.prefix = u.path.rstrip("/")
        self.extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self._sock: socket.socket | None = None
        self._buf = bytearray(BUFFER)
        self.received = 0  # body bytes of the current fetch so far (read by the loop for accounting)

    def fetch(self, path: str, fd: int, size: int, hasher: Any, *, start: int = 0, ranged: bool = False) -> int:
        """GET bytes [start, size) of `path` into `fd` at the same offsets (a Range when start
        > 0 or `ranged`), hashing every body byte with `hasher`; returns the body's length.
        Raises PieceStatusError, TooLongError (before reading the body), or PieceLinkError /
        OSError."""
        self.received = 0
        sock = self._connected()
        rng = f"Range: bytes={start}-{size - 1}\r\n" if start or ranged else ""
        request = f"GET {self.prefix}{path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n{rng}{self.extra}\r\n"
        try:
            sock.sendall(request.encode())
            status, length, keep, body_start = self._head(sock)
        except OSError:
            self.close()
            raise
        if status not in (200, 206):
            body = bytes(body_start[:length]) if length >= 0 else bytes(body_start)
            self.close()  # the rest of an error body is not worth reading
            raise PieceStatusError(status, body)
        if length < 0:
            self.close()
            raise PieceLinkError("the seeder sent no Content-Length")
        if start + length > size:
            self.close()
            raise TooLongError(f"more than its {size} bytes")
        off = start
        try:
            if body_start:
                chunk = memoryview(body_start)[:length]
                hasher.update(chunk)
                _pwrite_all(fd, chunk, off)
                off += len(chunk)
                self.received = len(chunk)
            view = memoryview(self._buf)
            while self.received < length:
                n = sock.recv_into(view, min(BUFFER, length - self.received))
                if n == 0:
                    raise PieceLinkError(f"the seeder closed the connection after {self.received} of "
                                         f"{length} bytes")
                part = view[:n]
                hasher.update(part)
                _pwrite_all(fd, part, off)
                off += n
                self.received += n
        except OSError:
            self.close()
            raise
        if not keep:
            self.close()
        return self.received

    def _connected(self) -> socket.socket:
        if self._sock is None:
            try:
                sock = socket.create_connection((self.host, self.port), timeout=self.connect_timeout)
            except OSError as exc:
                raise PieceLinkError(f"cannot reach the seeder at {self.host}:{self.port}: {exc}") from exc
            sock.settimeout(self.read_timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sock = sock
        return self._sock

    def _head(self, sock: socket.socket) -> tuple[int, int, bool, bytearray]:
        """(status, Content-Length or -1, keep-alive, body bytes that came with the head)."""
        data = bytearray()
        while True:
            end = data.find(b"\r\n\r\n")
            if end >= 0:
                break
            if len(data) > HEAD_LIMIT:
                raise PieceLinkError("the response head is too long for a seeder's")
            got = sock.recv(HEAD_LIMIT)
            if not got:
                raise PieceLinkError("the seeder closed the connection before answering")
            data += got
        lines = bytes(data[:end]).decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        status = _digits(parts[1]) if len(parts) >= 2 else None
        if status is None or not parts[0].startswith("HTTP/1."):
            raise PieceLinkError(f"not an HTTP response: {lines[0][:80]!r}")
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        length = _digits(headers.get("content-length", ""))
        keep = headers.get("connection", "").lower() != "close" and parts[0] == "HTTP/1.1"
        return status, -1 if length is None else length, keep, data[end + 4:]

    def abort(self) -> None:
        """Make a blocked fetch on another thread return at once (with an OSError)."""
        sock = self._sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()


def _digits(text: str) -> int | None:
    """A status or Content-Length of at most 18 ASCII digits as an int, else None (pure).
    str.isdigit also takes digits such as '²' that int() refuses, and int() refuses more than
    4,300 digits: a seeder that sent either failed the whole fetch with a ValueError instead of
    counting as a failed peer."""
    return int(text) if len(text) <= 18 and text.isascii() and text.isdigit() else None


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    try:
        while data:
            n = os.pwrite(fd, data, offset)
            data = data[n:]
            offset += n
    except OSError as exc:
        raise LocalWriteError(f"writing the piece file failed: {exc}") from exc
