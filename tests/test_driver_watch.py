"""DriverWatch (nodes/server/driver_watch.py): a node frees the sessions of a silent driver, but
never for a silence of its own bus: once that bus is back, every driver counts as heard from."""

from __future__ import annotations

import time
from types import SimpleNamespace

from bus.errors import BusTimeoutError
from nodes.server.driver_watch import DriverWatch


class _Bus:
    def __init__(self, rtt_s: float = 0.0) -> None:
        self.answers = True
        self.reconnects = 0
        self.rtt_s = rtt_s  # how long its round trip takes (an answer later than the timeout is none)

    async def flush(self, timeout: float = 5.0) -> None:
        if not self.answers or self.rtt_s > timeout:
            raise BusTimeoutError("<flush>", timeout)


class _Table:
    def __init__(self, opened_at: float) -> None:
        route = SimpleNamespace(driver_id="gw-1")
        self.live = {"s1": SimpleNamespace(route=route, opened_at=opened_at)}
        self.ended: list[str] = []

    async def end(self, sid: str, phase: object, reason: str, park: bool = False) -> bool:
        self.ended.append(sid)
        return self.live.pop(sid, None) is not None


async def test_a_bus_that_answers_again_after_an_outage_frees_nothing_for_the_silence() -> None:
    now = time.monotonic()
    bus, table = _Bus(), _Table(opened_at=now - 30)
    watch = DriverWatch(bus, table, silence_s=8.0)  # type: ignore[arg-type]
    watch.seen["gw-1"] = now - 20  # last DriverAlive before this node's bus went quiet
    bus.answers = False
    assert await watch.check() == []  # the silence may be this node's own
    bus.answers = True  # the server answers again; the driver's DriverAlive are still on their way
    assert await watch.check() == [] and table.ended == []
    watch.seen["gw-1"] = time.monotonic() - 9  # then silent for longer than the silence bound: freed
    assert await watch.check() == ["s1"]


async def test_a_reconnect_counts_every_driver_as_heard_from_then() -> None:
    now = time.monotonic()
    bus, table = _Bus(), _Table(opened_at=now - 30)
    watch = DriverWatch(bus, table, silence_s=8.0)  # type: ignore[arg-type]
    watch.seen["gw-1"] = now - 20
    bus.reconnects += 1  # the connection came back: the first round trip answers at once
    assert await watch.check() == [] and table.ended == []


async def test_a_driver_silent_while_the_bus_answers_is_freed() -> None:
    now = time.monotonic()
    bus, table = _Bus(), _Table(opened_at=now - 30)
    watch = DriverWatch(bus, table, silence_s=8.0)  # type: ignore[arg-type]
    watch.rtt.add(1.5)  # what run()'s measurements found
    watch.seen["gw-1"] = now - 20
    assert await watch.check() == ["s1"]


async def test_a_step_of_the_nodes_wall_clock_frees_no_session_of_a_live_driver(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Silences are timed on the monotonic clock: when the node's wall clock steps forward 10
    minutes (NTP, a resumed VM), a driver heard a moment ago is not silent. On the wall clock,
    every running stream on the node was aborted at the next check."""
    bus, table = _Bus(), _Table(opened_at=time.monotonic())
    watch = DriverWatch(bus, table, silence_s=8.0)  # type: ignore[arg-type]

    async def one_alive():  # type: ignore[no-untyped-def]
        yield SimpleNamespace(driver_id="gw-1")

    await watch._follow(one_alive())  # the driver's DriverAlive, just read
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 600.0)
    assert await watch.check() == [] and table.ended == []


async def test_a_driver_silent_behind_a_slow_bus_link_is_still_freed() -> None:
    """A node whose bus link is far (a satellite's 700 ms with jitter: round trips of 1.5 s)
    still frees a dead driver's sessions: the check's round trip may take two measured ones
    more. Before, it had to answer within 1 s, so such a node counted its own bus as deaf at
    every check and freed nothing until the lease."""
    now = time.monotonic()
    bus, table = _Bus(rtt_s=1.5), _Table(opened_at=now - 30)
    watch = DriverWatch(bus, table, silence_s=8.0)  # type: ignore[arg-type]
    watch.rtt.add(1.5)  # what run()'s measurements found
    watch.seen["gw-1"] = now - 20
    assert await watch.check() == ["s1"]
