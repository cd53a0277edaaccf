"""Node announcements and heartbeats: how a node tells the tracker what it serves and how it is."""

from __future__ import annotations

from typing import Annotated, ClassVar

from pydantic import Field

from schemas.base import BusMessage
from schemas.capability import CapabilityReport
from schemas.protocol import FIRST

MAX_LISTED_SESSIONS = 1024  # a heartbeat lists its node's session ids up to this many
MAX_RTT_PEERS = 64  # a heartbeat (or a route request) reports round trips to at most this many nodes
MAX_RTT_MS = 60_000.0

NodeId = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_\-]+$")]
RttMs = Annotated[float, Field(ge=0.0, le=MAX_RTT_MS)]
PeerRtts = Annotated[dict[NodeId, RttMs], Field(max_length=MAX_RTT_PEERS)]


class NodeAnnouncement(BusMessage):
    """Published on mesh.node.<node_id>.announce at start, on change, on tracker hello, and periodically."""

    TYPE: ClassVar[str] = "node.announce"
    node_id: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_\-]+$")
    activation_url: str  # base URL of the node's activation server
    capability: CapabilityReport
    started_at: float  # wall-clock time the node process started
    spare: bool = False  # willing to load another shard when the tracker asks (rebalance)
    # the OS process serving the node, random per process (""): the shards of one composite
    # node share it, and share its fate, so a restart that leaves a lost node leaves them too
    process_id: str = Field(default="", max_length=32, pattern=r"^[0-9a-f]*$")
    # the process is shutting down (SIGTERM): the tracker takes it out of routes at once and
    # aborts its routes, instead of routing to it until its heartbeats expire
    leaving: bool = False
    # the mesh protocol the node's code reads (schemas/protocol.py); absent: 1, a node from
    # before it was announced. The tracker routes a request needing a newer one around it
    protocol: int = Field(default=FIRST, ge=1)
    # the credit window a new session of this node grants (frames; `--window`): a sender may
    # post that many frames before the first ack. Absent: 1, a node from before it was announced
    window: int = Field(default=1, ge=1)


class NodeHeartbeat(BusMessage):
    """Published on mesh.node.<node_id>.heartbeat every heartbeat interval (default 1 s)."""

    TYPE: ClassVar[str] = "node.heartbeat"
    node_id: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_\-]+$")
    load: float = Field(default=0.0, ge=0.0)  # busy fraction over the last interval, 0..1
    queue_depth: int = Field(default=0, ge=0)  # frames waiting for the backend
    decode_tokens_per_second: float = Field(default=0.0, ge=0.0)  # measured, 0 = not yet
    prefill_tokens_per_second: float = Field(default=0.0, ge=0.0)
    sessions: int = Field(default=0, ge=0)  # live Route Sessions holding Hot KV State here
    # their session ids, all of them (None: not listed, e.g. more than MAX_LISTED_SESSIONS):
    # the tracker ends a session a hop no longer holds even when the close directive that
    # would have told it was lost (published while a subscriber reconnected)
    session_ids: list[str] | None = Field(default=None, max_length=MAX_LISTED_SESSIONS)
    cache_bytes: int = Field(default=0, ge=0)  # KV bytes held across those sessions
    free_session_slots: int = Field(default=0, ge=0)
    # measured round trips (ms) to the nodes this one sends activations to or may be asked to:
    # those serving the layers after its own (nodes/server/peer_probe.py)
    peer_rtt_ms: PeerRtts = Field(default_factory=dict)
    # the announcing process's started_at (0: not given): a second process with the same id
    # (an operator's mistake) neither keeps the first's registration alive nor takes it over
    started_at: float = Field(default=0.0, ge=0.0)


class NodeKey(BusMessage):
    """Published on meshkey.join.<node_id> (never under mesh.>) before each announcement: the
    node's frame key, from which the tracker derives the credentials frames to it must carry
    (schemas/credentials.py). Only the tracker may read that subject."""

    TYPE: ClassVar[str] = "node.key"
    node_id: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_\-]+$")
    key: str = Field(pattern=r"^[0-9a-f]{64}$")  # 32 bytes, hex
    started_at: float = Field(default=0.0, ge=0.0)  # the process whose key it is (NodeHeartbeat's)
