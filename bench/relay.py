"""A delaying TCP relay: a WAN between two parts of the mesh on one machine.

`DelayRelay(target_host, target_port, delay_s, rate_mbit, jitter_s=..., seed=...)` listens on a
port of its own and relays every connection to the target, delaying each direction by `delay_s`
(two parts see a round trip of 2 x delay). Sends are scheduled by timestamp: bytes read at t leave
at t + delay (later only if a rate cap makes them wait), so an idle link adds exactly the delay and
chunks in sequence never add up their delays. A rate cap is a token bucket per direction of each
connection, or with `shared_rate=True` one per direction for all the relay's connections (a
capped uplink that every connection to the target shares, as a fetch over several connections
meets it). Jitter adds to each chunk's delay a draw from [0, jitter_s) of a generator seeded with
`seed` (the same seed draws the same sequence), never reordering bytes: a chunk leaves no earlier
than the one before it in its direction, as behind a real link's queue. Byte order,
half-close (EOF one way while the other keeps flowing) and close are carried through; close()
releases every socket. Kernels with netem could do this in `tc`; this machine's kernel has none,
so the relay is the one way the project emulates a WAN.

Run: `python -m bench.relay --listen PORT --target HOST:PORT --delay-ms D [--rate-mbit R]
[--jitter-ms J --seed S]`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import time
from collections import deque
from dataclasses import dataclass

from bench.due_timers import DueTimers, Wake
from bus.cli_args import number

__all__ = ["DelayRelay", "TokenBucket"]

PENDING_MAX = 1 << 22  # bytes a direction holds in flight before its sender must wait
SHARED_QUEUE_BYTES = 1 << 18  # per connection, behind a shared rate cap: a short router queue
BURST_BYTES = 16384  # a token bucket's depth: about one TCP window's worth of a small burst


@dataclass
class TokenBucket:
    """Departure times for a link of `rate_bps` bits/s that lets `burst` bytes through at once.

    Pure arithmetic (no clock of its own): `depart(now, n)` says when n bytes offered at `now`
    have left the link. Tokens may go negative (a debt later sends wait out), so bytes leave in
    the order they arrive.
    """

    rate_bps: float
    burst: float = BURST_BYTES
    tokens: float = BURST_BYTES
    last: float | None = None

    def depart(self, now: float, nbytes: int) -> float:
        if self.last is not None:
            self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate_bps / 8)
        self.last = now
        self.tokens -= nbytes
        return now + max(0.0, -self.tokens) * 8 / self.rate_bps


class _Half(asyncio.Protocol):
    """One socket of a relayed connection: the bytes it reads leave its peer's socket `delay_s`
    later, in order, from loop callbacks alone (no task or queue per chunk: a relay's own
    wake-ups are part of what one token pays on the emulated WAN, which a real network's kernel
    does not charge), woken by the relay's DueTimers at each chunk's due time. EOF and close
    travel the same way, after the bytes before them."""

    def __init__(self, relay: DelayRelay, accepted: bool = False) -> None:
        self.relay = relay
        self.accepted = accepted  # a client's socket: what it reads waits for the target's to connect
        self.bucket = relay._bucket(accepted)
        self.transport: asyncio.Transport | None = None
        self.peer: _Half | None = None
        self.pending: deque[tuple[float, bytes | None]] = deque()  # (due, data); None: EOF, b"": close
        self.pending_bytes = 0
        self.last_due = 0.0  # the latest due time given: jitter never lets a chunk overtake one
        self.wake: Wake | None = None  # the flush at the pending head's time
        self.ended = False  # this half's EOF (or close) reached its peer
        self.paused = False  # the peer cannot take more: this half stopped reading
        self.lost = False  # the socket closed (before or after its peer was connected)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # (uvloop's are not asyncio.Transport subclasses)
        self.relay._transports.add(transport)
        if self.accepted:
            self.relay._connect_target(self)

    def data_received(self, data: bytes) -> None:
        self._later(data, len(data))

    def eof_received(self) -> bool:
        self._later(None, 0)
        return True  # half-close: the other direction keeps flowing

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self.transport is not None:
            self.relay._transports.discard(self.transport)
        if self.peer is None or self.relay.closed:
            return
        if exc is not None:  # a reset end: the other side closes at once
            self._cancel()
            self.peer._close()
        else:
            self._later(b"", 0)

    def pause_writing(self) -> None:  # our socket is full: the peer stops reading
        if self.peer is not None:
            self.peer._pause(True)

    def resume_writing(self) -> None:
        if self.peer is not None:
            self.peer._pause(False)

    def _pause(self, paused: bool) -> None:
        self.paused = paused
        if self.transport is None or self.transport.is_closing():
            return
        if paused:
            self.transport.pause_reading()
        elif self.pending_bytes <= self.relay.pending_max:
            self.transport.resume_reading()

    def _later(self, data: bytes | None, n: int) -> None:
        now = time.monotonic()  # (uvloop's loop.time() counts whole milliseconds)
        due = (self.bucket.depart(now, n) if self.bucket and n else now) + self.relay.delay_s
        if self.relay.jitter_s:
            due = self.last_due = max(self.last_due, due + self.relay.draw_jitter())
        if not self.pending and due <= now and self.peer is not None:
            self._deliver(data)  # no delay and nothing before it: straight through
            return
        self.pending.append((due, data))
        self.pending_bytes += n
        if self.pending_bytes > self.relay.pending_max and self.transport is not None:
            self.transport.pause_reading()  # a full link: the sender waits, as on a real one
        if self.wake is None and self.peer is not None:
            self._schedule()

    def _schedule(self) -> None:
        self.wake = self.relay._timers().at(self.pending[0][0], self._flush)

    def _flush(self) -> None:
        self.wake = None
        now = time.monotonic() + self.relay._timers().resolution / 2
        while self.pending and self.pending[0][0] <= now:
            _, data = self.pending.popleft()
            self.pending_bytes -= len(data or b"")
            self._deliver(data)
        if self.pending:
            self._schedule()
        if (self.pending_bytes <= self.relay.pending_max and not self.paused and self.transport is not None
                and not self.transport.is_closing()):
            self.transport.resume_reading()

    def _deliver(self, data: bytes | None) -> None:
        peer = self.peer
        assert peer is not None and peer.transport is not None
        if data:
            if not peer.transport.is_closing():
                peer.transport.write(data)
        elif data is None:  # EOF
            self.ended = True
            if peer.transport.can_write_eof() and not peer.transport.is_closing():
                with contextlib.suppress(OSError):
                    peer.transport.write_eof()
            if peer.ended:  # both halves said all they had: the connection is over
                self._close()
                peer._close()
        else:  # the socket closed: so does the other side
            self.ended = True
            peer._close()

    def _cancel(self) -> None:
        if self.wake is not None:
            self.wake.cancel()
            self.wake = None
        self.pending.clear()

    def _close(self) -> None:
        self._cancel()
        if self.transport is not None:
            self.transport.close()


class DelayRelay:
    """A relay to `target_host:target_port` that delays each direction by `delay_s` (plus a
    seeded jitter in [0, jitter_s) per chunk, bytes kept in order). `delay_s` may be changed
    while it runs (a link that degrades or recovers): bytes read from then on take the new
    delay, and never overtake the bytes before them."""

    def __init__(
        self,
        target_host: str,
        target_port: int,
        delay_s: float,
        rate_mbit: float | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        shared_rate: bool = False,
        jitter_s: float = 0.0,
        seed: int = 0,
    ) -> None:
        if not delay_s >= 0 or (rate_mbit is not None and not rate_mbit > 0):  # (NaN fails both)
            raise ValueError(f"a relay needs a delay >= 0 and a rate cap > 0 or none, got {delay_s} s, {rate_mbit} Mbit/s")
        if not jitter_s >= 0:
            raise ValueError(f"a relay's jitter must be >= 0, got {jitter_s} s")
        self.jitter_s = jitter_s
        self._rng = random.Random(seed)
        self.target_host = target_host
        self.target_port = target_port
        self.delay_s = delay_s
        self.rate_mbit = rate_mbit
        # one bucket per direction for every connection (sending to the target, from it)
        self._shared = (self._new_bucket(), self._new_bucket()) if shared_rate else None
        # bytes a direction of a connection holds before its sender waits: on a shared link, what
        # the delay holds plus a short queue (as TCP's window keeps it), so that a new connection's
        # first bytes do not queue behind seconds of the others' (and a cut one's bytes are few)
        self.pending_max = (int(rate_mbit * 1e6 / 8 * delay_s) + SHARED_QUEUE_BYTES
                            if shared_rate and rate_mbit else PENDING_MAX)
        self.host = host
        self.port = port
        self._server: asyncio.Server | None = None
        self._connecting: set[asyncio.Task[None]] = set()
        self._transports: set[asyncio.Transport] = set()
        self._clock: DueTimers | None = None  # every half's flushes, from start() to close()
        self.closed = False

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def start(self) -> int:
        loop = asyncio.get_running_loop()
        self._clock = self._clock or DueTimers(loop)
        try:
            self._server = await loop.create_server(self._accepted, self.host, self.port)
        except BaseException:
            self._clock.close()  # a refused port leaves no timer behind
            self._clock = None
            raise
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def close(self) -> None:
        self.closed = True  # no more connections, timers or deliveries
        if self._server is not None:
            self._server.close()
        for t in list(self._connecting):
            t.cancel()
        await asyncio.gather(*self._connecting, return_exceptions=True)
        for tr in list(self._transports):
            tr.abort()
        for _ in range(100):  # connection_lost runs on the next loop turns
            if not self._transports:
                break
            await asyncio.sleep(0)
        if self._clock is not None:
            self._clock.close()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await self._server.wait_closed()

    async def __aenter__(self) -> DelayRelay:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def draw_jitter(self) -> float:
        """The next chunk's extra delay, from the relay's seeded generator."""
        return self._rng.uniform(0.0, self.jitter_s)

    def _timers(self) -> DueTimers:
        assert self._clock is not None, "start() the relay first"
        return self._clock

    def _new_bucket(self) -> TokenBucket | None:
        return TokenBucket(self.rate_mbit * 1e6) if self.rate_mbit else None

    def _bucket(self, to_target: bool) -> TokenBucket | None:
        """The bucket of a half that reads what goes to the target (`to_target`) or comes from it."""
        if self._shared is not None:
            return self._shared[0] if to_target else self._shared[1]
        return self._new_bucket()

    def _accepted(self) -> _Half:
        return _Half(self, accepted=True)

    def _connect_target(self, client: _Half) -> None:
        if self.closed:
            client._close()
            return
        task = asyncio.get_running_loop().create_task(self._connect(client))
        self._connecting.add(task)
        task.add_done_callback(self._connecting.discard)

    async def _connect(self, client: _Half) -> None:
        assert client.transport is not None
        try:
            _, target = await asyncio.get_running_loop().create_connection(
                lambda: _Half(self), self.target_host, self.target_port)
        except (OSError, asyncio.CancelledError):
            client._close()  # a refused target closes the client (close() cancels: the same)
            return
        if client.lost or target.lost or self.closed:  # either end went while the other connected
            client._close()
            target._close()
            return
        client.peer, target.peer = target, client
        for half in (client, target):  # bytes that came before the pairing go now
            if half.pending and half.wake is None:
                half._schedule()


def _parse_target(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"wants HOST:PORT, got {text!r}")
    return host or "127.0.0.1", int(port)


async def _serve(args: argparse.Namespace) -> None:
    host, port = args.target
    relay = DelayRelay(
        host, port, args.delay_ms / 1000, args.rate_mbit, host=args.host, port=args.listen,
        shared_rate=args.shared_rate, jitter_s=args.jitter_ms / 1000, seed=args.seed,
    )
    await relay.start()
    print(
        f"relaying {relay.address} -> {host}:{port} delay {args.delay_ms} ms each way", flush=True
    )
    try:
        await asyncio.Event().wait()
    finally:
        await relay.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--listen", type=int, required=True, help="port to listen on (0: any free port)"
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--target", required=True, type=_parse_target, help="HOST:PORT to relay to")
    parser.add_argument("--delay-ms", type=number(0), required=True, help="one-way delay per direction")
    parser.add_argument(
        "--rate-mbit", type=number(0, above=True), default=None, help="rate cap per direction (Mbit/s)"
    )
    parser.add_argument(
        "--shared-rate", action="store_true", help="one rate cap per direction for all connections (an uplink)"
    )
    parser.add_argument("--jitter-ms", type=number(0), default=0.0,
                        help="extra delay per chunk, drawn from [0, J) (bytes stay in order)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the jitter's draws")
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
