"""The admission queue's decisions (pure, time passed in)."""

from __future__ import annotations

import pytest

from gateway.admission import AdmissionQueue, QueueLimits, retry_after_seconds


def join(q: AdmissionQueue, now: float) -> int:
    ticket = q.join(now)
    assert ticket is not None, "the queue refused a ticket"
    return ticket


def test_positions_follow_arrival_and_close_up_when_anyone_leaves() -> None:
    q = AdmissionQueue(QueueLimits(max_queue=8, timeout=10.0))
    a, b, c, d = (join(q, float(i)) for i in range(4))
    assert [q.position(t) for t in (a, b, c, d)] == [1, 2, 3, 4]
    q.leave(c, now=5.0, admitted=False)  # a client in the middle left
    assert [q.position(t) for t in (a, b, d)] == [1, 2, 3]
    q.leave(a, now=5.0, admitted=True)
    assert [q.position(t) for t in (b, d)] == [1, 2]
    assert q.depth == 2
    with pytest.raises(KeyError):
        q.position(a)


@pytest.mark.parametrize(
    ("position", "has_room", "may_try"),
    [(1, True, True), (1, False, False), (2, True, False), (3, False, False)],
)
def test_only_the_head_asks_for_a_route_and_only_with_room(
    position: int, has_room: bool, may_try: bool
) -> None:
    q = AdmissionQueue()
    tickets = [join(q, 0.0) for _ in range(3)]
    assert q.may_try(tickets[position - 1], has_room=has_room) is may_try


def test_a_full_queue_refuses_and_a_freed_place_is_taken_again() -> None:
    q = AdmissionQueue(QueueLimits(max_queue=2, timeout=10.0))
    first, second = join(q, 0.0), join(q, 0.0)
    assert q.join(0.0) is None  # full
    q.leave(first, 1.0, admitted=True)
    third = join(q, 1.0)
    assert q.position(third) == 2 and q.position(second) == 1


def test_zero_max_queue_refuses_everyone() -> None:
    assert AdmissionQueue(QueueLimits(max_queue=0)).join(0.0) is None


@pytest.mark.parametrize(("arrived", "now", "remaining"), [(0.0, 0.0, 5.0), (1.0, 4.0, 2.0), (0.0, 5.0, 0.0),
                                                         (0.0, 7.5, -2.5)])
def test_remaining_wait_counts_from_arrival(arrived: float, now: float, remaining: float) -> None:
    q = AdmissionQueue(QueueLimits(timeout=5.0))
    ticket = join(q, arrived)
    assert q.remaining(ticket, now) == pytest.approx(remaining)


def test_leave_reports_the_wait_and_admitted_waits_steer_retry_after() -> None:
    q = AdmissionQueue(QueueLimits(timeout=60.0))
    start = q.recent_wait
    t = join(q, 0.0)
    assert q.leave(t, 11.0, admitted=True) == pytest.approx(11.0)
    assert q.recent_wait == pytest.approx(start + 0.2 * (11.0 - start))
    before = q.recent_wait
    gone = join(q, 20.0)
    assert q.leave(gone, 50.0, admitted=False) == pytest.approx(30.0)
    assert q.recent_wait == before  # expired and abandoned waits do not count
    assert q.leave(gone, 60.0, admitted=False) == 0.0  # leaving twice is a no-op
    assert q.retry_after() == retry_after_seconds(before, 60.0)


@pytest.mark.parametrize(
    ("recent", "timeout", "seconds"),
    [(0.0, 60.0, 1), (0.2, 60.0, 1), (1.0, 60.0, 1), (1.01, 60.0, 2), (7.5, 60.0, 8),
     (500.0, 60.0, 60), (3.0, 0.5, 1), (3.0, 2.2, 3)],
)
def test_retry_after_is_a_whole_number_of_seconds_within_bounds(
    recent: float, timeout: float, seconds: int
) -> None:
    assert retry_after_seconds(recent, timeout) == seconds
