"""Admission queue decisions (pure): a bounded FIFO of requests waiting for a Route Session.

Every request takes a ticket. The first `room` tickets (room: sessions the gateway may still
start) ask for a route at once, together, so a burst is admitted as fast as there is room; the
others wait in arrival order, and a later arrival never overtakes an earlier one that could
not get a route (the tracker said `no_capacity`). A wait ends when the request is admitted,
its client leaves, or `timeout` seconds pass. A request arriving when `max_queue` requests
already wait beyond the room is refused at once, with a `Retry-After` that estimates the wait.
Time is passed in; the asyncio side is gateway/admission_gate.py.

Several API keys share the queue fairly: each ticket has an owner (a digest of its key), each
owner's k-th waiting ticket comes after every owner's (k-1)-th (`fair_tag`; one owner: plain
arrival order), and with `owners` keys configured one key may hold at most its `fair_share`
of `max_queue`, so one key's flood neither fills the queue nor stands in front of another's
request.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

DEFAULT_MAX_QUEUE = 256
DEFAULT_QUEUE_TIMEOUT = 60.0
WAIT_SMOOTHING = 0.2  # weight of the newest sample in the smoothed session length


@dataclass(frozen=True, slots=True)
class QueueLimits:
    """How many requests may wait, and for how long each (seconds)."""

    max_queue: int = DEFAULT_MAX_QUEUE
    timeout: float = DEFAULT_QUEUE_TIMEOUT


def retry_after_seconds(waiting: int, max_sessions: int, session_s: float, timeout: float,
                        running_s: float = 0.0) -> int:
    """The `Retry-After` a refused request gets (pure): how long the requests waiting now take
    to get through, `waiting` of them over `max_sessions` places that each free up after
    `session_s` on average, rounded up; at least 1 s and at most the queue timeout (rounded up).
    `running_s`, how long the sessions holding the places now have run on average, is a floor
    for `session_s`: before any session ended (a fresh gateway), `session_s` is only a guess."""
    upper = max(1, math.ceil(timeout))
    estimate = waiting * max(0.0, session_s, running_s) / max(1, max_sessions)
    return min(max(1, math.ceil(estimate)), upper)


def fair_share(max_queue: int, owners: int) -> int:
    """Waiting places one of `owners` keys may hold (pure): an equal share of `max_queue`,
    rounded up, so the shares together never leave a place unusable."""
    return max(1, math.ceil(max_queue / max(1, owners)))


def fair_tag(owner_last: int | None, floor: int) -> int:
    """The place-in-line tag of a new ticket (pure; tickets get places in tag order, earlier
    arrival first among equal tags): one after its owner's last waiting ticket, or, when its
    owner has none waiting, one after `floor`, the tag of the line's progress (the lowest tag
    waiting, less one; the highest given when the line is empty). So each key's k-th waiting
    ticket comes after every key's (k-1)-th, counted from where the line stands when it joins."""
    return (floor if owner_last is None else owner_last) + 1


@dataclass(slots=True)
class AdmissionQueue:
    """Tickets in arrival order with their arrival times; positions are 1-based."""

    limits: QueueLimits = field(default_factory=QueueLimits)
    session_s: float = 1.0  # smoothed length of the sessions that ended (seconds): the Retry-After estimate
    _tickets: list[int] = field(default_factory=list)  # ascending = arrival order
    _arrived: dict[int, float] = field(default_factory=dict)
    _owner: dict[int, str | None] = field(default_factory=dict)  # whose key each ticket came with
    _held: dict[str | None, int] = field(default_factory=dict)  # waiting tickets per owner
    _requests: dict[str | None, int] = field(default_factory=dict)  # of those, new requests (bounded) per owner
    _choices: set[int] = field(default_factory=set)  # waiting later choices of taken requests (unbounded)
    _tag: dict[int, int] = field(default_factory=dict)  # each waiting ticket's fair_tag
    _last_tag: dict[str | None, int] = field(default_factory=dict)  # each owner's last waiting tag
    _top_tag: int = 0  # the highest tag given
    _order: dict[int, int] | None = None  # each ticket's position in tag order; None: to sort again
    _next: int = 0

    @property
    def depth(self) -> int:
        """Requests waiting now."""
        return len(self._tickets)

    def join(self, now: float, room: int = 0, *, bounded: bool = True,
             owner: str | None = None, owners: int = 1) -> int | None:
        """A ticket at the back of the queue, or None when `max_queue` requests already wait
        beyond the `room` that may ask for a route at once, or when `owner` (one of `owners`
        keys) already holds its `fair_share` beyond the room. `bounded=False`: a later choice of
        a request already admitted (n > 1), which always gets its ticket: refusing it would
        fail a request the gateway took, and its own choices must not fill the queue against
        it (they join after choice 0 got its route: at most n - 1 of them per request taken),
        nor against any other request: only new requests count against `max_queue`."""
        if bounded and (self._full(room) or self.share_held(owner, room, owners) is not None):
            return None
        self._next += 1
        self._tickets.append(self._next)
        self._arrived[self._next] = now
        self._owner[self._next] = owner
        self._held[owner] = self._held.get(owner, 0) + 1
        if bounded:
            self._requests[owner] = self._requests.get(owner, 0) + 1
        else:
            self._choices.add(self._next)
        floor = min(self._tag.values()) - 1 if self._tag else self._top_tag
        tag = self._tag[self._next] = self._last_tag[owner] = fair_tag(self._last_tag.get(owner), floor)
        self._top_tag = max(self._top_tag, tag)
        self._order = None
        return self._next

    def _full(self, room: int) -> bool:
        """Whether `max_queue` new requests already wait beyond the `room` that may ask at once."""
        return sum(self._requests.values()) >= self.limits.max_queue + max(0, room)

    def share_held(self, owner: str | None, room: int, owners: int) -> int | None:
        """When the queue has room but `owner` (one of `owners` keys) already has its whole
        fair share of new requests waiting beyond the room: that share (why `join` refused
        it), else None."""
        share = fair_share(self.limits.max_queue, owners)
        held = self._requests.get(owner, 0)
        return share if owners > 1 and not self._full(room) and held >= share + max(0, room) else None

    def position(self, ticket: int) -> int:
        """1-based place of a waiting ticket (1 = the head) in tag order (`fair_tag`); KeyError
        when it is not waiting."""
        if ticket not in self._arrived:
            raise KeyError(ticket)
        if len(self._held) <= 1:  # one owner: tags follow arrival
            return bisect.bisect_left(self._tickets, ticket) + 1
        if self._order is None:  # sorted once per change, not once per waiter and tick
            ranked = sorted((tag, other) for other, tag in self._tag.items())
            self._order = {other: place for place, (_, other) in enumerate(ranked, 1)}
        return self._order[ticket]

    def may_try(self, ticket: int, *, room: int) -> bool:
        """Whether this ticket asks for a route now: one of the first `room` in line."""
        return ticket in self._arrived and self.position(ticket) <= room

    def remaining(self, ticket: int, now: float) -> float:
        """Seconds this ticket may still wait (≤ 0: its wait expired). A later choice of a request
        already taken never expires: it waits for its request's own earlier choices (with n above
        --max-sessions, for longer than the queue timeout whenever an answer takes that long),
        and its expiry failed the whole request after its other choices had been computed."""
        if ticket in self._choices:
            return math.inf
        return self._arrived[ticket] + self.limits.timeout - now

    def leave(self, ticket: int, now: float) -> float:
        """Remove a ticket (admitted, expired or gone); returns how long it waited. Leaving
        twice is a no-op that returns 0."""
        arrived = self._arrived.pop(ticket, None)
        if arrived is None:
            return 0.0
        del self._tickets[bisect.bisect_left(self._tickets, ticket)]
        owner = self._owner.pop(ticket)
        del self._tag[ticket]
        self._order = None
        if ticket in self._choices:
            self._choices.discard(ticket)
        elif self._requests[owner] > 1:
            self._requests[owner] -= 1
        else:
            del self._requests[owner]
        self._held[owner] -= 1
        if not self._held[owner]:  # its next ticket starts from the line's progress
            del self._held[owner], self._last_tag[owner]
        return max(0.0, now - arrived)

    def session_ended(self, seconds: float) -> None:
        """An admitted session held its place this long: the smoothed length follows it."""
        self.session_s += WAIT_SMOOTHING * (max(0.0, seconds) - self.session_s)

    def retry_after(self, max_sessions: int, running_s: float = 0.0) -> int:
        """Seconds a refused request is told to wait before trying again (retry_after_seconds;
        `running_s`: the running sessions' mean age)."""
        return retry_after_seconds(len(self._tickets), max_sessions, self.session_s, self.limits.timeout, running_s)
