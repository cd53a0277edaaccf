"""Waiting for nodes the tracker holds out of routes after a reported loss: one rule for a new
request (it queues) and a restart (it keeps asking), docs/gateway.md, "Restart".

A node a gateway reported lost (a reset link, a restart, a crash) is out of new routes until the
tracker hears from it again, and a node lost again within 10 minutes is held out 10 s, 30 s,
then 120 s whatever it says (tracker/suspicion.py). The tracker's `no_coverage` then names the
held nodes and the hold left (`RouteError.held_nodes`, `held_s`). An ask so refused waits for
them: the hold left and LOST_NODE_WAIT_S more (the tracker hears from a live node twice within
~1-2 s), if the hold left is at most HELD_WAIT_MAX_S. A dead node expires and is no suspect
any more: its refusal is plain and fails at once.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from gateway.errors import RouteUnavailableError

HELD_WAIT_MAX_S = 10.0  # the longest hold waited out: a node's second loss within 10 minutes
LOST_NODE_WAIT_S = 5.0  # after the hold: until the tracker heard from the node again


def held_wait_s(exc: RouteUnavailableError, lost: str | None = None) -> float | None:
    """How long an ask refused with `exc` waits for the nodes the tracker holds out (pure); None
    when the refusal has another cause, or a hold longer than HELD_WAIT_MAX_S is left (a node
    lost a third time within 10 minutes: its links keep breaking). A restart's ask that may
    take its `lost` hop's node again waits LOST_NODE_WAIT_S for it however the tracker says
    the gap is: a node frozen past the tracker's expiry is no suspect any more, yet may be back
    in a moment."""
    if exc.route_code != "no_coverage":
        return None
    if exc.held_nodes:
        return None if exc.held_s > HELD_WAIT_MAX_S else exc.held_s + LOST_NODE_WAIT_S
    return LOST_NODE_WAIT_S if lost is not None else None


class HeldWait:
    """One ask's wait for held nodes, counted from when the ask began (a request's arrival, a
    restart's loss: a request queued behind others that waited does not wait as long again);
    the first refusal naming them sets its deadline."""

    def __init__(self, lost: str | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.lost = lost  # a restart's lost hop's node, when this ask may take it again
        self.clock = clock
        self.began = clock()
        self.deadline: float | None = None

    def waits(self, exc: RouteUnavailableError) -> bool:
        """Whether the ask refused with `exc` is asked again."""
        wait = held_wait_s(exc, self.lost)
        if wait is None:
            return False
        if self.deadline is None:
            self.deadline = self.began + wait
        return self.clock() < self.deadline
