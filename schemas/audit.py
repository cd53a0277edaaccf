"""Audit events, kept in the MESH_AUDIT JetStream stream on mesh.audit.<kind>.<publisher>.

Together they reproduce who served what: route participation (which node ran which layers of
which session), per-node work (tokens × layers), and validation records (route membership,
sampling seed, salted digests of a sampled session's prompt and output) that a verifier can
replay. Monitors read mesh.>, so no event carries prompt text or token ids in clear, nor an
unsalted digest of them (a monitor could confirm a guessed prompt or output by hashing it): a
validator checks ids it fetched from the gateway (by `output_ref`, with the session's salt)
against the digests.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import uuid
from collections.abc import Sequence
from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, Field, TypeAdapter, model_validator

from schemas.base import BusMessage
from schemas.route import Hop, Phase, RouteSession
from schemas.sampling import SamplingParams

AuditKind = Literal["route_participation", "node_work", "validation", "seed", "validation_verdict"]
SessionOutcome = Literal["completed", "failed"]


def _event_id() -> str:
    return uuid.uuid4().hex


# How a session's token ids are digested: HMAC-SHA256 keyed by the session's random salt over
# the ids packed as 4-byte little-endian unsigned ints. The one scheme events carry; a field
# names it so a reader never mistakes one digest for another.
DigestScheme = Literal["hmac-sha256-u32le"]
DIGEST_SCHEME: DigestScheme = "hmac-sha256-u32le"
DIGEST_SALT_BYTES = 32  # a salt the gateway draws per sampled session (never in an audit event)


def token_ids_digest(token_ids: Sequence[int], salt: bytes) -> str:
    """Hex digest of token ids under `salt` (DIGEST_SCHEME): without the salt nobody can
    confirm a guessed prompt or output by digesting it."""
    if len(salt) != DIGEST_SALT_BYTES:
        raise ValueError(f"a digest salt has {DIGEST_SALT_BYTES} bytes, not {len(salt)}")
    return hmac.new(salt, struct.pack(f"<{len(token_ids)}I", *token_ids), hashlib.sha256).hexdigest()


class AuditEvent(BusMessage):
    """Common fields: a unique id (JetStream de-duplicates on it), kind, and who reported it."""

    TYPE: ClassVar[str] = "audit"
    event_id: str = Field(default_factory=_event_id, min_length=8, max_length=64)
    kind: AuditKind
    source: str  # "tracker", a node_id, or "gateway"
    session_id: str
    route_id: str


class RouteParticipation(AuditEvent):
    """One hop of a route: node `node_id` ran layers [layer_start, layer_end) for this session."""

    TYPE: ClassVar[str] = "audit.route_participation"
    kind: Literal["route_participation"] = "route_participation"
    epoch: int = 1
    model: str
    model_revision: str
    cache_abi: str
    node_id: str
    layer_start: int = Field(ge=0)
    layer_end: int = Field(gt=0)
    hop_index: int = Field(ge=0)
    n_hops: int = Field(gt=0)
    n_ctx: int = Field(default=0, ge=0)  # the route's context: no hop computes more positions for it

    @classmethod
    def for_hop(cls, session: RouteSession, hop_index: int, source: str) -> RouteParticipation:
        """The participation record of hop `hop_index` of `session`, as reported by `source`."""
        hop = session.hops[hop_index]
        return cls(
            source=source, session_id=session.session_id, route_id=session.route_id,
            epoch=session.epoch, model=session.model, model_revision=session.model_revision,
            cache_abi=session.cache_abi, node_id=hop.node_id, layer_start=hop.layer_start,
            layer_end=hop.layer_end, hop_index=hop_index, n_hops=len(session.hops), n_ctx=session.n_ctx,
        )


class NodeWork(AuditEvent):
    """Work a node did for a session; work_units = (prefill_tokens + decode_tokens) × n_layers."""

    TYPE: ClassVar[str] = "audit.node_work"
    kind: Literal["node_work"] = "node_work"
    node_id: str
    model_revision: str
    layer_start: int = Field(ge=0)
    layer_end: int = Field(gt=0)
    prefill_tokens: int = Field(default=0, ge=0)
    decode_tokens: int = Field(default=0, ge=0)
    n_layers: int = Field(default=0, ge=0)  # derived from the range when 0
    work_units: int = Field(default=0, ge=0)  # derived when 0; checked when given
    active_param_bytes: int = Field(default=0, ge=0)  # weight bytes one token reads in this shard (0: not stated)

    @model_validator(mode="after")
    def _derive(self) -> NodeWork:
        span = self.layer_end - self.layer_start
        if span <= 0:
            raise ValueError(f"empty layer range [{self.layer_start}, {self.layer_end})")
        if self.n_layers == 0:
            self.n_layers = span
        elif self.n_layers != span:
            raise ValueError(f"n_layers {self.n_layers} != layer range length {span}")
        units = (self.prefill_tokens + self.decode_tokens) * self.n_layers
        if self.work_units == 0:
            self.work_units = units
        elif self.work_units != units:
            raise ValueError(f"work_units {self.work_units} != tokens × layers = {units}")
        return self


class SeedWork(AuditEvent):
    """A fetcher's receipt for one seeder: the bytes of pieces it received from `seeder` that
    verified against the manifest's hashes, and the pieces from it that did not (one event per
    seeder and fetch). The fetcher publishes it under its own id (`source`, `node_id`); a
    seeder's word about itself credits nothing. Kept apart from inference work: a ledger counts
    it in a column of its own, never as NodeWork."""

    TYPE: ClassVar[str] = "audit.seed"
    kind: Literal["seed"] = "seed"
    session_id: str = ""  # seeding belongs to no Route Session
    route_id: str = ""
    node_id: str  # the fetcher (the publisher)
    seeder: str = Field(min_length=1)  # the node credited
    artifact_id: str
    pieces: int = Field(default=0, ge=0)  # verified pieces received from the seeder
    bytes_served: int = Field(ge=0)  # bytes of those pieces the seeder sent (its seeding credit)
    corrupt_pieces: int = Field(default=0, ge=0)  # pieces from it that did not verify (refused, no credit)


class RouteTaken(BaseModel):
    """One of the routes a session ran on: the first, then each restart's."""

    session_id: str  # the Route Session id on that route (`<id>-e<epoch>` after a restart)
    route_id: str
    epoch: int = Field(ge=1)
    hops: list[Hop]
    from_token: int = Field(ge=0)  # output tokens generated before this route took over


class ValidationEvent(AuditEvent):
    """Enough to replay a session: route membership, sampling (seed), and for a sampled session
    digests of the prompt and the output token ids under the session's salt (never the ids,
    text, salt or an unsalted digest: monitors read this). A validator fetches the ids and the
    salt from the gateway by `output_ref` over an authenticated call and checks them against
    `prompt_digest` / `output_digest` (token_ids_digest) before replaying. A session not
    sampled carries no digests: nobody could ever check them."""

    TYPE: ClassVar[str] = "audit.validation"
    kind: Literal["validation"] = "validation"
    model: str
    model_revision: str
    cache_abi: str
    hops: list[Hop]
    sampling: SamplingParams
    # a sampled session's digests (token_ids_digest under its salt) and their scheme; all three
    # or none (a session not sampled)
    digest_scheme: DigestScheme | None = None
    prompt_digest: str | None = None
    output_digest: str | None = None  # of the output ids (no EOG)
    output_tokens: int = Field(default=0, ge=0)  # how many output ids were generated
    output_ref: str | None = None  # what to ask the gateway for the ids by (its session id)
    finish_reason: str | None = None
    # added for the gateway's record of a finished session (all optional, defaults keep old events valid)
    epoch: int = 1
    prompt_tokens: int = Field(default=0, ge=0)  # prompt length (the ids may be left out)
    outcome: SessionOutcome | None = None  # how the session ended
    failed_phase: Phase | None = None  # the phase a failed session was in
    failure_reason: str | None = None
    routes: list[RouteTaken] = Field(default_factory=list)  # every route, in order (one unless restarted)
    # sampled for replay validation (gateway --validate-rate, or flagged by the client): the
    # gateway keeps its ids, asked the tail for each token's logprob, and seeded it if unseeded
    sampled: bool = False
    flagged: bool = False  # the client asked for validation (x-meshnet-validate, body `validate`)

    @model_validator(mode="after")
    def _digests_together(self) -> ValidationEvent:
        given = (self.digest_scheme is not None, self.prompt_digest is not None, self.output_digest is not None)
        if any(given) and not all(given):
            raise ValueError("digest_scheme, prompt_digest and output_digest come together")
        return self


VerdictOutcome = Literal["pass", "fail", "inconclusive"]


class ValidationVerdict(AuditEvent):
    """A validator's judgement of one sampled session, replayed on a route with no node in
    common (or on a reference engine). Enough to reproduce it: route membership, sampling
    (seed), the prompt digest, both runs' output digests and where they first differ. The
    digests are under the session's salt (the gateway's, as in its ValidationEvent). The
    output ids of both runs and the salt are in the MESH_VERDICTS bucket under
    `evidence_key`, which monitors cannot read (they read this event)."""

    TYPE: ClassVar[str] = "audit.validation_verdict"
    kind: Literal["validation_verdict"] = "validation_verdict"
    validator_id: str
    validation_event_id: str  # the gateway's ValidationEvent this judges
    model: str
    model_revision: str
    sampling: SamplingParams  # as replayed (the gateway's seed included)
    # token_ids_digest under the session's salt; None / "" only in verdicts stored before digests
    # were salted (they stay readable to a tracker that reads stored verdicts back)
    digest_scheme: DigestScheme | None = None
    prompt_digest: str = ""
    prompt_tokens: int = Field(ge=0)
    original_routes: list[RouteTaken]
    replay_backend: str  # "route", or the reference engine's backend ("llama.cpp", "torch")
    replay_route_id: str = ""
    replay_nodes: list[str] = Field(default_factory=list)
    output_tokens: int = Field(ge=0)  # tokens the original produced
    compared_tokens: int = Field(ge=0)  # tokens both runs were compared over
    original_output_digest: str = ""
    replay_output_digest: str = ""  # "" when nothing was replayed
    first_diff: int | None = None  # first output position where the runs disagree
    max_logprob_diff: float | None = None  # over the agreeing positions (nats)
    tolerance: float  # |logprob difference| allowed for this backend (stated in docs/validation.md)
    outcome: VerdictOutcome
    implicated: list[str] = Field(default_factory=list)  # nodes this verdict blames
    # what the blame rests on: "hop_evidence", each implicated node's own rows (validator/localize.py);
    # "route", a whole route (verdicts stored before blame came from evidence: quarantine ignores them)
    blame_basis: Literal["route", "hop_evidence"] = "route"
    cleared: list[str] = Field(default_factory=list)  # nodes it found computing correctly
    reason: str = ""
    evidence_key: str = ""  # MESH_VERDICTS key of both runs' output ids and the salt
    elapsed_ms: float = Field(default=0.0, ge=0.0)


AnyAuditEvent = Annotated[
    RouteParticipation | NodeWork | ValidationEvent, Field(discriminator="kind")
]
AUDIT_EVENT_ADAPTER: TypeAdapter[RouteParticipation | NodeWork | ValidationEvent] = TypeAdapter(
    AnyAuditEvent
)
AUDIT_TYPES: dict[str, type[AuditEvent]] = {
    "route_participation": RouteParticipation,
    "node_work": NodeWork,
    "validation": ValidationEvent,
    "validation_verdict": ValidationVerdict,
}
