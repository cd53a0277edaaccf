"""Decode pipelining: while some sessions' rows are away, this hop computes other sessions' rows.

Sessions that decode through a route together fall into step: each hop runs all of their rows
in one iteration, then idles while those rows cross the links and the other hops, and so does
every other hop. Over a network the idle share grows with the round trip (8 streams at 50 ms
RTT kept 0.63 of their RTT-0 aggregate), and even at RTT 0 two hops on their own cores take
turns instead of computing at once.

So a hop whose cores are its own runs its decoding sessions in groups, one group per
iteration, oldest rows first. Groups stay apart on the other hops by themselves: each arrives
there as one batch while the hop is busy with another. How many groups is a feedback loop over
what the hop measures (`PipelineGauge`), re-decided every WINDOW_S (`next_groups`, pure):

- at most about (away + iteration) / iteration (`decode_groups`): enough that the others come
  back while the hop computes one group, from how long a session's row is away between two of
  its steps here (links plus the other hops) and how long one decode iteration takes here;
- one more while the hop idles more than IDLE_SPLIT of the time (the network, not this hop,
  bounds the route);
- one fewer while decode rows wait here longer than an iteration: this hop is the route's
  bottleneck, and bigger batches do more rows per second of its cores.

The shards of a composite node take turns on one engine thread anyway, so they never split: a smaller batch
would only cost more weight reads per row.
"""

from __future__ import annotations

import math

MAX_GROUPS = 4  # more groups than this keep no hop busier, and each costs a model call
MIN_GROUP = 2  # sessions per group at least: one row per call wastes the weights' read
EWMA = 0.2  # weight of a new sample in the measured times
WINDOW_S = 0.5  # the groups are re-decided this often, from what the window measured
IDLE_SPLIT = 0.2  # a hop idle more than this share of a window takes one group more
FORGET_S = 10.0  # a session away longer than this has ended (or restarted): its entry goes


def decode_groups(sessions: int, away_s: float, iteration_s: float) -> int:
    """Groups to run `sessions` decoding sessions in (pure): about (away + iteration) /
    iteration, so the hop computes one group while the others are away; 1 when nothing is
    measured yet, at most MAX_GROUPS, and at least MIN_GROUP sessions each."""
    if sessions < 2 * MIN_GROUP or away_s <= 0.0 or iteration_s <= 0.0:
        return 1
    return max(1, min(MAX_GROUPS, sessions // MIN_GROUP, round(1.0 + away_s / iteration_s)))


def next_groups(groups: int, bound: int, idle_share: float, queued_iterations: float) -> int:
    """The groups for the next window (pure): one fewer while decode rows waited more than an
    iteration on average (`queued_iterations`), one more while the hop was idle more than
    IDLE_SPLIT of the window, never more than `bound` (decode_groups)."""
    if queued_iterations > 1.0 and groups > 1:
        return min(groups - 1, bound)
    if idle_share > IDLE_SPLIT and groups < bound:
        return groups + 1
    return max(1, min(groups, bound))


def group_sessions(sessions: int, groups: int) -> int:
    """Decoding sessions per iteration when `sessions` run in `groups` groups (pure)."""
    return max(1, math.ceil(sessions / max(1, groups)))


class PipelineGauge:
    """What the groups are decided from, measured on this hop: how long a decoding session's
    rows are away between two of its steps, how long an iteration of decode rows takes (moving
    averages), and per window how long the hop idled and how long decode rows waited."""

    def __init__(self) -> None:
        self.away_s = 0.0
        self.iteration_s = 0.0
        self.groups = 1
        self.most_groups = 1  # the most groups the hop has run in (stats)
        self._left: dict[str, float] = {}  # session id -> when its last decode step left this hop
        self._window_start = -1.0
        self._idle_s = 0.0  # idle time in this window
        self._idle_since: float | None = None  # the queue is empty and nothing runs since then
        self._waited_s = 0.0  # decode rows' waits in the queue in this window ...
        self._waits = 0  # ... and how many

    def left(self, session_id: str, now: float) -> None:
        """A decode step of `session_id` finished here at `now`."""
        self._left[session_id] = now
        if len(self._left) > 256:
            self._left = {s: t for s, t in self._left.items() if now - t < FORGET_S}

    def back(self, session_id: str, now: float) -> None:
        """The next decode step of `session_id` arrived here at `now`."""
        left = self._left.pop(session_id, None)
        if left is not None and now - left < FORGET_S:
            self.away_s = _average(self.away_s, now - left)

    def busy(self, now: float) -> None:
        """Work arrived at an idle hop, at `now`."""
        if self._idle_since is not None:
            self._idle_s += now - max(self._idle_since, self._window_start)
            self._idle_since = None

    def idle(self, now: float) -> None:
        """The hop has nothing queued and nothing running since `now`."""
        if self._idle_since is None:
            self._idle_since = now

    def waited(self, seconds: float) -> None:
        """A decode step waited `seconds` in the queue before its iteration."""
        self._waited_s += seconds
        self._waits += 1

    def iteration(self, seconds: float, now: float, sessions: int) -> None:
        """An iteration of decode rows only took `seconds` in the model; at the end of a window
        the groups for `sessions` decoding sessions are decided again."""
        self.iteration_s = _average(self.iteration_s, seconds)
        if self._window_start < 0:
            self._window_start = now
        elapsed = now - self._window_start
        if elapsed < WINDOW_S:
            return
        idle = self._idle_s + (now - self._idle_since if self._idle_since is not None else 0.0)
        wait = self._waited_s / self._waits if self._waits else 0.0
        self.groups = next_groups(self.groups, decode_groups(sessions, self.away_s, self.iteration_s),
                                  idle / elapsed, wait / self.iteration_s if self.iteration_s > 0 else 0.0)
        self.most_groups = max(self.most_groups, self.groups)
        self._window_start, self._idle_s, self._waited_s, self._waits = now, 0.0, 0.0, 0
        if self._idle_since is not None:
            self._idle_since = now

    def per_iteration(self, sessions: int) -> int:
        """Decoding sessions this hop runs per iteration now."""
        return group_sessions(sessions, min(self.groups, decode_groups(sessions, self.away_s, self.iteration_s)))


def _average(mean: float, sample: float) -> float:
    return sample if mean <= 0.0 else mean + EWMA * (sample - mean)
