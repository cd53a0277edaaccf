"""The admission queue's decisions (pure, time passed in), and the Retry-After its gate gives."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from gateway.admission import AdmissionQueue, QueueLimits, fair_share, fair_tag, retry_after_seconds
from gateway.admission_gate import AdmissionGate
from gateway.errors import QueueFullError
from gateway.metrics import GatewayMetrics


def join(q: AdmissionQueue, now: float) -> int:
    ticket = q.join(now)
    assert ticket is not None, "the queue refused a ticket"
    return ticket


def test_positions_follow_arrival_and_close_up_when_anyone_leaves() -> None:
    q = AdmissionQueue(QueueLimits(max_queue=8, timeout=10.0))
    a, b, c, d = (join(q, float(i)) for i in range(4))
    assert [q.position(t) for t in (a, b, c, d)] == [1, 2, 3, 4]
    q.leave(c, now=5.0)  # a client in the middle left
    assert [q.position(t) for t in (a, b, d)] == [1, 2, 3]
    q.leave(a, now=5.0)
    assert [q.position(t) for t in (b, d)] == [1, 2]
    assert q.depth == 2
    with pytest.raises(KeyError):
        q.position(a)


@pytest.mark.parametrize(
    ("position", "room", "may_try"),
    [(1, 1, True), (1, 0, False), (2, 1, False), (2, 2, True), (3, 2, False), (3, 64, True)],
)
def test_as_many_ask_for_a_route_as_there_is_room_for_in_arrival_order(
    position: int, room: int, may_try: bool
) -> None:
    q = AdmissionQueue()
    tickets = [join(q, 0.0) for _ in range(3)]
    assert q.may_try(tickets[position - 1], room=room) is may_try


def test_a_full_queue_refuses_and_a_freed_place_is_taken_again() -> None:
    q = AdmissionQueue(QueueLimits(max_queue=2, timeout=10.0))
    first, second = join(q, 0.0), join(q, 0.0)
    assert q.join(0.0) is None  # full
    q.leave(first, 1.0)
    third = join(q, 1.0)
    assert q.position(third) == 2 and q.position(second) == 1


def test_an_admitted_requests_later_choices_are_never_refused_for_a_full_queue() -> None:
    q = AdmissionQueue(QueueLimits(max_queue=1))
    join(q, 0.0)
    assert q.join(0.0) is None  # a new request: refused
    later = q.join(0.0, bounded=False)  # choice 2 of a request the gateway took
    assert later is not None and q.position(later) == 2


def test_zero_max_queue_refuses_everyone_without_room() -> None:
    assert AdmissionQueue(QueueLimits(max_queue=0)).join(0.0) is None


def test_a_burst_beyond_the_queue_is_admitted_while_there_is_room() -> None:
    """280 requests at once, 64 free places and a queue of 256: none is refused (before, every
    request queued first, and 24 got 503 with all 64 places free)."""
    q = AdmissionQueue(QueueLimits(max_queue=256))
    tickets = [q.join(0.0, room=64) for _ in range(280)]
    assert all(t is not None for t in tickets)
    assert q.join(0.0, room=64) is not None and len([q.join(0.0, room=64) for _ in range(39)]) == 39
    assert q.join(0.0, room=64) is None  # 256 beyond the 64 that may try


@pytest.mark.parametrize(("arrived", "now", "remaining"), [(0.0, 0.0, 5.0), (1.0, 4.0, 2.0), (0.0, 5.0, 0.0),
                                                         (0.0, 7.5, -2.5)])
def test_remaining_wait_counts_from_arrival(arrived: float, now: float, remaining: float) -> None:
    q = AdmissionQueue(QueueLimits(timeout=5.0))
    ticket = join(q, arrived)
    assert q.remaining(ticket, now) == pytest.approx(remaining)


def test_leave_reports_the_wait_and_ended_sessions_steer_retry_after() -> None:
    q = AdmissionQueue(QueueLimits(timeout=60.0))
    t = join(q, 0.0)
    assert q.leave(t, 11.0) == pytest.approx(11.0)
    assert q.leave(t, 60.0) == 0.0  # leaving twice is a no-op
    start = q.session_s
    q.session_ended(20.0)
    assert q.session_s == pytest.approx(start + 0.2 * (20.0 - start))
    for _ in range(8):
        join(q, 0.0)
    assert q.retry_after(max_sessions=2) == retry_after_seconds(8, 2, q.session_s, 60.0)


@pytest.mark.parametrize(
    ("waiting", "places", "session_s", "timeout", "seconds"),
    [(0, 64, 30.0, 60.0, 1), (64, 64, 0.5, 60.0, 1), (64, 64, 1.5, 60.0, 2), (128, 64, 20.0, 60.0, 40),
     (256, 64, 30.0, 60.0, 60), (10, 0, 3.0, 60.0, 30), (5, 1, 3.0, 2.2, 3)],
)
def test_retry_after_estimates_the_wait_in_whole_seconds_within_bounds(
    waiting: int, places: int, session_s: float, timeout: float, seconds: int
) -> None:
    """A deep queue says so: 128 waiting for 64 places of 20 s sessions is 40 s, not 1 s."""
    assert retry_after_seconds(waiting, places, session_s, timeout) == seconds


async def test_retry_after_counts_how_long_the_running_sessions_have_run_before_any_ended() -> None:
    """A fresh gateway whose places are held by sessions that have run 30 s and go on: a
    refused request is told about a minute (2 waiting for 1 place, each held 30 s at least),
    not the 2 s the starting guess of a 1 s session gave, which sent clients back to be
    refused again and again while nothing could move."""
    now = [0.0]
    gate = AdmissionGate(QueueLimits(max_queue=2, timeout=100.0), max_sessions=1, metrics=GatewayMetrics(),
                         clock=lambda: now[0])
    refusal, _ = await _one_more_after_30s(gate, now, lambda: gate.queue.depth >= 2)
    assert refusal.retry_after == 60


async def _one_more_after_30s(gate: AdmissionGate, now: list[float],
                              ready: Callable[[], bool]) -> tuple[QueueFullError, int]:
    """One session holds the mesh's one place (a route is refused while it runs) and two
    requests wait for it (until `ready`); 30 s on, one more asks: its refusal, and the places
    the gate counted then."""
    async def route(waited: bool) -> str | None:
        return None if gate.active else "route"

    async def wait() -> None:
        async with gate.admitted(route, on_wait=lambda _: None, client_gone=lambda: False):
            pass

    async with gate.admitted(route, on_wait=lambda _: None, client_gone=lambda: False):
        waiters = [asyncio.create_task(wait()) for _ in range(2)]
        while not ready():  # noqa: ASYNC110 - the waiters join the line on their own
            await asyncio.sleep(0.01)
        now[0] = 30.0
        places = gate.places()
        with pytest.raises(QueueFullError) as info:
            await wait()
        for task in waiters:
            task.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)
    return info.value, places


async def test_retry_after_counts_the_places_the_mesh_gives_when_it_is_full() -> None:
    """--max-sessions 64, but the mesh has room for one session (the tracker says no_capacity
    while it runs): 2 waiting (1 beyond the one that may ask) for that one place, held 30 s so
    far, is told about a minute.
    Divided over the 64 places the gateway would have liked, it was 1 s, and clients came
    back to be refused again and again while nothing could move."""
    now = [0.0]
    gate = AdmissionGate(QueueLimits(max_queue=1, timeout=100.0), max_sessions=64, metrics=GatewayMetrics(),
                         clock=lambda: now[0])
    refusal, places = await _one_more_after_30s(gate, now, lambda: gate.queue.depth >= 2 and gate.mesh_full)
    assert places == 1 and refusal.retry_after == 60


@pytest.mark.parametrize(("max_queue", "owners", "share"), [(8, 2, 4), (8, 1, 8), (7, 2, 4), (1, 3, 1), (0, 2, 1)])
def test_a_keys_fair_share_is_an_equal_part_of_the_queue_rounded_up(max_queue: int, owners: int, share: int) -> None:
    assert fair_share(max_queue, owners) == share


@pytest.mark.parametrize(("owner_last", "floor", "tag"), [(None, 0, 1), (None, 7, 8), (3, 0, 4), (9, 4, 10)])
def test_a_ticket_follows_its_owners_last_or_else_the_lines_progress(owner_last: int | None, floor: int,
                                                                     tag: int) -> None:
    assert fair_tag(owner_last, floor) == tag


def test_owners_interleave_in_line_and_each_keeps_its_arrival_order() -> None:
    q = AdmissionQueue(QueueLimits(max_queue=16))
    a = [q.join(0.0, owner="A") for _ in range(3)]
    b = [q.join(0.0, owner="B") for _ in range(2)]
    assert [q.position(t) for t in (a[0], b[0], a[1], b[1], a[2])] == [1, 2, 3, 4, 5]  # type: ignore[arg-type]


def test_one_keys_flood_neither_fills_the_queue_nor_stands_before_another_key() -> None:
    """Two keys, a queue of 8: key A sent 14 requests and B one short one. Before, A's took all
    8 places and B got 503 queue_full; with a place, B waited behind every one of A's."""
    q = AdmissionQueue(QueueLimits(max_queue=8, timeout=60.0))
    flood = [q.join(0.0, owner="A", owners=2) for _ in range(14)]
    assert sum(t is not None for t in flood) == 4  # A's share; the rest is queue_full
    assert q.share_held("A", 0, 2) == 4 and q.share_held("B", 0, 2) is None  # why A was refused
    b = q.join(1.0, owner="B", owners=2)
    assert b is not None and q.position(b) == 2  # after A's first, before A's others
    a_first = flood[0]
    assert a_first is not None and q.position(a_first) == 1
    q.leave(a_first, 2.0)  # admitted: B is next, not A's second
    assert q.position(b) == 1 and q.may_try(b, room=1)
    q.leave(b, 3.0)
    later_b = q.join(4.0, owner="B", owners=2)  # B again: after A's next, as the line stands now
    assert later_b is not None and q.position(later_b) == 2


def test_one_owner_keeps_the_whole_queue_and_arrival_order() -> None:
    q = AdmissionQueue(QueueLimits(max_queue=3))
    tickets = [q.join(0.0, owner="A", owners=1) for _ in range(3)]
    assert None not in tickets and q.join(0.0, owner="A", owners=1) is None
    assert [q.position(t) for t in tickets if t is not None] == [1, 2, 3]


async def test_the_gate_gives_another_keys_request_the_next_free_place() -> None:
    """Through the gate: one place held, key A waits with 3 requests, then key B with one:
    when the place frees twice, A's first and then B's request get it."""
    gate = AdmissionGate(QueueLimits(max_queue=8, timeout=100.0), max_sessions=1, metrics=GatewayMetrics(),
                         owners=2)
    order: list[str] = []
    release = asyncio.Event()

    async def route(waited: bool) -> str | None:
        return None if gate.active else "route"

    async def wait(name: str, owner: str) -> None:
        async with gate.admitted(route, on_wait=lambda _: None, client_gone=lambda: False, owner=owner):
            order.append(name)
            await release.wait()

    holder = asyncio.create_task(wait("held", "A"))
    while not gate.active:  # noqa: ASYNC110 - the holder takes the place on its own
        await asyncio.sleep(0.01)
    tasks = [asyncio.create_task(wait(f"A{i}", "A")) for i in range(3)]
    while gate.queue.depth < 3:  # noqa: ASYNC110
        await asyncio.sleep(0.01)
    tasks.append(asyncio.create_task(wait("B", "B")))
    while gate.queue.depth < 4:  # noqa: ASYNC110
        await asyncio.sleep(0.01)
    release.set()  # each admitted waiter leaves at once
    await asyncio.gather(holder, *tasks)
    assert order == ["held", "A0", "B", "A1", "A2"]


def test_later_choices_waiting_never_fill_the_queue_against_new_requests() -> None:
    """Two requests of n=8 (14 later choices waiting) and a queue of 8: before, another key's
    request was a 503 queue_full ('8 requests already wait', none of them a request)."""
    q = AdmissionQueue(QueueLimits(max_queue=8))
    choices = [q.join(0.0, bounded=False, owner="A", owners=2) for _ in range(14)]
    b = q.join(1.0, owner="B", owners=2)
    assert b is not None and q.position(b) == 2  # its fair turn, right after A's first choice
    assert [q.join(1.0, owner="B", owners=2) for _ in range(4)].count(None) == 1  # B's share is 4
    assert q.share_held("B", 0, 2) == 4
    for ticket in choices:
        q.leave(ticket, 2.0)  # type: ignore[arg-type]
    assert q.depth == 4 and q.share_held("B", 0, 2) == 4
    q.leave(b, 3.0)
    assert q.join(3.0, owner="B", owners=2) is not None
