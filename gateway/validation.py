"""The validation AuditEvent the gateway records for each finished Route Session (pure)."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Sequence

from schemas.audit import (
    DIGEST_SALT_BYTES,
    DIGEST_SCHEME,
    RouteTaken,
    ValidationEvent,
    token_ids_digest,
)
from schemas.route import Phase, RouteSession
from schemas.sampling import SamplingParams

SOURCE = "gateway"


def validation_event(
    session: RouteSession,
    *,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    finish_reason: str | None,
    failed_phase: Phase | None = None,
    failure_reason: str | None = None,
    routes: Sequence[tuple[RouteSession, int]] = (),
    digest_salt: bytes | None = None,
    flagged: bool = False,
) -> ValidationEvent:
    """Route membership, sampling, prompt and output lengths of one ended session, and for a
    sampled one the digests of its prompt and output ids.

    `digest_salt`: given for a session sampled for replay validation, whose ids and salt the
    gateway keeps for the validator (gateway/replay_vault.py); the event is then `sampled` and
    records the ids as their digests under the salt (schemas.audit.token_ids_digest). A
    session without one records no digests. Never text, ids, the salt or an unsalted digest:
    monitors read audit events. The output's reference is the session id, under which a
    validator asks the gateway (over an authenticated call) for the ids. A session with a
    `failed_phase` is recorded as failed, any other as completed.
    `routes`: every route it ran on with the output tokens generated before each (a restart's
    work is then paid to the nodes that did it); by default the session's one route."""
    failed = failed_phase is not None
    sampled = digest_salt is not None
    return ValidationEvent(
        source=SOURCE,
        session_id=session.session_id,
        route_id=session.route_id,
        epoch=session.epoch,
        model=session.model,
        model_revision=session.model_revision,
        cache_abi=session.cache_abi,
        hops=list(session.hops),
        sampling=session.sampling,
        prompt_tokens=len(prompt_ids),
        digest_scheme=DIGEST_SCHEME if sampled else None,
        prompt_digest=token_ids_digest(prompt_ids, digest_salt) if digest_salt is not None else None,
        output_digest=token_ids_digest(output_ids, digest_salt) if digest_salt is not None else None,
        output_tokens=len(output_ids),
        output_ref=session.session_id,
        finish_reason=None if failed else finish_reason,
        outcome="failed" if failed else "completed",
        failed_phase=failed_phase,
        failure_reason=failure_reason if failed else None,
        routes=routes_taken(routes or [(session, 0)]),
        sampled=sampled,
        flagged=flagged,
    )


def routes_taken(routes: Sequence[tuple[RouteSession, int]]) -> list[RouteTaken]:
    """Each route a session ran on, with the output tokens generated before it took over."""
    return [RouteTaken(session_id=s.session_id, route_id=s.route_id, epoch=s.epoch, hops=list(s.hops),
                       from_token=start) for s, start in routes]


def in_sample(session_id: str, rate: float, key: bytes) -> bool:
    """Whether a session is sampled for replay validation at `rate` (pure): the first 8 bytes
    of HMAC-SHA256(key, session id) as a fraction of 2**64, below the rate. The key is the
    gateway's own secret (SAMPLING_KEY: fresh each start), so a node that sees session ids
    in route directives cannot tell which sessions will be replayed."""
    if rate <= 0.0:
        return False
    if rate >= 1.0:
        return True
    mac = hmac.new(key, session_id.encode(), hashlib.sha256).digest()
    return int.from_bytes(mac[:8], "big") < rate * 2**64


SAMPLING_KEY = secrets.token_bytes(32)  # this gateway's sampling secret (never published)


def new_digest_salt() -> bytes:
    """A fresh random salt for one sampled session's digests (kept with its ReplayRecord only)."""
    return secrets.token_bytes(DIGEST_SALT_BYTES)


def replayable_sampling(sampling: SamplingParams, seed: int) -> SamplingParams:
    """The sampling a validated session runs with (pure): the tail also gives each token's
    logprob, and a sampled (temperature > 0) session without a seed gets `seed`, so a replay
    can draw the same tokens (the tail's draw depends only on seed and position). Neither
    changes what the client receives or the distribution it samples from."""
    update: dict[str, object] = {"logprobs": True}
    if not sampling.greedy and sampling.seed is None:
        update["seed"] = seed
    return sampling.model_copy(update=update)
