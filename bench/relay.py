"""A delaying TCP relay: a WAN between two parts of the mesh on one machine.

`DelayRelay(target_host, target_port, delay_s, rate_mbit)` listens on a port of its own and
relays every connection to the target, delaying each direction by `delay_s` (two parts see a
round trip of 2 x delay). Sends are scheduled by timestamp: bytes read at t leave at t + delay
(later only if a rate cap makes them wait), so an idle link adds exactly the delay and chunks in
sequence never add up their delays. A rate cap is a token bucket per direction. Byte order,
half-close (EOF one way while the other keeps flowing) and close are carried through; close()
releases every socket. Kernels with netem could do this in `tc`; this machine's kernel has none,
so the relay is the one way the project emulates a WAN.

Run: `python -m bench.relay --listen PORT --target HOST:PORT --delay-ms D [--rate-mbit R]`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from dataclasses import dataclass

__all__ = ["DelayRelay", "TokenBucket"]

CHUNK = 65536
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


class DelayRelay:
    """A relay to `target_host:target_port` that delays each direction by `delay_s`."""

    def __init__(
        self,
        target_host: str,
        target_port: int,
        delay_s: float,
        rate_mbit: float | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.target_host = target_host
        self.target_port = target_port
        self.delay_s = delay_s
        self.rate_mbit = rate_mbit
        self.host = host
        self.port = port
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._accept, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for w in list(self._writers):
            w.close()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await self._server.wait_closed()

    async def __aenter__(self) -> DelayRelay:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _bucket(self) -> TokenBucket | None:
        return TokenBucket(self.rate_mbit * 1e6) if self.rate_mbit else None

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._writers.add(writer)
        up_writer: asyncio.StreamWriter | None = None
        try:
            up_reader, up_writer = await asyncio.open_connection(self.target_host, self.target_port)
            self._writers.add(up_writer)
            async with asyncio.TaskGroup() as group:  # one failed direction ends the other
                group.create_task(self._direction(reader, up_writer, self._bucket()))
                group.create_task(self._direction(up_reader, writer, self._bucket()))
        except (OSError, ExceptionGroup, asyncio.CancelledError):
            # a refused target or a reset end closes both sides below; so does close(), whose
            # cancel must not surface in asyncio's log as the handler's error
            pass
        finally:
            for w in (writer, up_writer):
                if w is not None:
                    w.close()
                    self._writers.discard(w)
            self._tasks.discard(task)

    async def _direction(
        self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, bucket: TokenBucket | None
    ) -> None:
        """Move src's bytes to dst, each chunk leaving `delay_s` after it was read."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def read() -> None:
            try:
                while data := await src.read(CHUNK):
                    now = loop.time()
                    sent = bucket.depart(now, len(data)) if bucket else now
                    queue.put_nowait((sent + self.delay_s, data))
            finally:
                queue.put_nowait((loop.time() + self.delay_s, b""))  # EOF (or reset) travels too

        async def write() -> None:
            while True:
                due, data = await queue.get()
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                if not data:
                    if dst.can_write_eof():
                        with contextlib.suppress(OSError):
                            dst.write_eof()
                    return
                dst.write(data)
                await dst.drain()

        reader = asyncio.create_task(read())
        try:
            await write()
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)


def _parse_target(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host or "127.0.0.1", int(port)


async def _serve(args: argparse.Namespace) -> None:
    host, port = _parse_target(args.target)
    relay = DelayRelay(
        host, port, args.delay_ms / 1000, args.rate_mbit, host=args.host, port=args.listen
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
    parser.add_argument("--target", required=True, help="HOST:PORT to relay to")
    parser.add_argument("--delay-ms", type=float, required=True, help="one-way delay per direction")
    parser.add_argument(
        "--rate-mbit", type=float, default=None, help="rate cap per direction (Mbit/s)"
    )
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
