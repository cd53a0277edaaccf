"""EngineTurns: how a composite node's shards take turns on their one engine thread.

The shards of a composite node (nodes/composite.py) run their model calls one after another,
so a hop's batch should hold every decoding session's row when its turn comes: a decode step
alternates between the shards, and two groups of sessions that fell apart (prompts that ended
at different times) would otherwise each pay a model call on every shard, for ever. So a shard
whose batch lacks rows of decoding sessions lets the shard with older rows go first, and after
another shard's call waits a moment (`TRANSIT_S`) for that call's rows to reach it over the
loopback; the two groups then ride one batch. Never longer than `MAX_DEFER_S` for any row.

`turn_wait` is the pure rule; EngineTurns holds what it reads (each shard's oldest row, when
another shard's call ended) and wakes the shards that gave way when a call ends.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

TRANSIT_S = 0.005  # a call's rows reach another shard of the process within this (loopback, same loop)
MAX_DEFER_S = 0.25  # a row never waits longer than this for rows still missing


def turn_wait(pending: int, expected: int, oldest_age_s: float, others_older: bool, since_other_call_s: float,
              *, transit_s: float = TRANSIT_S, max_defer_s: float = MAX_DEFER_S) -> float:
    """Seconds until a shard of a composite node runs its next batch (pure; 0: now). Now when
    every decoding session's row is in, or the oldest row here has waited `max_defer_s`; while
    another shard has older rows queued (its call makes some of the missing rows) give way, until
    that call's end wakes this shard, or `max_defer_s` at most; else wait out `transit_s` after
    another shard's last call."""
    if pending >= expected or oldest_age_s >= max_defer_s:
        return 0.0
    if others_older:
        return max_defer_s - oldest_age_s
    return max(0.0, transit_s - since_other_call_s)


@dataclass(eq=False)
class _Shard:
    oldest: Callable[[], float | None]  # the monotonic time of its oldest queued row (None: none)
    wake: Callable[[], None]  # look again at its queue now (HopScheduler's wake)
    call_ended: float = 0.0


@dataclass(eq=False)
class EngineTurns:
    """The shards of one composite node: who has the oldest rows, when each last ran a call."""

    shards: list[_Shard] = field(default_factory=list)

    def join(self, oldest: Callable[[], float | None], wake: Callable[[], None]) -> int:
        """Add a shard's scheduler; its index for the calls below."""
        self.shards.append(_Shard(oldest, wake))
        return len(self.shards) - 1

    def others_older(self, me: int) -> bool:
        """Whether another shard has rows queued that came before this shard's oldest."""
        mine = self.shards[me].oldest()
        if mine is None:
            return False
        return any(o is not None and o < mine for i, s in enumerate(self.shards) if i != me for o in [s.oldest()])

    def since_other_call(self, me: int, now: float) -> float:
        """Seconds since another shard's last model call ended (large when none has run)."""
        ends = [s.call_ended for i, s in enumerate(self.shards) if i != me]
        return now - max(ends) if ends and max(ends) > 0 else float("inf")

    def ended(self, me: int) -> None:
        """A shard's call ended: note when, and let the shards that gave way look again."""
        self.shards[me].call_ended = time.monotonic()
        self.wake_others(me)

    def wake_others(self, me: int) -> None:
        """Let the other shards look again (a call ended, or rows they gave way to were dropped)."""
        for i, s in enumerate(self.shards):
            if i != me:
                s.wake()
