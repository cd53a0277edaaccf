"""Replay validation and quarantine messages: the validator's hand-over of a sampled
session's ids from the gateway, and the tracker's quarantine notices.

The hand-over is a NATS request on mesh.gateway.replay that only the validator's user may
publish; the reply goes to the validator's own inbox (`_INBOX.validator.…`), which no other
user may read. Monitors see the request (a session id) but never the ids, nor the salt the
session's digests are under."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from schemas.audit import DIGEST_SALT_BYTES, RouteTaken
from schemas.base import BusMessage
from schemas.node import NodeId
from schemas.sampling import SamplingParams

VERDICT_BUCKET = "MESH_VERDICTS"  # evidence of each verdict: both runs' output ids, the salt (not for monitors)
# node id -> its last QuarantineNotice: a quarantine, or the lift that ended one (a tracker started
# later reads it; only "quarantine" entries are quarantined nodes)
QUARANTINE_BUCKET = "MESH_QUARANTINE"


class ReplayRecordRequest(BusMessage):
    """Validator -> gateways: the ids of a session the gateway sampled for validation."""

    TYPE: ClassVar[str] = "validation.replay_request"
    session_id: str = Field(min_length=1, max_length=64)
    validator_id: str = Field(min_length=1, max_length=64)


class ReplayRecord(BusMessage):
    """Gateway -> validator (its inbox only): what a replay needs, checked by the validator
    against the ValidationEvent's digests under `digest_salt`."""

    TYPE: ClassVar[str] = "validation.replay_record"
    session_id: str
    # hex of the random salt the gateway drew for this session: its event's digests are under it
    digest_salt: str = Field(pattern=f"^[0-9a-f]{{{2 * DIGEST_SALT_BYTES}}}$")
    prompt_ids: list[int] = Field(default_factory=list)
    output_ids: list[int] = Field(default_factory=list)
    # the tail's logprob of each output token (None where the tail gave none)
    output_logprobs: list[float | None] = Field(default_factory=list)
    sampling: SamplingParams = Field(default_factory=SamplingParams)  # as the tail sampled (seeded)
    routes: list[RouteTaken] = Field(default_factory=list)
    prefill_chunk_size: int = Field(default=0, ge=0)  # the gateway's prefill chunk (0: the route's default)
    private: bool = False  # a private route policy: the ids may go to no node outside its allow list
    restart_replay: str = "decode"  # how a restart's route rebuilt the tokens ("prefill": not bit-exact)

    def salt(self) -> bytes:
        """The session's digest salt."""
        return bytes.fromhex(self.digest_salt)


QuarantineAction = Literal["quarantine", "lift"]


class QuarantineNotice(BusMessage):
    """Tracker -> everyone (mesh.tracker.quarantine): a node leaves new routes, or comes back."""

    TYPE: ClassVar[str] = "tracker.quarantine"
    node_id: NodeId  # a key of the MESH_QUARANTINE bucket: one subject token
    action: QuarantineAction
    reason: str
    verdict_ids: list[str] = Field(default_factory=list)  # the verdicts that implicated it
    issued_by: str  # the tracker id, or "operator" for a lift
    # a lift: the MESH_AUDIT sequence it applies up to (verdicts stored up to it no longer count
    # against the node, also for a tracker that reads them back after a restart)
    audit_seq: int = Field(default=0, ge=0)
    # a lift: whether the node was in quarantine at the tracker that issued it (None: not said)
    was_quarantined: bool | None = None


class UnquarantineRequest(BusMessage):
    """Operator -> every tracker (`meshnet tracker unquarantine NODE`, operator credentials):
    each answers with its lift (a QuarantineNotice)."""

    TYPE: ClassVar[str] = "tracker.unquarantine"
    # a node id, as every node's: the tracker writes the lift under it as a key of the
    # MESH_QUARANTINE bucket, and a 5,000-character one overran NATS's control line, so the
    # server dropped the tracker's connection and the mesh had no tracker from then on
    node_id: NodeId
    by: str = "operator"


class HopEvidenceRequest(BusMessage):
    """Validator -> one node (mesh.node.<id>.evidence, only the validator may publish): a page
    of the rows that node received and sent for a session (nodes/server/hop_evidence.py)."""

    TYPE: ClassVar[str] = "validation.hop_evidence_request"
    session_id: str = Field(min_length=1, max_length=64)
    validator_id: str = Field(min_length=1, max_length=64)
    start: int = Field(default=0, ge=0)  # first position of the page
    max_rows: int = Field(default=4096, ge=1, le=65536)


class HopEvidence(BusMessage):
    """Node -> validator (its inbox only): one page of a session's rows on that hop, float32
    little-endian, base64: `inbound` the rows it received (none on a head), `outbound` the rows
    it sent (none on a tail), positions [start, start + rows in the page)."""

    TYPE: ClassVar[str] = "validation.hop_evidence"
    session_id: str
    node_id: str
    found: bool
    reason: str = ""
    route_id: str = ""
    hop_index: int = Field(default=0, ge=0)
    layer_start: int = Field(default=0, ge=0)
    layer_end: int = Field(default=0, ge=0)
    width: int = Field(default=0, ge=0)
    kept: int = Field(default=0, ge=0)  # a Kept Hop: rows below this came from the session it continued
    start: int = Field(default=0, ge=0)
    inbound_length: int = Field(default=0, ge=0)  # positions logged in all
    outbound_length: int = Field(default=0, ge=0)
    inbound: str = ""
    outbound: str = ""
