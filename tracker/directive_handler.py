"""DirectiveHandler: a tracker's reading of the route directives other trackers and gateways
publish (open, close, abort, move), so that every tracker of a group counts every route."""

from __future__ import annotations

import logging

from schemas.route import RouteDirective
from tracker.book import MeshBook
from tracker.placement import Placement

log = logging.getLogger("meshnet.tracker")


class DirectiveHandler:
    """Counts other trackers' routes, ends closed and aborted ones, suspects a node a gateway
    reported lost, and keeps other trackers' move orders in mind."""

    def __init__(self, book: MeshBook, placement: Placement, *, tracker_id: str) -> None:
        self.book = book
        self.placement = placement
        self.tracker_id = tracker_id

    async def on_directive(self, directive: RouteDirective) -> None:
        if directive.issued_by == self.tracker_id:
            return
        book, s, lost = self.book, directive.session, directive.lost_node_id
        if directive.action == "open":  # another tracker's route: count it as if it were ours
            if s.route_id not in book.sessions and s.route_id not in book.ended and s.session_id not in book.session_routes:
                book.begin_session(s, book.clock())
            return
        if directive.action == "move":  # another tracker's order: its range waits as if it were ours
            if lost:
                self.placement.move_seen(s, lost)
            return
        if directive.action == "abort" and lost and not directive.moved:
            book.last_loss = book.clock()
            if book.registry.get(lost) is not None:
                # a gateway lost this hop mid-session: no new route goes through it until it is
                # heard from again, later each time it is lost again (a dead node never is, and
                # expires as usual)
                # when this tracker read the report, on its own clock: the node's messages that bring
                # it back are timed on the same clock (not the gateway's against the node's: machines'
                # wall clocks differ)
                held, siblings = book.suspect(lost, book.clock())
                log.warning("node %s%s reported lost by %s (%s): out of new routes until heard from again%s",
                            lost, f" (and {', '.join(siblings)}, of the same process)" if siblings else "",
                            directive.issued_by, directive.reason,
                            f" after {held.hold_s:.0f} s (lost {held.strikes} times after it came back)" if held.hold_s else "")
        if book.end_session(s.route_id) is not None:
            log.info("session %s %s by %s%s", s.session_id, "closed" if directive.action == "close" else "aborted",
                     directive.issued_by, f": {directive.reason}" if directive.reason else "")
