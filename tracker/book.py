"""MeshBook: what one tracker knows right now, the nodes it can route through and the Route
Sessions it counts, shared by its handlers (tracker/service.py wires them to the bus)."""

from __future__ import annotations

import asyncio
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from schemas.route import RouteSession
from tracker.awake import AwakeClock
from tracker.coverage import CoverageMap, coverage_maps
from tracker.registry import Registry, RegistryConfig
from tracker.suspicion import Suspicion, heard, reported
from tracker.views import NodeView, node_view

ENDED_ROUTES = 10_000  # ended route ids remembered, so another tracker's late open cannot revive one


@dataclass(slots=True)
class ActiveSession:
    """A Route Session the tracker opened and nobody closed yet."""

    session: RouteSession
    opened_at: float


class MeshBook:
    """Nodes (registry, frame keys, suspects, the live map of routable nodes and their free
    slots) and open routes (by route id, by session id, by node). Every change to a node's
    routability goes through `refresh_live`; every route starts in `begin_session` and ends in
    `end_session`."""

    def __init__(self, clock: AwakeClock, registry: RegistryConfig, target_replicas: int) -> None:
        self.clock = clock
        self.registry = Registry(registry)
        self.target_replicas = target_replicas
        self.sessions: dict[str, ActiveSession] = {}  # by route_id
        self.routes_by_node: dict[str, set[str]] = defaultdict(set)
        self.session_routes: dict[str, str] = {}  # session_id -> route_id
        self.ended: OrderedDict[str, None] = OrderedDict()  # route ids ended lately (ENDED_ROUTES)
        self.live: dict[str, int] = {}  # routable node -> free session slots
        self.frame_keys: dict[str, bytes] = {}  # node -> its frame key (meshkey.join.<node_id>)
        self.suspects: dict[str, Suspicion] = {}  # node reported lost, out of new routes -> the report
        self.reports: dict[str, Suspicion] = {}  # every reported node's latest report, cleared or not (strikes)
        self.last_loss = float("-inf")  # when a hop was last lost or a restart's route opened (spread quiet)
        self.quarantined: Callable[[str], bool] = lambda _node_id: False  # set by the quarantine keeper's owner
        # puts (a session) and deletes (None) of the session bucket, written in order off the request path
        self.bucket_writes: asyncio.Queue[tuple[str, RouteSession | None]] = asyncio.Queue()

    def refresh_live(self, node_id: str) -> None:
        """Put a node in the live map with its free slots, or take it out: unknown, suspected
        lost, without a frame key (frames to it could carry no credential) or quarantined
        (replay verdicts found it computing wrong activations)."""
        state = self.registry.get(node_id)
        if state is None or node_id in self.suspects or node_id not in self.frame_keys or self.quarantined(node_id):
            self.live.pop(node_id, None)
            return
        self.live[node_id] = node_view(state, len(self.routes_by_node.get(node_id, ()))).free_slots

    def live_with_suspects(self) -> dict[str, int]:
        """The live map as if every node held out after a reported loss were back (otherwise
        routable): which refusals only the holds cause."""
        live = dict(self.live)
        for node_id in self.suspects:
            state = self.registry.get(node_id)
            if state is not None and node_id in self.frame_keys and not self.quarantined(node_id):
                live[node_id] = node_view(state, self.route_count(node_id)).free_slots
        return live

    def hold_left(self, node_id: str, at: float) -> float:
        """How much longer (seconds from `at`, this tracker's awake clock) a suspect's hold runs
        before its messages can bring it back (0 once only hearing from it is due)."""
        s = self.suspects.get(node_id)
        return 0.0 if s is None else max(0.0, s.reported_at + s.hold_s - at)

    def suspect(self, node_id: str, at: float) -> tuple[Suspicion, list[str]]:
        """A gateway reported the node lost, read at `at` (this tracker's awake clock): it and the other shards of its
        process (`Registry.siblings`) are out of new routes (tracker/suspicion.py). Its
        suspicion, and the siblings suspected with it."""
        siblings = self.registry.siblings(node_id)
        for n in (node_id, *siblings):
            state = self.registry.get(n)
            started = state.announcement.started_at if state is not None else 0.0
            self.suspects[n] = self.reports[n] = reported(self.reports.get(n), at, n in self.suspects, started)
            self.live.pop(n, None)
        return self.suspects[node_id], siblings

    def clear_suspicion(self, node_id: str, sent_at: float, started_at: float = 0.0) -> bool:
        """A node reported lost is back once it speaks again after the report and its hold
        (tracker/suspicion.py, `heard`: twice, or as a new process): True if that cleared it."""
        s = self.suspects.get(node_id)
        if s is None:
            return False
        after = heard(s, sent_at, started_at)
        if after is not None:
            self.suspects[node_id] = after
            return False
        del self.suspects[node_id]
        return True

    def forget_node(self, node_id: str) -> None:
        """A node expired: nothing of it stays routable, and its reports go with it."""
        self.live.pop(node_id, None)
        self.suspects.pop(node_id, None)
        self.reports.pop(node_id, None)

    def begin_session(self, session: RouteSession, now: float) -> None:
        self.sessions[session.route_id] = ActiveSession(session, now)
        self.session_routes[session.session_id] = session.route_id
        if session.epoch > 1 and not session.moved:
            self.last_loss = now  # a restart's rebuild is running: no move for a while
        for hop in session.hops:
            self.routes_by_node[hop.node_id].add(session.route_id)
            self.refresh_live(hop.node_id)

    def end_session(self, route_id: str) -> ActiveSession | None:
        # an open directive seen late (twice, or only after the route's close: another tracker's,
        # held by a partition while the asker got the route from a second ask) never revives it
        self.ended[route_id] = None
        if len(self.ended) > ENDED_ROUTES:
            self.ended.popitem(last=False)
        active = self.sessions.pop(route_id, None)
        if active is None:
            return None
        self.bucket_writes.put_nowait((route_id, None))
        self.session_routes.pop(active.session.session_id, None)
        for hop in active.session.hops:
            routes = self.routes_by_node.get(hop.node_id)
            if routes is not None:
                routes.discard(route_id)
                if not routes:
                    del self.routes_by_node[hop.node_id]
            self.refresh_live(hop.node_id)
        return active

    def route_count(self, node_id: str) -> int:
        return len(self.routes_by_node.get(node_id, ()))

    def views(self) -> list[NodeView]:
        """Every registered node as plain data, with free slots as the tracker sees them."""
        return [node_view(s, self.route_count(s.node_id)) for s in self.registry]

    def coverage(self, offered: Iterable[tuple[str, str, str, int]] = ()) -> list[CoverageMap]:
        """The Coverage Map of every model revision served right now (and offered by spares)."""
        return coverage_maps(self.views(), self.target_replicas, offered)
