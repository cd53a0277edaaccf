"""RouteWatch: the tracker's abort of a route reaches the session driving it at once.

A frozen hop (SIGSTOP, a partition) neither answers nor resets its connection, so the
gateway's stream from the head just waits. The tracker expires such a node after its
heartbeats stop (3 s by default) and publishes an abort directive for every route through
it; the gateway follows those directives and hands each to the Generation of its route,
which interrupts the route's client: the session fails with `hop_lost` naming the node (so a
restart leaves it out). Aborts the gateway published itself are ignored: it already knows.

A tracker's move directive (tracker/spread.py) reaches the session the same way, as a `moved`
failure naming the hop to leave; the session's machine (gateway/session_machine.py,
`may_move`) follows it only while the session can move, and the session then continues on a
new route without that hop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from schemas.route import RouteDirective, RouteFailure

log = logging.getLogger("meshnet.gateway.route_watch")

OnLost = Callable[[RouteFailure], None]


def failure_of_abort(d: RouteDirective) -> RouteFailure | None:
    """What a tracker's abort means to the route's client (pure); None for directives that
    are not someone else's abort."""
    if d.action != "abort" or d.issued_by == "gateway":
        return None
    lost = d.lost_node_id
    index = next((i for i, h in enumerate(d.session.hops) if h.node_id == lost), None)
    return RouteFailure(
        session_id=d.session.session_id, route_id=d.session.route_id, phase="decode",
        hop_index=index, node_id=lost, reason=f"session aborted by {d.issued_by}: {d.reason or 'no reason'}",
        code="hop_lost" if lost else "session_aborted",
    )


def failure_of_move(d: RouteDirective) -> RouteFailure | None:
    """What a tracker's move order means to the route's client (pure): a `moved` failure
    naming the hop to leave; None for any other directive."""
    if d.action != "move" or d.issued_by == "gateway" or not d.lost_node_id:
        return None
    index = next((i for i, h in enumerate(d.session.hops) if h.node_id == d.lost_node_id), None)
    if index is None:
        return None
    return RouteFailure(
        session_id=d.session.session_id, route_id=d.session.route_id, phase="decode", hop_index=index,
        node_id=d.lost_node_id, reason=f"moved off {d.lost_node_id} by {d.issued_by}: {d.reason or 'no reason'}",
        code="moved",
    )


class RouteWatch:
    """Route ids the gateway drives, each with the callback that interrupts its client."""

    def __init__(self) -> None:
        self._watched: dict[str, OnLost] = {}
        self.interrupted = 0
        self.moves_ordered = 0

    def watch(self, route_id: str, on_lost: OnLost) -> Callable[[], None]:
        """Call `on_lost` if the route is aborted by someone else; returns the unwatch call."""
        self._watched[route_id] = on_lost

        def unwatch() -> None:
            if self._watched.get(route_id) is on_lost:
                del self._watched[route_id]

        return unwatch

    def on_directive(self, d: RouteDirective) -> None:
        """Hand a directive to the client of its route, if it is one of ours and an abort or a move."""
        on_lost = self._watched.get(d.session.route_id)
        if on_lost is None:
            return
        move = failure_of_move(d)
        if move is not None:
            log.info("route %s of session %s: %s", d.session.route_id, d.session.session_id, move.reason)
            self.moves_ordered += 1
            on_lost(move)
            return
        failure = failure_of_abort(d)
        if failure is None:
            return
        log.warning("route %s of session %s aborted by %s: %s", d.session.route_id,
                    d.session.session_id, d.issued_by, d.reason)
        self.interrupted += 1
        on_lost(failure)
