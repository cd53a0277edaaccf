"""When a request body that is still arriving has taken too long (pure).

A body is judged by its progress, not by one deadline from its head: a big body over a slow
link honestly takes longer than any fixed limit, while a stalled or trickling sender must still
be let go. A body is overdue once nothing of it arrived for `timeout_s` (it stalled), or once
it has taken longer than `timeout_s` plus what its bytes so far earn at `min_rate` bytes per
second (it trickles below the floor: every byte at the floor buys 1 / `min_rate` s more). A
body that keeps arriving at least at `min_rate` is never cut. Used by the node's frame server
(wire/server.py, `--body-timeout`, `--body-min-rate`) and the gateway's request reader
(gateway/api_chat.py, `body_timeout`, `body_min_rate`).
"""

from __future__ import annotations

from typing import Literal

DEFAULT_BODY_TIMEOUT = 30.0  # seconds a body may go without a byte (and its grace before the floor counts)
DEFAULT_BODY_MIN_RATE = 1000.0  # bytes/s: 8 kbit/s, a twelfth of a 0.1 Mbit/s link

BodyLate = Literal["stalled", "slow"]


def body_deadline(started: float, last: float, received: int, timeout_s: float,
                  min_rate: float) -> tuple[float, BodyLate]:
    """When a body whose wait began at `started`, with `received` bytes in, the last of them at
    `last`, is overdue unless more of it arrives, and why it would be: "stalled" (nothing for
    `timeout_s`) or "slow" (below `min_rate` bytes/s after a grace of `timeout_s`)."""
    stalled = last + timeout_s
    slow = started + timeout_s + received / min_rate
    return (stalled, "stalled") if stalled <= slow else (slow, "slow")


def body_late_message(why: BodyLate, timeout_s: float, min_rate: float) -> str:
    """What a client cut for `why` is told."""
    if why == "stalled":
        return f"request body stalled: no byte of it for {timeout_s:g} s"
    return f"request body arrives slower than {min_rate:g} bytes/s (after a grace of {timeout_s:g} s)"
