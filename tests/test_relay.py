"""bench/relay.py: a delaying TCP relay (per-direction delay without accumulation, rate cap, close)."""

from __future__ import annotations

import asyncio
import time

import pytest

from bench.relay import DelayRelay, TokenBucket

DELAY = 0.05
WAIT_S = 30.0  # bounded waits: a hang fails with a message, never a wall-clock limit on speed


async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while data := await reader.read(65536):
        writer.write(data)
        await writer.drain()
    writer.write_eof()  # half-close: echo's EOF follows the client's
    await writer.drain()
    writer.close()


@pytest.fixture
async def echo_port():
    server = await asyncio.start_server(_echo, "127.0.0.1", 0)
    yield server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()


async def _read(reader: asyncio.StreamReader, n: int) -> bytes:
    return await asyncio.wait_for(reader.readexactly(n), WAIT_S)


async def test_round_trip_takes_twice_the_delay_and_keeps_bytes(echo_port: int) -> None:
    async with DelayRelay("127.0.0.1", echo_port, DELAY) as relay:
        reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
        payload = bytes(range(256)) * 4096  # 1 MiB: many chunks, in order
        t0 = time.monotonic()
        writer.write(payload)
        assert await _read(reader, len(payload)) == payload
        assert time.monotonic() - t0 >= 2 * DELAY
        writer.close()


async def test_more_than_a_links_worth_in_flight_waits_and_arrives_whole(echo_port: int) -> None:
    """12 MiB at once: each direction holds at most PENDING_MAX, then its sender waits (no byte lost)."""
    async with DelayRelay("127.0.0.1", echo_port, 0.02) as relay:
        reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
        payload = bytes(range(251)) * (12 * 4178)
        writer.write(payload)
        assert await _read(reader, len(payload)) == payload
        writer.close()


async def _each_message_in_order_after_its_delay(port: int, gap_s: float) -> None:
    """Send 20 messages `gap_s` apart through the relay at `port` to the echo server: each comes
    back in order, at least 2 x DELAY after its own send."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    sends = []
    for i in range(20):
        sends.append(time.monotonic())
        writer.write(bytes([i]) * 100)
        await writer.drain()
        await asyncio.sleep(gap_s)
    for i in range(20):
        assert await _read(reader, 100) == bytes([i]) * 100
        assert time.monotonic() - sends[i] >= 2 * DELAY
    writer.close()


async def test_each_message_is_delayed_from_its_own_send(echo_port: int) -> None:
    """Messages sent 10 ms apart each take at least 2D from their own send (in order)."""
    async with DelayRelay("127.0.0.1", echo_port, DELAY) as relay:
        await _each_message_in_order_after_its_delay(relay.port, gap_s=0.01)


async def test_rate_cap_spaces_bytes_out(echo_port: int) -> None:
    rate_mbit = 8.0  # 1 MB/s each way
    nbytes = 400_000
    async with DelayRelay("127.0.0.1", echo_port, 0.0, rate_mbit) as relay:
        reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
        t0 = time.monotonic()
        writer.write(b"y" * nbytes)
        await _read(reader, nbytes)
        # Both directions are capped; the pipeline overlaps them, so at least one transfer's time.
        assert time.monotonic() - t0 >= (nbytes - 2 * 16384) * 8 / (rate_mbit * 1e6)
        writer.close()


async def test_a_shared_rate_cap_is_one_link_for_every_connection(echo_port: int) -> None:
    rate_mbit = 8.0  # 1 MB/s each way, for both connections together
    nbytes = 300_000
    async with DelayRelay("127.0.0.1", echo_port, 0.0, rate_mbit, shared_rate=True) as relay:
        pairs = [await asyncio.open_connection("127.0.0.1", relay.port) for _ in range(2)]
        t0 = time.monotonic()
        for _, writer in pairs:
            writer.write(b"z" * nbytes)
        await asyncio.gather(*(_read(reader, nbytes) for reader, _ in pairs))
        # the two transfers queue on one cap: at least both their bytes' time (less the bursts)
        assert time.monotonic() - t0 >= (2 * nbytes - 4 * 16384) * 8 / (rate_mbit * 1e6)
        for _, writer in pairs:
            writer.close()


def test_token_bucket_lets_a_burst_through_then_waits() -> None:
    bucket = TokenBucket(rate_bps=8e6, burst=1000, tokens=1000)  # 1 MB/s
    assert bucket.depart(0.0, 1000) == 0.0
    assert bucket.depart(0.0, 1000) == pytest.approx(0.001)
    assert bucket.depart(0.0, 1000) == pytest.approx(0.002)  # in order: debts add up
    assert bucket.depart(1.0, 500) == 1.0  # idle refilled the bucket (up to its depth)


async def test_half_close_and_close_propagate(echo_port: int) -> None:
    async with DelayRelay("127.0.0.1", echo_port, DELAY) as relay:
        reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
        writer.write(b"last words")
        writer.write_eof()  # our half closes; the echo still answers, then closes its half
        assert await _read(reader, 10) == b"last words"
        assert await asyncio.wait_for(reader.read(), WAIT_S) == b""  # the echo's EOF came through
        writer.close()


async def test_close_releases_connections(echo_port: int) -> None:
    relay = DelayRelay("127.0.0.1", echo_port, DELAY)
    await relay.start()
    reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
    writer.write(b"ping")
    assert await _read(reader, 4) == b"ping"
    await relay.close()
    assert await asyncio.wait_for(reader.read(), WAIT_S) == b""  # the client sees the relay close
    with pytest.raises(OSError):
        await asyncio.open_connection("127.0.0.1", relay.port)
    writer.close()


async def test_refused_target_closes_the_client() -> None:
    async with DelayRelay("127.0.0.1", 1, DELAY) as relay:  # nothing listens on port 1
        reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
        assert await asyncio.wait_for(reader.read(), WAIT_S) == b""
        writer.close()


def test_the_relay_keeps_its_delay_order_and_half_close_on_uvloop() -> None:
    """The benches run the relay on uvloop, whose loop clock and timers count milliseconds."""
    uvloop = pytest.importorskip("uvloop")

    async def scenario() -> None:
        server = await asyncio.start_server(_echo, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with DelayRelay("127.0.0.1", port, DELAY) as relay:
            reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
            sends = []
            for i in range(10):
                sends.append(time.monotonic())
                writer.write(bytes([i]) * 3000)
                await asyncio.sleep(0.003)
            for i in range(10):
                assert await _read(reader, 3000) == bytes([i]) * 3000
                assert time.monotonic() - sends[i] >= 2 * DELAY - 0.001  # early by at most a timer tick
            writer.write_eof()
            assert await asyncio.wait_for(reader.read(), WAIT_S) == b""
            writer.close()
        server.close()
        await server.wait_closed()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(scenario())


async def test_jitter_is_seeded_keeps_order_and_only_adds_delay(echo_port: int) -> None:
    """Each chunk waits the delay plus a seeded draw in [0, J); bytes never overtake each other."""
    draws = [[DelayRelay("127.0.0.1", echo_port, DELAY, jitter_s=0.03, seed=s).draw_jitter() for _ in range(5)]
             for s in (7, 7, 8)]
    assert draws[0] == draws[1] != draws[2] and all(0 <= d < 0.03 for d in draws[0])
    async with DelayRelay("127.0.0.1", echo_port, DELAY, jitter_s=0.03, seed=7) as relay:
        await _each_message_in_order_after_its_delay(relay.port, gap_s=0.002)
