"""The validation AuditEvent the gateway records for each finished Route Session (pure)."""

from __future__ import annotations

from collections.abc import Sequence

from schemas.audit import RouteTaken, ValidationEvent, token_ids_sha256
from schemas.route import Phase, RouteSession

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
) -> ValidationEvent:
    """Route membership, sampling, prompt digest and observed output of one ended session.

    The prompt and the output are recorded as their lengths and sha256 digests
    (schemas.audit.token_ids_sha256), never as text or ids: monitors read audit events. The
    output's reference is the session id, under which a validator asks the gateway (over an
    authenticated call) for the ids. A session with a `failed_phase` is recorded as failed,
    any other as completed.
    `routes`: every route it ran on with the output tokens generated before each (a restart's
    work is then paid to the nodes that did it); by default the session's one route."""
    failed = failed_phase is not None
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
        prompt_sha256=token_ids_sha256(prompt_ids),
        output_sha256=token_ids_sha256(output_ids),
        output_tokens=len(output_ids),
        output_ref=session.session_id,
        finish_reason=None if failed else finish_reason,
        outcome="failed" if failed else "completed",
        failed_phase=failed_phase,
        failure_reason=failure_reason if failed else None,
        routes=[RouteTaken(session_id=s.session_id, route_id=s.route_id, epoch=s.epoch, hops=list(s.hops),
                           from_token=start) for s, start in (routes or [(session, 0)])],
    )
