"""Route requests, Route Sessions and their hops, directives and route failures."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from schemas.base import BusMessage
from schemas.capability import KvProfile
from schemas.node import PeerRtts
from schemas.sampling import SamplingParams

# routes of this many hops or more return each Decode Run token from the tail straight to the
# head (a Return Stream); on 2 hops the tail's answer to the head already is that
DIRECT_RETURN_HOPS = 3


class Hop(BaseModel):
    """One step of an Inference Route: which node runs which layers, reached where."""

    model_config = ConfigDict(frozen=True)

    node_id: str
    activation_url: str  # base URL of the node's activation server, e.g. http://127.0.0.1:7101
    layer_start: int
    layer_end: int
    kv_profile: KvProfile = "default"  # the node's (Capability Report): "exact" hops replay a restart by batch
    # the next hop's frame credential, sealed with this hop's frame key (schemas/credentials.py);
    # empty for the tail. Useless to anyone without that key, so it may travel in directives.
    sealed_next: str = Field(default="", pattern=r"^([0-9a-f]{32})?$")
    # the head of a route of 3 or more hops: the tail's credential, sealed with this hop's key
    # for its Return Stream (tokens straight from the tail; purpose "seal-return"); else empty
    sealed_return: str = Field(default="", pattern=r"^([0-9a-f]{32})?$")
    # a restart's Kept Hop: this node continues the session it served as `keep_session` on the
    # lost route, keeping that Hot KV State's first `keep_position` positions (docs/shard-runtime.md,
    # "Kept hops"); "" and 0 for a hop that starts empty
    keep_session: str = Field(default="", max_length=128)
    keep_position: int = Field(default=0, ge=0)
    # the credit window the node's new sessions grant (its announcement's): the sender posts
    # that many frames before the first ack (1: a node from before it was announced)
    window: int = Field(default=1, ge=1)

    @property
    def kept(self) -> int:
        """Positions this hop already holds when the route opens (0: it starts empty)."""
        return self.keep_position if self.keep_session else 0


def inbound_start(hops: list[Hop], index: int) -> int:
    """The first position hop `index` must receive rows for on a new route (pure).

    A Kept Hop computes only the rows past what it keeps; a hop starting empty computes them
    all. A hop must also receive the rows its next hop needs, since their outputs leave from
    it (a Kept Hop sends the outputs it already made from its Seam Log). So the head of a
    restart with any empty hop receives the whole history, and a Kept Hop followed only by
    Kept Hops receives the rows past its keep: the last token of the history."""
    start = hops[index].kept
    if index + 1 < len(hops):
        start = min(start, inbound_start(hops, index + 1))
    return start


class KeepHop(BaseModel):
    """A hop of a lost route that is still serving: a restart may continue on it (RouteRequest.keep)."""

    model_config = ConfigDict(frozen=True)

    node_id: str
    session_id: str = Field(min_length=1, max_length=128)  # its session on the lost route
    layer_start: int
    layer_end: int


class RoutePolicy(BaseModel):
    """public: any compatible node. private: only nodes on `allow_nodes`. Never a node on
    `exclude_nodes` (a restart leaves out the hop it lost)."""

    kind: Literal["public", "private"] = "public"
    allow_nodes: list[str] = Field(default_factory=list)
    exclude_nodes: list[str] = Field(default_factory=list, max_length=256)


# A live tracker answers a route request within this. Its deliberate wait fits in it (settling
# directives, at most 0.12 s); claiming the ask takes about 1 ms and the answer milliseconds (measured
# in docs/control-plane.md, "A frozen tracker"). The gateway derives its first ask's wait from it.
ROUTE_ANSWER_S = 0.25
# ... plus the round trips to its NATS server that answering crosses, which a distant bus makes
# long (docs/control-plane.md, "A distant bus"): the ask comes in and the answer goes out over
# one, and claiming the ask (tracker/asks.py) takes one when the claim is first, at most
# CLAIM_ROUND_TRIPS when another copy's claim holds it (a create, the client's look at the key
# that refused it, the read of the route that holds it).
CLAIM_ROUND_TRIPS = 3
FIRST_ANSWER_ROUND_TRIPS = 2  # an ask that claims first: in and out, and the claim's create
ANSWER_ROUND_TRIPS = 1 + CLAIM_ROUND_TRIPS  # any copy of an ask


class RouteRequest(BusMessage):
    """Gateway → tracker (request/reply on mesh.tracker.route.create)."""

    TYPE: ClassVar[str] = "route.request"
    model: str  # model name as announced (or its revision)
    session_id: str | None = None  # the tracker assigns one when absent
    policy: RoutePolicy = Field(default_factory=RoutePolicy)
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    prompt_tokens: int = 0  # for capacity checks against n_ctx
    # positions every hop must hold: the prompt and the most tokens the answer may have (0: prompt_tokens)
    context_tokens: int = Field(default=0, ge=0)
    epoch: int = Field(default=1, ge=1)  # > 1: a restart of the session on a new route
    # a restart: hops of the lost route still serving, and the history positions they keep;
    # the tracker keeps those it can (each one then needs no free slot: it continues its session)
    keep: list[KeepHop] = Field(default_factory=list, max_length=64)
    keep_position: int = Field(default=0, ge=0)
    # a restart because the tracker moved the session (tracker/spread.py), not because a hop was lost
    move: bool = False
    # the same on every try of this ask: the trackers open one route for it (tracker/asks.py)
    request_id: str = Field(default="", max_length=64, pattern=r"^[A-Za-z0-9_\-]*$")
    # the gateway's measured round trips (ms) to the nodes that could be the route's head
    head_rtt_ms: PeerRtts = Field(default_factory=dict)
    # who drives the route: its hops free the session within seconds once that driver is silent
    # (DriverAlive); empty: nobody says, the hops' idle lease frees it
    driver_id: str = Field(default="", max_length=64, pattern=r"^[A-Za-z0-9_\-]*$")


class RouteWithdrawal(BusMessage):
    """Asker → every tracker (mesh.tracker.route.withdraw): it gave up on a route request (no
    answer in time, or its client left). No tracker opens a route for that request any more,
    and a route one already opened is closed: nobody will drive it."""

    TYPE: ClassVar[str] = "route.withdrawal"
    request_id: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_\-]*$")
    session_id: str | None = None
    reason: str = Field(default="", max_length=200)


class RouteSession(BaseModel):
    """One request bound to one ordered route. `epoch` increases if a route is ever re-made."""

    session_id: str
    route_id: str
    epoch: int = 1
    model: str
    model_revision: str
    cache_abi: str
    n_layer: int
    hidden_size: int
    n_ctx: int
    hops: list[Hop]
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    request_id: str = ""  # the RouteRequest that opened it: only the same request is given it again
    # a move's route (tracker/spread.py): its hops rebuild the history like any prompt, while a
    # route that replaces a lost one rebuilds first (nodes/server/scheduler.py, plan_batch)
    moved: bool = False
    driver_id: str = ""  # its RouteRequest's (the gateway driving it)
    # its RouteRequest's: the gateway's round trips to heads, which every tracker's spreader
    # prices a head's move with (tracker/spread.py), also after a restart from the session bucket
    head_rtt_ms: PeerRtts = Field(default_factory=dict)
    expires_at: int = 0  # unix seconds: the session's frame credentials end then
    # C_0..C_n-1 (schemas/credentials.py): only in the route reply to the gateway (a private
    # attribute, never serialized, so no directive, event or log line can carry it)
    _credentials: list[str] = PrivateAttr(default_factory=list)

    @property
    def credentials(self) -> list[str]:
        """What frames to each hop must present; empty where the session came from a directive."""
        return self._credentials

    def grant(self, credentials: list[str]) -> RouteSession:
        """Attach the hops' credentials (from the route reply)."""
        if credentials and len(credentials) != len(self.hops):
            raise ValueError(f"{len(credentials)} credentials for {len(self.hops)} hops")
        self._credentials = list(credentials)
        return self


RouteErrorCode = Literal["no_coverage", "no_capacity", "incompatible", "unknown_model", "bad_request"]

# the words of a tracker's bad_request for a session id another route holds (every tracker since the
# first says them; a gateway reads them as its own 409 session_exists: the id is taken on another
# gateway of the mesh, not malformed)
SESSION_HAS_ROUTE = "already has a route"


class RouteError(BaseModel):
    code: RouteErrorCode
    message: str
    missing_ranges: list[tuple[int, int]] = Field(default_factory=list)
    # a `no_coverage` that only nodes held out after a reported loss cause (the route exists with
    # them): those nodes, and the longest of their holds still to run (seconds; 0 once only
    # hearing from them is due). The asker may wait that long for them (docs/gateway.md).
    held_nodes: list[str] = Field(default_factory=list)
    held_s: float = Field(default=0.0, ge=0.0)


class RouteReply(BusMessage):
    """Tracker → gateway: exactly one of `session` or `error` is set."""

    TYPE: ClassVar[str] = "route.reply"
    session: RouteSession | None = None
    error: RouteError | None = None
    credentials: list[str] = Field(default_factory=list)  # one per hop; sent to the gateway's inbox only

    @model_validator(mode="after")
    def _grant(self) -> RouteReply:
        if self.session is not None and self.credentials:
            self.session.grant(self.credentials)
        return self


class DriverAlive(BusMessage):
    """Published on mesh.driver.<driver_id>.alive every DRIVER_ALIVE_S by a gateway: the nodes
    holding sessions of its routes keep them; once it is silent for DRIVER_SILENCE_S they free
    them (a crashed gateway's sessions do not wait out the idle lease)."""

    TYPE: ClassVar[str] = "route.driver_alive"
    driver_id: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_\-]+$")


DRIVER_ALIVE_S = 1.0
DRIVER_SILENCE_S = 8.0


class RouteDirective(BusMessage):
    """Published on mesh.route.<route_id>.directive: open, close or abort a Route Session, or
    (tracker → gateway) move it off one of its hops (tracker/spread.py)."""

    TYPE: ClassVar[str] = "route.directive"
    action: Literal["open", "close", "abort", "move"]
    session: RouteSession
    reason: str | None = None
    issued_by: str = "tracker"
    # abort: the hop whose loss ended the session (restarts avoid it); move: the hop to leave
    lost_node_id: str | None = None
    # abort: the session left `lost_node_id` because a move asked it to; that node is alive and
    # stays routable (no suspicion), the other hops keep their Hot KV State for the new route
    moved: bool = False
    # close, or an abort that ends the session for good: the rows the driver's answer used (prompt
    # and fed-back tokens); a hop claims no decode row past them in its NodeWork (a head runs a
    # few steps ahead of a driver that left early)
    used_rows: int | None = Field(default=None, ge=0)


Phase = Literal["queued", "routing", "prefill", "decode", "restarting", "finalizing", "completed", "failed"]


class RouteFailure(BaseModel):
    """Structured route failure: which phase, which hop, why. Carried in HTTP and on the bus."""

    session_id: str
    route_id: str
    phase: Phase
    hop_index: int | None = None
    node_id: str | None = None
    reason: str
    code: str = "route_failed"
    restarts: int = 0  # new routes the session had moved to before this failure
