"""Route selection: pure functions over NodeViews.

Nodes run exactly their announced Shard (a llama.cpp shard cannot start mid-range), so an
Inference Route is a chain of shards that meet *exactly*: hop i ends where hop i+1 starts,
from layer 0 to n_layer. Overlapping shards are fine, but only chains that meet at a boundary
are valid. Routes never mix model revisions or cache ABIs.

Selection is a shortest path over layer boundaries. `build_index` groups nodes by
(model_revision, cache_abi) and by shard range, ranks every range's nodes by cost once
(measured decode speed, load, queue; stragglers get a large penalty), and `plan_route` then
walks boundaries in order over the cheapest *eligible* nodes of each range (alive, allowed by
the policy, has a free session slot, large enough n_ctx), each one's cost raised by the
sessions the tracker has open on it now, so replicas share the sessions. The network counts
too: every seam of a chain adds the round trip its sender measured to its receiver (the
gateway's to the head), so the path's state is the boundary *and* the hop that reached it.
Ties break by node_id, so the same inputs always give the same route.

A hop's speed is what it measured (Capability Report, then heartbeats), else the median of the
nodes measured on the same range. Where nobody has measured the range yet, its cost comes from
the weight bytes one token reads through it (`active_bytes`: a MoE layer reads only the experts
a token runs), not from its layer count: a hop costs active bytes / the group's byte rate, the
median of active bytes × measured tok/s over the group's measured hops. A request that gives its
prompt length also pays each hop's prefill, spread over the tokens it is expected to decode.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from schemas.coverage import chains_exactly, furthest_boundary, missing_ranges
from schemas.node import MAX_RTT_MS
from schemas.protocol import FIRST, needs, what_sets
from schemas.route import Hop, KeepHop, RouteError, RouteRequest, RouteSession
from schemas.session_id import id_base, without_epoch
from tracker.views import NodeView

GroupKey = tuple[str, str]  # (model_revision, cache_abi)


@dataclass(frozen=True, slots=True)
class RoutingConfig:
    """Knobs of the hop cost model (seconds per decode token through one hop)."""

    straggler_ratio: float = 0.5  # slower than this × the range's median decode tok/s
    straggler_penalty_s: float = 1_000.0  # so a straggler is used only when nothing else chains
    hop_overhead_s: float = 0.001  # one HTTP hop; fewer hops win when speeds are equal
    # for a hop with no measured speed and no reported active bytes (an older node)
    default_decode_tps: float = 100.0
    default_prefill_tps: float = 300.0
    # active bytes × tok/s where no hop of the group has measured: the bundled model's 66.5 MB of
    # layers a token at llama-bench's tg128 132 tok/s and pp512 305 tok/s on this machine class
    default_decode_bytes_per_s: float = 8.8e9
    default_prefill_bytes_per_s: float = 20.3e9
    # a request's prompt is prefilled once and its answer decoded token by token: with the prompt
    # length known, a hop's cost per decode token adds its prefill seconds × prompt_tokens / this
    decode_tokens_per_request: int = 256
    # the prompt tokens of one prefill frame the gateway sends a head on another machine (its
    # default chunk, docs/gateway.md): it waits for each frame's answer before the next
    prefill_chunk_tokens: int = 64
    # a hop's cost grows by this fraction per session it already holds: a batched decode step of
    # k rows took ~1 + 0.7 k one-row steps here (bench: 8 rows 37.8 ms, 1 row 6.2 ms on a
    # 15-layer half), so a new session goes to the replica where it slows the others least
    session_weight: float = 0.7
    # the cheapest eligible nodes of each range the path search weighs against each other's
    # seams (more only costs search time: a node this far down is rarely near enough to win)
    candidates_per_range: int = 8


DEFAULT_CONFIG = RoutingConfig()


@dataclass(slots=True)
class RankedNode:
    """A node with its precomputed hop cost (seconds per decode token) and prefill cost."""

    view: NodeView
    cost: float
    straggler: bool
    prefill_cost: float = 0.0  # seconds per prompt token through this hop


@dataclass(frozen=True, slots=True)
class ByteRates:
    """Active bytes × tok/s of one group's hops: what prices a hop nobody has measured."""

    decode: float
    prefill: float


@dataclass(slots=True)
class ShardBucket:
    """All nodes serving exactly [start, end) in one group, best first."""

    start: int
    end: int
    ranked: list[RankedNode]
    median_tps: float


@dataclass(slots=True)
class RouteGroup:
    """Nodes of one (model_revision, cache_abi), indexed by shard start layer."""

    model: str
    model_revision: str
    cache_abi: str
    n_layer: int
    hidden_size: int
    buckets: dict[int, list[ShardBucket]]  # start -> buckets sorted by end
    starts: list[int]  # sorted
    n_nodes: int


@dataclass(slots=True)
class RouteIndex:
    """Everything route selection needs, built once per registry change."""

    groups: dict[GroupKey, RouteGroup] = field(default_factory=dict)
    by_model: dict[str, list[GroupKey]] = field(default_factory=dict)  # name or revision
    nodes: dict[str, tuple[GroupKey, RankedNode]] = field(default_factory=dict)

    def replicas(self, view: NodeView) -> list[NodeView]:
        """The nodes serving `view`'s range in its group (itself among them)."""
        entry = self.nodes.get(view.node_id)
        buckets = self.groups[entry[0]].buckets.get(view.start, []) if entry is not None else []
        return [rn.view for b in buckets if b.end == view.end for rn in b.ranked]


@dataclass(frozen=True, slots=True)
class RouteQuery:
    """What a route must satisfy."""

    model: str
    private: bool = False
    allow: frozenset[str] = frozenset()
    prompt_tokens: int = 0
    context_tokens: int = 0  # a node's n_ctx must hold this many positions (at least prompt_tokens)
    exclude: frozenset[str] = frozenset()
    keep: frozenset[tuple[str, int, int]] = frozenset()  # (node, start, end): a restart's Kept Hops
    head_rtt: Mapping[str, float] = field(default_factory=dict)  # the gateway's round trips (ms) to heads
    # the mesh protocol every hop must read (schemas/protocol.py), and the request's fields that need it
    protocol: int = FIRST
    protocol_fields: tuple[str, ...] = ()

    @classmethod
    def from_request(cls, req: RouteRequest) -> RouteQuery:
        """From the bus request (only the Kept Hops of the same session: kept_hops)."""
        protocol, fields = needs(req.sampling, "sampling.")
        return cls(
            model=req.model,
            private=req.policy.kind == "private",
            allow=frozenset(req.policy.allow_nodes),
            prompt_tokens=req.prompt_tokens,
            context_tokens=req.context_tokens,
            exclude=frozenset(req.policy.exclude_nodes),
            keep=frozenset((k.node_id, k.layer_start, k.layer_end) for k in kept_hops(req)),
            head_rtt=dict(req.head_rtt_ms),
            protocol=protocol,
            protocol_fields=fields,
        )

    @property
    def needs_ctx(self) -> int:
        """The positions every hop's n_ctx must hold: the prompt and the answer's most tokens."""
        return max(self.context_tokens, self.prompt_tokens)


def same_session(a: str, b: str) -> bool:
    """Whether two Route Session ids are routes of one client session (pure): the same once
    their restart suffix ("-e<epoch>") is cut and a long id is shortened as a suffix shortens it
    (schemas/session_id.py)."""
    return bool({id_base(a), id_base(without_epoch(a))} & {id_base(b), id_base(without_epoch(b))})


def kept_hops(req: RouteRequest) -> list[KeepHop]:
    """The Kept Hops a restart may continue on (pure): only for a restart (epoch > 1) with a
    session id, and only sessions of the same client session, so no request can take over
    another session's Hot KV State."""
    if req.epoch <= 1 or not req.session_id or not req.keep_position:
        return []
    sid = req.session_id
    return [k for k in req.keep if k.session_id != sid and same_session(k.session_id, sid)]


@dataclass(frozen=True, slots=True)
class RoutePlan:
    """The chosen hops (in layer order) of one group, and the path cost."""

    group: RouteGroup
    hops: tuple[NodeView, ...]
    cost: float


def token_seconds(measured_tps: float, peers_tps: float, active_bytes: int, bytes_per_s: float,
                  default_tps: float) -> float:
    """Seconds per token of one phase through one hop: its own measured tok/s, else its range's
    measured median, else its active bytes at its group's byte rate, else a default."""
    tps = measured_tps or peers_tps
    if tps > 0:
        return 1.0 / tps
    if active_bytes > 0 and bytes_per_s > 0:
        return active_bytes / bytes_per_s
    return 1.0 / default_tps


def byte_rates(views: Iterable[NodeView], config: RoutingConfig = DEFAULT_CONFIG) -> ByteRates:
    """The median active bytes × measured tok/s over the hops that report both (one model on
    one backend: a route group), so an estimate is on the scale of the group's measured hops;
    the config's defaults where none does."""
    decode: list[float] = []
    prefill: list[float] = []
    for v in views:
        if v.active_bytes > 0 and v.decode_tps > 0:
            decode.append(v.active_bytes * v.decode_tps)
        if v.active_bytes > 0 and v.prefill_tps > 0:
            prefill.append(v.active_bytes * v.prefill_tps)
    return ByteRates(decode=statistics.median(decode) if decode else config.default_decode_bytes_per_s,
                     prefill=statistics.median(prefill) if prefill else config.default_prefill_bytes_per_s)


def hop_cost(view: NodeView, median_tps: float, config: RoutingConfig = DEFAULT_CONFIG, *,
             median_prefill_tps: float = 0.0, rates: ByteRates | None = None) -> RankedNode:
    """Seconds per decode token (and per prompt token) through this node, and whether it is a
    straggler. `median_*` are the range's measured peers, `rates` its group's (`byte_rates`)."""
    if rates is None:
        rates = ByteRates(config.default_decode_bytes_per_s, config.default_prefill_bytes_per_s)
    decode_s = token_seconds(view.decode_tps, median_tps, view.active_bytes, rates.decode,
                             config.default_decode_tps)
    prefill_s = token_seconds(view.prefill_tps, median_prefill_tps, view.active_bytes, rates.prefill,
                              config.default_prefill_tps)
    straggler = (view.speed_served and bool(view.decode_tps)
                 and view.decode_tps < config.straggler_ratio * median_tps)
    busy = min(max(view.load, 0.0), 0.95)
    slowdown = (1 + view.queue_depth) / (1.0 - busy)
    cost = decode_s * slowdown + config.hop_overhead_s
    if straggler:
        cost += config.straggler_penalty_s
    return RankedNode(view=view, cost=cost, straggler=straggler, prefill_cost=prefill_s * slowdown)


def request_cost(rn: RankedNode, prompt_tokens: int, open_sessions: int,
                 config: RoutingConfig = DEFAULT_CONFIG) -> float:
    """`rn`'s cost for one request: its cost per decode token plus, when the prompt length is
    known, its prefill seconds spread over the tokens a request is expected to decode (so a long
    prompt favours the hops that prefill fast); raised for the sessions it holds now (the
    tracker's exact count), so replicas share the sessions."""
    cost = rn.cost
    if prompt_tokens > 0:
        cost += rn.prefill_cost * prompt_tokens / max(1, config.decode_tokens_per_request)
    return cost * (1.0 + config.session_weight * max(open_sessions, 0))


def _bucket(start: int, end: int, views: Sequence[NodeView], config: RoutingConfig,
            rates: ByteRates) -> ShardBucket:
    measured = [v.decode_tps for v in views if v.decode_tps > 0]
    median = statistics.median(measured) if measured else 0.0
    measured_prefill = [v.prefill_tps for v in views if v.prefill_tps > 0]
    median_prefill = statistics.median(measured_prefill) if measured_prefill else 0.0
    ranked = [hop_cost(v, median, config, median_prefill_tps=median_prefill, rates=rates) for v in views]
    ranked.sort(key=lambda r: (r.cost, r.view.node_id))
    return ShardBucket(start=start, end=end, ranked=ranked, median_tps=median)


def build_group(views: Sequence[NodeView], config: RoutingConfig = DEFAULT_CONFIG) -> RouteGroup:
    """Index nodes sharing one (model_revision, cache_abi) by shard range."""
    by_range: dict[tuple[int, int], list[NodeView]] = defaultdict(list)
    for v in views:
        by_range[(v.start, v.end)].append(v)
    rates = byte_rates(views, config)
    buckets: dict[int, list[ShardBucket]] = defaultdict(list)
    for (start, end), members in sorted(by_range.items()):
        buckets[start].append(_bucket(start, end, members, config, rates))
    first = min(views, key=lambda v: v.node_id)
    return RouteGroup(
        model=first.model,
        model_revision=first.model_revision,
        cache_abi=first.cache_abi,
        n_layer=first.n_layer,
        hidden_size=first.hidden_size,
        buckets=dict(buckets),
        starts=sorted(buckets),
        n_nodes=len(views),
    )


def build_index(nodes: Iterable[NodeView], config: RoutingConfig = DEFAULT_CONFIG) -> RouteIndex:
    """Group by (revision, ABI), index by shard start, rank each range's nodes by cost."""
    grouped: dict[GroupKey, list[NodeView]] = defaultdict(list)
    for v in nodes:
        grouped[v.group].append(v)
    index = RouteIndex()
    for key in sorted(grouped):
        group = build_group(grouped[key], config)
        index.groups[key] = group
        for name in {group.model, group.model_revision}:
            index.by_model.setdefault(name, []).append(key)
        for bucket_list in group.buckets.values():
            for bucket in bucket_list:
                for rn in bucket.ranked:
                    index.nodes[rn.view.node_id] = (key, rn)
    return index


Pick = Callable[[ShardBucket], list[RankedNode]]
Seam = Callable[[NodeView | None, NodeView], float]  # seconds a token spends crossing into a hop
Back = Callable[[NodeView, NodeView], float]  # seconds a token spends going from a tail to its head


def sender_rtts(view: NodeView, replicas: Iterable[NodeView]) -> Mapping[str, float]:
    """The round trips `view`'s seams are priced with (pure): its own; when it has measured
    nothing yet (it just joined), per peer the mean of what the other replicas of its range
    reached it in. Counted 0, its seams made a new head or middle hop the nearest of all, and
    new routes flooded it until its first report."""
    if view.peer_rtt_ms:
        return view.peer_rtt_ms
    reached: dict[str, list[float]] = defaultdict(list)
    for r in replicas:
        if r.node_id != view.node_id:
            for peer, ms in r.peer_rtt_ms.items():
                if ms < MAX_RTT_MS:
                    reached[peer].append(ms)
    return {peer: sum(ms) / len(ms) for peer, ms in reached.items()}


def unmeasured_ms(rtts: Mapping[str, float]) -> float:
    """A sender's round trip to a peer it has not measured, in ms (pure): its average round trip
    to the peers it reached (0 when none), so a node nobody has measured yet is neither
    preferred nor shunned."""
    reached = [v for v in rtts.values() if v < MAX_RTT_MS]
    return sum(reached) / len(reached) if reached else 0.0


def seam_seconds(rtts: Mapping[str, float], receiver: str, unmeasured: float | None = None) -> float:
    """A seam's round trip in seconds (pure): what its sender measured to `receiver` (MAX_RTT_MS
    when it could not reach it); unmeasured, `unmeasured_ms(rtts)` (`unmeasured`: that figure
    worked out before, as a route search does once per sender)."""
    ms = rtts.get(receiver)
    if ms is None:
        ms = unmeasured_ms(rtts) if unmeasured is None else unmeasured
    return ms / 1000.0


def gateway_seconds(head_rtt: Mapping[str, float], head: str, prompt_tokens: int = 0,
                    config: RoutingConfig = DEFAULT_CONFIG, unmeasured: float | None = None) -> float:
    """The gateway's round trip to a head, per decode token (pure). The gateway pays it once
    per prefill frame (it waits for each one's answer) and once for the Decode Run, whose
    tokens the head then streams without waiting on the gateway: so, like a hop's prefill
    (`request_cost`), it is spread over the tokens a request is expected to decode. (Counted
    per token, a head far from the gateway but near the rest lost to one near the gateway and
    far from its next hop, whose trip every token pays.)"""
    frames = -(-max(prompt_tokens, 1) // max(1, config.prefill_chunk_tokens))
    return seam_seconds(head_rtt, head, unmeasured) * (frames + 1) / max(1, config.decode_tokens_per_request)


def seam_in(sender_rtts: Mapping[str, float] | None, receiver: str, head_rtt: Mapping[str, float],
            prompt_tokens: int = 0, config: RoutingConfig = DEFAULT_CONFIG,
            unmeasured: float | None = None) -> float:
    """Seconds a token spends crossing into hop `receiver` (pure): one way across a seam, as its
    sender measured the round trip (`sender_rtts`); into a head (no sender), the gateway's
    round trips to it for one request, spread over its tokens (`gateway_seconds`). `unmeasured`:
    the sender's (or the gateway's) `unmeasured_ms`, when worked out before."""
    if sender_rtts is None:
        return gateway_seconds(head_rtt, receiver, prompt_tokens, config, unmeasured)
    return seam_seconds(sender_rtts, receiver, unmeasured) / 2


def way_back(head_rtts: Mapping[str, float], tail: str, unmeasured: float | None = None) -> float:
    """The tail's token to the head, one way (pure): across the only seam on 2 hops, straight
    back on more (direct return), as the head measured its round trip to the tail."""
    return seam_seconds(head_rtts, tail, unmeasured) / 2


def _no_seam(_sender: NodeView | None, _receiver: NodeView) -> float:
    return 0.0


def _no_back(_tail: NodeView, _head: NodeView) -> float:
    return 0.0


Reached = tuple[float, tuple[str, ...], tuple[RankedNode, ...]]  # cost, node ids (ties), hops


def _best_chain(group: RouteGroup, pick: Pick, seam: Seam = _no_seam,
                back: Back = _no_back) -> tuple[float, tuple[RankedNode, ...]] | None:
    """Cheapest exact chain 0 -> n_layer over pick(bucket)'s nodes of each range: each hop's
    cost plus the seam into it, and into a tail also the way back to the chain's head. A DP
    over (boundary, the hop that reached it, the chain's head), exact on any number of hops:
    the way back depends on the head, so chains from different heads that meet at a hop all go
    on, except one that cannot win whatever the tail (`_dominated`): with the round trips
    unmeasured or alike, one chain per hop, as a DP without the head."""
    picked = {id(b): pick(b) for start in group.starts for b in group.buckets[start]}
    tails = [rn.view for start in group.starts for b in group.buckets[start] if b.end == group.n_layer
             for rn in picked[id(b)]]
    heads = {rn.view.node_id: rn.view for b in group.buckets.get(0, []) for rn in picked[id(b)]}
    bounds = WayBack(heads, tails, back)
    best: dict[int, dict[str, dict[str, Reached]]] = {0: {"": {"": (0.0, (), ())}}}  # boundary, hop, head
    for start in group.starts:
        reached = [c for by_head in best.get(start, {}).values() for c in by_head.values()]
        for bucket in group.buckets[start]:
            tail = bucket.end == group.n_layer
            for rn in picked[id(bucket)]:
                by_head = best.setdefault(bucket.end, {}).setdefault(rn.view.node_id, {})
                for cost, ids, chain in reached:
                    into = seam(chain[-1].view if chain else None, rn.view)
                    if tail and chain:
                        into += back(rn.view, chain[0].view)
                    head = (chain[0] if chain else rn).view.node_id
                    _keep(by_head, head, (cost + rn.cost + into, (*ids, rn.view.node_id), (*chain, rn)),
                          None if tail else bounds)  # at the tail every way back is counted
    done = [c for by_head in best.get(group.n_layer, {}).values() for c in by_head.values()]
    if not done:
        return None
    cost, _, chain = min(done, key=lambda p: p[:2])
    return cost, chain


class WayBack:
    """Each head's cheapest and dearest way back over the tails a search may pick, worked out
    the first time two heads' chains meet (a head that measured nothing priced as `sender_rtts`
    prices it, through `back`)."""

    def __init__(self, heads: Mapping[str, NodeView], tails: Sequence[NodeView], back: Back) -> None:
        self._heads, self._tails, self._back = heads, tails, back
        self._known: dict[str, tuple[float, float]] = {}

    def get(self, head: str, default: tuple[float, float]) -> tuple[float, float]:
        known = self._known.get(head)
        if known is None:
            view = self._heads.get(head)
            if view is None:
                return default
            ways = [self._back(t, view) for t in self._tails if t.node_id != head] or [0.0]
            known = self._known[head] = (min(ways), max(ways))
        return known


def _keep(by_head: dict[str, Reached], head: str, cand: Reached, bounds: WayBack | None) -> None:
    """Keep `cand` (a chain from `head` reaching one hop) unless another head's chain to that
    hop beats it whatever the tail; drop those it beats so (pure over the dict it edits).
    `bounds`: each head's cheapest and dearest way back still to come."""
    cur = by_head.get(head)
    if cur is not None and cur[:2] <= cand[:2]:
        return
    if len(by_head) == (0 if cur is None else 1):  # no other head's chain reached this hop
        by_head[head] = cand
        return
    def ways(h: str) -> tuple[float, float]:
        return (0.0, 0.0) if bounds is None else bounds.get(h, (0.0, 0.0))

    mine = ways(head)
    if not any(h != head and _dominated(cand, mine, other, ways(h)) for h, other in by_head.items()):
        by_head[head] = cand
        for h in [h for h, other in by_head.items() if h != head and _dominated(other, ways(h), cand, mine)]:
            del by_head[h]


def _dominated(chain: Reached, ways: tuple[float, float], other: Reached, other_ways: tuple[float, float]) -> bool:
    """Whether `chain` cannot end cheaper than `other` (same hop, other heads): even its cheapest
    way back loses to the other's dearest (ties broken by node ids, as the final choice is)."""
    return (other[0] + other_ways[1], other[1]) < (chain[0] + ways[0], chain[1])


def _restrict(group: RouteGroup, ranked: Iterable[RankedNode]) -> RouteGroup:
    """A copy of `group` holding only the given nodes (for private allow lists)."""
    by_range: dict[tuple[int, int], list[RankedNode]] = defaultdict(list)
    for rn in ranked:
        by_range[(rn.view.start, rn.view.end)].append(rn)
    buckets: dict[int, list[ShardBucket]] = defaultdict(list)
    for (start, end), members in sorted(by_range.items()):
        members.sort(key=lambda r: (r.cost, r.view.node_id))
        buckets[start].append(ShardBucket(start, end, members, 0.0))
    return RouteGroup(
        model=group.model,
        model_revision=group.model_revision,
        cache_abi=group.cache_abi,
        n_layer=group.n_layer,
        hidden_size=group.hidden_size,
        buckets=dict(buckets),
        starts=sorted(buckets),
        n_nodes=sum(len(m) for m in by_range.values()),
    )


def _candidate_groups(index: RouteIndex, query: RouteQuery) -> list[RouteGroup]:
    keys = index.by_model.get(query.model, [])
    groups = [index.groups[k] for k in keys]
    if not query.private:
        return groups
    allowed: dict[GroupKey, list[RankedNode]] = defaultdict(list)
    for node_id in sorted(query.allow):
        entry = index.nodes.get(node_id)
        if entry is not None and entry[0] in keys:
            allowed[entry[0]].append(entry[1])
    return [_restrict(index.groups[k], allowed[k]) for k in keys if k in allowed]


class Seams:
    """One route search's seams (`seam_in`, `way_back`), each sender's round trips as
    `sender_rtts` gives them and its `unmeasured_ms`, each worked out once per search (a search
    prices a sender's seams to every candidate after it, most of them unmeasured)."""

    def __init__(self, index: RouteIndex, query: RouteQuery, config: RoutingConfig) -> None:
        self._index, self._query, self._config = index, query, config
        self._senders: dict[str, tuple[Mapping[str, float], float]] = {}  # node id -> (rtts, unmeasured_ms)
        self._gateway = unmeasured_ms(query.head_rtt)

    def rtts(self, view: NodeView) -> tuple[Mapping[str, float], float]:
        known = self._senders.get(view.node_id)
        if known is None:
            rtts = view.peer_rtt_ms or sender_rtts(view, self._index.replicas(view))
            known = self._senders[view.node_id] = (rtts, unmeasured_ms(rtts))
        return known

    def seam(self, sender: NodeView | None, receiver: NodeView) -> float:
        if sender is None:
            return seam_in(None, receiver.node_id, self._query.head_rtt, self._query.prompt_tokens,
                           self._config, self._gateway)
        rtts, unmeasured = self.rtts(sender)
        return seam_in(rtts, receiver.node_id, self._query.head_rtt, unmeasured=unmeasured)

    def back(self, tail: NodeView, head: NodeView) -> float:
        rtts, unmeasured = self.rtts(head)
        return way_back(rtts, tail.node_id, unmeasured)


def plan_route(
    index: RouteIndex,
    query: RouteQuery,
    live: Mapping[str, int] | None = None,
    config: RoutingConfig = DEFAULT_CONFIG,
) -> RoutePlan | RouteError:
    """Choose the cheapest exact chain, or say why there is none.

    `live` maps each currently alive node to its free session slots; a node missing from it
    is treated as gone (so a stale index never routes through an expired node). A node's
    cost counts the sessions it holds now, so replicas share the load, and the prompt's prefill
    when the query gives its length (`request_cost`)."""
    if query.model not in index.by_model:
        return RouteError(code="unknown_model", message=f"no node serves model {query.model!r}")
    groups = _candidate_groups(index, query)
    exclude, protocol, needs_ctx = query.exclude, query.protocol, query.needs_ctx

    def present(rn: RankedNode) -> bool:
        node_id = rn.view.node_id
        return (live is None or node_id in live) and node_id not in exclude

    def alive(rn: RankedNode) -> bool:  # and reads what the request needs
        return present(rn) and rn.view.protocol >= protocol

    def eligible(bucket: ShardBucket) -> list[RankedNode]:
        for rn in bucket.ranked:  # a Kept Hop that still serves: its KV holds the history (no slot needed)
            if (rn.view.node_id, bucket.start, bucket.end) in query.keep and alive(rn):
                return [RankedNode(view=rn.view, cost=0.0, straggler=rn.straggler, prefill_cost=0.0)]
        costed = []
        for rn in bucket.ranked:  # (per candidate of every search: checks inlined, cheapest first)
            view = rn.view
            left = view.free_slots if live is None else live.get(view.node_id, 0)  # 0: not alive
            if (left > 0 and view.node_id not in exclude and view.protocol >= protocol
                    and needs_ctx <= (view.n_ctx or needs_ctx)):
                cost = request_cost(rn, query.prompt_tokens, view.max_sessions - left, config)
                costed.append((cost, view.node_id, rn))
        costed.sort(key=lambda c: c[:2])
        return [RankedNode(view=rn.view, cost=cost, straggler=rn.straggler, prefill_cost=rn.prefill_cost)
                for cost, _, rn in costed[:config.candidates_per_range]]

    seams = Seams(index, query, config)
    plans: list[RoutePlan] = []
    for group in groups:
        found = _best_chain(group, eligible, seams.seam, seams.back)
        if found is not None:
            plans.append(RoutePlan(group, tuple(rn.view for rn in found[1]), found[0]))
    if plans:
        return min(plans, key=lambda p: (p.cost, p.group.model_revision, p.group.cache_abi))
    return _explain_failure(index, query, groups, alive, present)


def _older_in_the_way(query: RouteQuery, groups: Sequence[RouteGroup],
                      present: Callable[[RankedNode], bool]) -> RouteError | None:
    """`incompatible` when the request's fields need a newer protocol than some nodes read and
    every chain would cross one of them (pure), naming them and both protocols; else None."""
    def any_present(bucket: ShardBucket) -> list[RankedNode]:
        return next(([rn] for rn in bucket.ranked if present(rn)), [])

    if query.protocol <= FIRST or not any(_best_chain(g, any_present) is not None for g in groups):
        return None
    older = sorted({(rn.view.node_id, rn.view.protocol) for g in groups for bl in g.buckets.values()
                    for b in bl for rn in b.ranked if present(rn) and rn.view.protocol < query.protocol})
    names = ", ".join(f"{node} (protocol {p})" for node, p in older[:8]) + (" ..." if len(older) > 8 else "")
    fields = ", ".join(query.protocol_fields)
    return RouteError(
        code="incompatible",
        message=f"this request's {fields} needs mesh protocol {query.protocol} on every hop, and every "
        f"route of {query.model!r} crosses a node of an older Meshnet: {names}. Upgrade those nodes, "
        f"or send the request without {fields} ({what_sets(query.protocol_fields)})",
    )


def _explain_failure(
    index: RouteIndex,
    query: RouteQuery,
    groups: Sequence[RouteGroup],
    alive: Callable[[RankedNode], bool],
    present: Callable[[RankedNode], bool],
) -> RouteError:
    """No eligible chain: tell no_capacity from incompatible from no_coverage (`present`: the
    nodes that would be eligible but for the protocol the request needs)."""
    scope = "allowed " if query.private else ""

    def any_alive(bucket: ShardBucket) -> list[RankedNode]:
        return next(([rn] for rn in bucket.ranked if alive(rn)), [])

    if any(_best_chain(g, any_alive) is not None for g in groups):
        return RouteError(
            code="no_capacity",
            message=f"{query.model!r} is covered by {scope}nodes but none has a free session slot"
            + (f" with n_ctx >= {query.needs_ctx}" if query.needs_ctx else ""),
        )
    older = _older_in_the_way(query, groups, present)
    if older is not None:
        return older
    return _uncovered(index, query, groups, present)


def _uncovered(index: RouteIndex, query: RouteQuery, groups: Sequence[RouteGroup],
               present: Callable[[RankedNode], bool]) -> RouteError:
    """No chain of present nodes at all: `incompatible` when only mixing revisions or cache
    ABIs would cover the model, else `no_coverage` with the layers nobody serves."""
    scope = "allowed " if query.private else ""

    def any_present(bucket: ShardBucket) -> list[RankedNode]:
        return next(([rn] for rn in bucket.ranked if present(rn)), [])

    all_groups = [index.groups[k] for k in index.by_model[query.model]]
    n_layer = max(all_groups, key=lambda g: (g.n_nodes, g.model_revision)).n_layer
    ranges: set[tuple[int, int]] = set()
    for g in groups:
        if g.n_layer != n_layer:
            continue
        for bucket_list in g.buckets.values():
            for bucket in bucket_list:
                if any_present(bucket):
                    ranges.add((bucket.start, bucket.end))
    if len(groups) > 1 and chains_exactly(ranges, n_layer):
        return RouteError(
            code="incompatible",
            message=f"{scope}nodes of {query.model!r} cover every layer only by mixing "
            "model revisions or cache ABIs",
        )
    missing = missing_ranges(ranges, n_layer)
    detail = "missing layers"
    if not missing:  # every layer is served, but shards overlap without meeting exactly
        missing = [(furthest_boundary(ranges, n_layer), n_layer)]
        detail = "no exact chain of shards past layer"
    text = ", ".join(f"[{a},{b})" for a, b in missing)
    return RouteError(
        code="no_coverage",
        message=f"{scope}nodes of {query.model!r}: {detail} {text}",
        missing_ranges=missing,
    )


def select_route(
    index: RouteIndex,
    request: RouteRequest,
    *,
    session_id: str,
    route_id: str,
    live: Mapping[str, int] | None = None,
    config: RoutingConfig = DEFAULT_CONFIG,
    exclude: frozenset[str] = frozenset(),
) -> RouteSession | RouteError:
    """A Route Session for `request`, or the typed reason why not (`config`: the one the index
    was built with; `exclude`: nodes left out besides the request's own)."""
    query = RouteQuery.from_request(request)
    plan = plan_route(index, replace(query, exclude=query.exclude | exclude), live, config)
    if isinstance(plan, RouteError):
        return plan
    return route_session(plan, request, session_id=session_id, route_id=route_id)


def route_session(
    plan: RoutePlan, request: RouteRequest, *, session_id: str, route_id: str
) -> RouteSession:
    """Bind a plan to a session: hops in layer order with their activation URLs."""
    g = plan.group
    keep = {(k.node_id, k.layer_start, k.layer_end): k.session_id for k in kept_hops(request)}

    def kept(v: NodeView) -> dict[str, object]:
        old = keep.get((v.node_id, v.start, v.end))
        return {"keep_session": old, "keep_position": request.keep_position} if old else {}

    return RouteSession(
        session_id=session_id,
        route_id=route_id,
        epoch=request.epoch,
        model=g.model,
        model_revision=g.model_revision,
        cache_abi=g.cache_abi,
        n_layer=g.n_layer,
        hidden_size=g.hidden_size,
        n_ctx=min((v.n_ctx for v in plan.hops if v.n_ctx), default=0),
        hops=[
            Hop(node_id=v.node_id, activation_url=v.activation_url, layer_start=v.start, layer_end=v.end,
                kv_profile=v.kv_profile, window=v.window, **kept(v))  # type: ignore[arg-type]
            for v in plan.hops
        ],
        sampling=request.sampling,
    )
