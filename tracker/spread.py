"""Spreading sessions over a range's replicas: which running sessions the tracker moves (pure).

Routing splits new sessions over the replicas of a layer range by their load, but a session
stays on its route until it ends. After a node loss every session of the lost range sits on
the survivor, and it keeps them when the lost node comes back: the next loss of that survivor
cuts all of them at once, and their rebuilds queue on the same cores. So the tracker moves
some back. A move is a restart without a loss: the gateway leaves the named hop, the route's
other hops keep their Hot KV State (Kept Hops), and only the moved range prefills the history
again, on the replica the new route takes. Its cost is that re-prefill, paid by the moved
stream as one pause; its gain is a smaller loss when either replica goes, and, where the
replicas are on different machines, each machine's cores decoding its share.

The plan moves the youngest sessions first: their histories are the shortest (the cheapest to
re-prefill) and they have the longest left to run.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from schemas.protocol import FIRST
from tracker.routing import DEFAULT_CONFIG, seam_in, sender_rtts, token_seconds, way_back
from tracker.views import NodeView


@dataclass(frozen=True, slots=True)
class SpreadConfig:
    """When the tracker moves sessions between replicas."""

    gap: int = 2  # a range's busiest replica holds at least this many sessions more than its idlest
    min_age_s: float = 1.0  # only sessions whose route opened this long ago (past their prefill)
    quiet_s: float = 1.5  # no move while a restart's rebuild may still run (since the last loss)
    cooldown_s: float = 3.0  # per range, after ordering moves: the moves' own rebuilds run first
    straggler_ratio: float = 0.5  # never onto a replica this much slower (measured decode tok/s)
    session_weight: float = 0.7  # routing's (tracker/routing.py, request_cost): what a session adds to a hop's cost
    margin: float = 0.1  # a session moves only if it costs this much less where it goes


@dataclass(frozen=True, slots=True)
class SpreadSession:
    """A running Route Session as the planner sees it."""

    route_id: str
    opened_at: float
    nodes: tuple[str, ...]  # its hops' nodes, in route order
    head_rtt_ms: Mapping[str, float] = field(default_factory=dict)  # its gateway's round trips to heads
    protocol: int = FIRST  # the mesh protocol its sampling needs (schemas/protocol.py): no move to an older node


@dataclass(frozen=True, slots=True)
class Move:
    """Move session `route_id` off `from_node`; the range's idlest replica is `to_node` (the
    new route's choice is routing's, with `from_node` left out)."""

    route_id: str
    from_node: str
    to_node: str
    range_key: tuple[str, str, int, int]


def range_key(v: NodeView) -> tuple[str, str, int, int]:
    """Replicas are nodes with equal keys: (model revision, cache ABI, layer start, end)."""
    return (v.model_revision, v.cache_abi, v.start, v.end)


def _slower(tps: float, than: float, ratio: float) -> bool:
    """Whether a replica measured at `tps` is a straggler beside one at `than` (0: unmeasured)."""
    return bool(tps and than and tps < ratio * than)


def session_cost(token_s: float, others: int, session_weight: float) -> float:
    """What one session costs, in seconds per token, on a replica that takes `token_s` a token
    and holds `others` other sessions: routing's request_cost without the prompt (pure)."""
    return token_s * (1.0 + session_weight * others)


def seams_s(views: Mapping[str, NodeView], session: SpreadSession, i: int, node: str) -> float:
    """Seconds a token of `session` spends on the seams next to its hop i were `node` that hop,
    priced as routing prices a route (tracker/routing.py `seam_in`, `way_back`): into it, out of
    it, and the way back between tail and head, each sender's round trips as routing takes
    them (`sender_rtts`); a sender whose view is missing counts 0 (pure)."""
    nodes, last = session.nodes, len(session.nodes) - 1

    def rtts(sender: str) -> Mapping[str, float]:
        v = views.get(sender)
        if v is None:
            return {}
        # (the replicas are read only when v measured nothing)
        return sender_rtts(v, (r for r in views.values() if range_key(r) == range_key(v)))

    total = seam_in(rtts(nodes[i - 1]) if i > 0 else None, node, session.head_rtt_ms)
    if i < last:
        total += seam_in(rtts(node), nodes[i + 1], session.head_rtt_ms)
    if last > 0 and i in (0, last):
        head, tail = (node, nodes[last]) if i == 0 else (nodes[0], node)
        total += way_back(rtts(head), tail)
    return total


def move_pays(views: Mapping[str, NodeView], session: SpreadSession, here: tuple[str, float],
              there: tuple[str, float], margin: float) -> bool:
    """Whether moving `session` off node here[0] (its cost there, seconds a token: here[1]) onto
    there[0] makes its tokens cheaper, its seams' round trips counted; the `margin` is on the
    replica's own cost, so a trip both replicas share does not raise the bar (pure)."""
    i = session.nodes.index(here[0])
    return there[1] * (1.0 + margin) + seams_s(views, session, i, there[0]) < here[1] + seams_s(views, session, i, here[0])


def _token_seconds(tps: Mapping[str, float]) -> dict[str, float]:
    """Each replica's seconds a token, as routing has it: its measured tok/s, else the range's
    measured median, else routing's default (pure)."""
    measured = [t for t in tps.values() if t > 0]
    median = statistics.median(measured) if measured else 0.0
    return {n: token_seconds(t, median, 0, 0.0, DEFAULT_CONFIG.default_decode_tps) for n, t in tps.items()}


def _session_counts(replicas: Sequence[NodeView], on_node: Mapping[str, list[SpreadSession]],
                    moving: Mapping[str, str]) -> dict[str, int]:
    """Each replica's sessions, with orders in flight counted as done, onto the idlest replica."""
    count = {v.node_id: len(on_node[v.node_id]) for v in replicas}
    for n in list(count):
        for s in on_node[n]:
            if moving.get(s.route_id) == n:
                count[n] -= 1
                count[min(count, key=lambda m: (count[m], m))] += 1
    return count


def plan_spread(views: Iterable[NodeView], sessions: Sequence[SpreadSession], *, live: Mapping[str, int],
                now: float, config: SpreadConfig = SpreadConfig(),
                cooling: Iterable[tuple[str, str, int, int]] = (), moving: Mapping[str, str] | None = None,
                ) -> list[Move]:
    """The moves that even out every range's sessions over its replicas (pure).

    `live`: routable nodes and their free session slots (a target needs one); `cooling`:
    ranges that had moves ordered lately; `moving`: route ids already ordered to move, and the
    node each leaves (counted as gone to the idlest replica already, so a round does not order
    more moves while the gateway carries out the last ones). Per
    range, while the busiest replica holds `gap` or more sessions than the idlest (routable,
    with a free slot, no straggler against the busiest) and a session would cost less there
    by `margin` (routing's cost: so a move never undoes what routing chose between replicas of
    unequal speed), its youngest session old enough to be decoding, whose other hops are all
    live and for which the move pays with its seams' round trips counted (so a move never
    undoes what routing chose between a near replica and a far one), moves; the counts then
    change as if it had."""
    cooling, moving, views = set(cooling), dict(moving or {}), list(views)
    groups: dict[tuple[str, str, int, int], list[NodeView]] = defaultdict(list)
    for v in views:
        if v.node_id in live:
            groups[range_key(v)].append(v)
    by_id = {v.node_id: v for v in views}
    on_node: dict[str, list[SpreadSession]] = defaultdict(list)
    for s in sessions:
        for n in set(s.nodes):
            on_node[n].append(s)
    moves: list[Move] = []
    taken: set[str] = set(moving)
    for key, replicas in sorted(groups.items()):
        if len(replicas) < 2 or key in cooling:
            continue
        count = _session_counts(replicas, on_node, moving)
        free = {v.node_id: live[v.node_id] for v in replicas}
        tps = {v.node_id: v.decode_tps for v in replicas}
        token_s = _token_seconds(tps)
        while True:
            src = max(count, key=lambda n: (count[n], n))
            targets = [n for n in count if n != src and free[n] > 0
                       and not _slower(tps[n], tps[src], config.straggler_ratio)]
            if not targets:
                break
            dst = min(targets, key=lambda n: (count[n], n))
            if count[src] - count[dst] < config.gap:
                break
            here = session_cost(token_s[src], count[src] - 1, config.session_weight)
            there = session_cost(token_s[dst], count[dst], config.session_weight)
            movable = [s for s in on_node[src] if s.route_id not in taken and now - s.opened_at >= config.min_age_s
                       and all(n in live for n in s.nodes if n != src) and by_id[dst].protocol >= s.protocol
                       and move_pays(by_id, s, (src, here), (dst, there), config.margin)]
            if not movable:
                break
            pick = max(movable, key=lambda s: (s.opened_at, s.route_id))
            taken.add(pick.route_id)
            moves.append(Move(pick.route_id, src, dst, key))
            count[src] -= 1
            count[dst] += 1
            free[dst] -= 1
    return moves
