"""Artifact plane messages: which pieces a node holds, peer lists, bad-piece reports, fetch progress.

Subjects (bus/subjects.py) carry the publishing node's id, as everything a node publishes does:
`mesh.artifact.<artifact_id>.have.<node_id>`, `….bad.<node_id>`, `….progress.<node_id>`. The
tracker answers `mesh.tracker.artifact.peers` from the inventory it keeps of `have` messages.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable
from typing import ClassVar, Literal

from pydantic import BaseModel, Field

from schemas.base import BusMessage

_ID = r"^[A-Za-z0-9_\-]+$"
_AID = r"^[0-9a-f]{32}$"


def encode_bits(indexes: Iterable[int], n: int) -> str:
    """A bitfield of n bits (bit i set: piece i held), base64 (BitTorrent's `bitfield`)."""
    buf = bytearray((n + 7) // 8)
    for i in indexes:
        if 0 <= i < n:
            buf[i >> 3] |= 0x80 >> (i & 7)
    return base64.b64encode(bytes(buf)).decode()


def decode_bits(text: str, n: int) -> set[int]:
    """The set indexes of a bitfield from encode_bits."""
    buf = base64.b64decode(text.encode()) if text else b""
    return {i for i in range(min(n, len(buf) * 8)) if buf[i >> 3] & (0x80 >> (i & 7))}


class ArtifactHave(BusMessage):
    """A seeder's inventory of one artifact: which pieces it serves, and where."""

    TYPE: ClassVar[str] = "artifact.have"
    node_id: str = Field(min_length=1, max_length=64, pattern=_ID)
    artifact_id: str = Field(pattern=_AID)
    seed_url: str  # base URL; pieces are at /v1/artifacts/<artifact_id>/pieces/<piece_id>
    n_pieces: int = Field(ge=1)
    have: str = Field(max_length=1 << 20, pattern=r"^[A-Za-z0-9+/]*={0,2}$")  # encode_bits of the piece indexes held
    complete: bool = False  # holds the whole file (it also serves /v1/artifacts/<id>/file)
    held_bytes: int = Field(default=0, ge=0)


class BadPieceReport(BusMessage):
    """A fetcher's report: `peer_node_id` sent bytes for `piece_id` that did not verify."""

    TYPE: ClassVar[str] = "artifact.bad_piece"
    node_id: str = Field(min_length=1, max_length=64, pattern=_ID)  # the reporter
    artifact_id: str = Field(pattern=_AID)
    peer_node_id: str = Field(min_length=1, max_length=64, pattern=_ID)
    piece_id: str = Field(pattern=r"^[0-9a-f]{64}$")
    reason: str = Field(max_length=500)


class ArtifactProgress(BusMessage):
    """A fetcher's progress on the pieces of its layer range."""

    TYPE: ClassVar[str] = "artifact.progress"
    node_id: str = Field(min_length=1, max_length=64, pattern=_ID)
    artifact_id: str = Field(pattern=_AID)
    layer_start: int = Field(ge=0)
    layer_end: int = Field(gt=0)
    state: Literal["fetching", "done", "failed"]
    bytes_done: int = Field(ge=0)
    bytes_total: int = Field(ge=0)
    pieces_done: int = Field(ge=0)
    pieces_total: int = Field(ge=0)
    rate_mb_s: float = Field(default=0.0, ge=0.0)
    eta_s: float | None = None
    peers: list[str] = Field(default_factory=list)
    message: str = ""
    # on "done": every byte received this run (refused ones too), what was held before it in
    # verified pieces, and the bytes of partial pieces (a cut download's) kept and continued
    bytes_fetched: int = Field(default=0, ge=0)
    bytes_already: int = Field(default=0, ge=0)
    bytes_resumed: int = Field(default=0, ge=0)
    refused: list[str] = Field(default_factory=list)  # "<peer>:<piece_id>" sent bad bytes
    failed_peers: list[str] = Field(default_factory=list)


class PeersRequest(BusMessage):
    """Ask the tracker who seeds an artifact."""

    TYPE: ClassVar[str] = "artifact.peers_request"
    artifact_id: str = Field(pattern=_AID)
    node_id: str = ""  # the asker (left out of the answer)


class SeedPeer(BaseModel):
    node_id: str
    seed_url: str
    have: str  # encode_bits
    complete: bool = False
    bad_pieces: int = 0  # pieces fetchers reported bad from this peer


class PeersReply(BusMessage):
    """The tracker's inventory of one artifact: live seeders, peers reported bad last."""

    TYPE: ClassVar[str] = "artifact.peers"
    artifact_id: str
    n_pieces: int = 0
    peers: list[SeedPeer] = Field(default_factory=list)


class SpareAnnouncement(BusMessage):
    """Published on mesh.node.<node_id>.spare every second by a node that serves nothing yet
    and will load any layer range of `artifact_id` the tracker orders (RebalanceDirective)."""

    TYPE: ClassVar[str] = "node.spare"
    node_id: str = Field(min_length=1, max_length=64, pattern=_ID)
    artifact_id: str = Field(pattern=_AID)
    model: str
    model_revision: str
    cache_abi: str
    n_layer: int = Field(gt=0)
    memory_bytes: int = Field(ge=0)  # what it may spend on a shard (weights + KV)
    disk_bytes: int = Field(ge=0)  # free space where it keeps pieces
    state: Literal["waiting", "loading"] = "waiting"


RebalanceCode = Literal["accepted", "insufficient_memory", "insufficient_disk", "wrong_model", "busy", "failed"]


class RebalanceReply(BusMessage):
    """A node's answer to a rebalance order, on mesh.node.<node_id>.rebalance_reply. A refusal
    names why; the tracker then orders another node."""

    TYPE: ClassVar[str] = "node.rebalance_reply"
    node_id: str = Field(min_length=1, max_length=64, pattern=_ID)
    model_revision: str
    layer_start: int = Field(ge=0)
    layer_end: int = Field(gt=0)
    code: RebalanceCode
    message: str = ""

    @property
    def accepted(self) -> bool:
        return self.code == "accepted"
