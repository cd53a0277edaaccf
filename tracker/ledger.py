"""The Work Ledger (pure): what each node earned, from the audit stream's events, each counted once.

- **Inference.** Per node, prefill and decode are kept apart:
  - `*_tokens`: tokens the node's hop computed;
  - `*_layer_tokens`: tokens × the shard's layers;
  - `*_work`: tokens × the shard's active parameter bytes per token, in GB (`node_work.active_param_bytes`).
  So a heavier shard earns more than a light one, and a MoE shard earns for the experts a
  token uses, not for all of them.
  A hop reports the work it really did when its session ends, however it ends (closed,
  failed, restarted elsewhere), so a failed route is paid for what it computed and no more.
- **Seeding.** Bytes served to peers go in columns of their own (`seed_bytes`, `seed_pieces`),
  never into inference: a node that only seeds earns no inference credit. Only a fetcher's
  receipt credits a seeder: the bytes of its pieces that verified there. Its pieces that did not
  are counted against it (`seed_corrupt_pieces`), and a seeder's report about itself is refused.
- **Only vouched work.** A node's report of its own work counts only where others vouch for
  it: a tracker, with its route participation event for that route, that node, that layer
  range and that session; and the gateway that drove the session, with its `validation` event
  counting the session's prompt and output tokens (no hop of a route computes more rows than
  those). Each participation pays once. They may come in any order in the stream: a claim
  missing either waits (at most UNVOUCHED_KEPT of them, the oldest dropped as refused). A claim
  that disagrees with them (another range; more tokens than the route's context or than the
  gateway counted) is refused and counted against the node (`refused_claims`); one for a
  session no tracker opened or no gateway drove is never paid; those of a route a validator
  replayed on are dropped when its verdict (or the claim, after it) comes.
- **Exactly once.** `apply` takes events in stream order with their sequence number. A sequence at
  or below `last_seq` is skipped (a redelivery after a restart), and so is an event id seen
  among the last RECENT_IDS (a publisher's retry stored twice).
"""

from __future__ import annotations

from typing import Any

import orjson
from pydantic import ValidationError

from bus import subjects
from schemas.audit import NodeWork, RouteParticipation, SeedWork, ValidationEvent, ValidationVerdict
from schemas.ledger import LedgerState

RECENT_IDS = 5_000  # event ids kept against a publisher's retry stored twice (the stream dedupes 2 min)
VOUCHED_KEPT = 100_000  # route hops vouched for and not yet paid, kept (the oldest go first)
UNVOUCHED_KEPT = 10_000  # claims waiting for their vouch, kept (the oldest are refused)
# the stored value (one JSON value in the bucket) stays this small: NATS refuses a value past its
# max_payload (1 MB in nats.conf), and the ledger then stopped for good (ledger_service retried
# the same write every second); a session adds a route count that is kept after it is paid
STORED_MAX_BYTES = 768 * 1024
TRIM_SHARE = 0.25  # the oldest share of each record dropped per step while the value is too big
REPLAYS_KEPT = 1_000  # validator replay routes remembered, so a claim stored after the verdict is dropped too
TRACKER_PARTICIPATION = f"{subjects.PREFIX}.audit.route_participation.tracker"
GATEWAY_VALIDATION = f"{subjects.PREFIX}.audit.validation.gateway"
VALIDATOR_VERDICT = f"{subjects.PREFIX}.audit.{subjects.VERDICT_KIND}.validator"


def stored_value(state: LedgerState, max_bytes: int = STORED_MAX_BYTES) -> dict[str, Any]:
    """The state as the JSON value to store, its oldest records trimmed (`trim_oldest`) until it
    is at most `max_bytes`."""
    value = state.model_dump(mode="json")
    while len(orjson.dumps(value)) > max_bytes and trim_oldest(state, TRIM_SHARE):
        value = state.model_dump(mode="json")
    return value


def trim_oldest(state: LedgerState, share: float) -> bool:
    """Drop the oldest `share` of the first records the ledger keeps only for a while that have
    any (False when none has): route counts (their claims came long ago), vouches no claim
    followed (a killed node's hops) and replay routes; only then waiting claims, refused as
    when they pass UNVOUCHED_KEPT; last, event ids kept against a retry. Totals stay."""
    cheap = [r for r in (state.counted, state.vouched, state.replays) if r]
    for record in cheap:
        for key in list(record)[:_oldest(len(record), share)]:
            del record[key]
    if cheap:
        return True
    if state.unvouched:
        for key in list(state.unvouched)[:_oldest(len(state.unvouched), share)]:
            _refuse(state, NodeWork.model_validate(state.unvouched.pop(key)).node_id)
        return True
    if state.recent_ids:
        state.remember_only(len(state.recent_ids) - _oldest(len(state.recent_ids), share))
        return True
    return False


def _oldest(n: int, share: float) -> int:
    return min(n, max(1, int(n * share))) if n else 0


def apply_event(state: LedgerState, seq: int, event: dict[str, Any], subject: str = "") -> bool:
    """Count one stored audit event; False when it was already counted or counts nothing.
    Never raises: an event that does not validate, or whose body disagrees with the subject
    it was stored under, is skipped (and counted in `state.invalid`)."""
    if seq <= state.last_seq:
        state.duplicates += 1
        return False
    state.last_seq = seq
    kind = event.get("kind")
    if kind == "route_participation":
        return _vouch(state, event, subject)
    if kind == "validation":
        return _count(state, event, subject)
    if kind == subjects.VERDICT_KIND:
        return _replayed(state, event, subject)
    if kind not in ("node_work", "seed"):
        return False
    try:
        msg = (NodeWork if kind == "node_work" else SeedWork).model_validate(event)
    except ValidationError:
        state.invalid += 1
        return False
    # only a node's own report counts (of its work, or of what it fetched): nats.conf lets it
    # publish only under its own id, and the body must name the same node
    if msg.source != msg.node_id or (subject and subject != f"{subjects.PREFIX}.audit.{kind}.node.{msg.node_id}"):
        state.invalid += 1
        return False
    eid = msg.event_id
    if state.seen(eid):
        state.duplicates += 1
        return False
    state.remember(eid, RECENT_IDS)
    if isinstance(msg, SeedWork):
        return _seed(state, msg)
    state.account(msg.node_id)
    if msg.route_id in state.replays:  # a validator's replay: driven by no gateway, never paid
        state.vouched.pop(f"{msg.route_id}|{msg.node_id}", None)
        return False
    return _claim(state, msg)


def _seed(state: LedgerState, msg: SeedWork) -> bool:
    """Credit a seeder with what its fetcher verified; refuse a seeder's word about itself."""
    if msg.seeder == msg.node_id:
        _refuse(state, msg.seeder)
        return False
    acc = state.account(msg.seeder)
    state.events += 1
    acc.seed_bytes += msg.bytes_served
    acc.seed_pieces += msg.pieces
    acc.seed_corrupt_pieces += msg.corrupt_pieces
    return True


def _credit(state: LedgerState, msg: NodeWork) -> bool:
    """Count a vouched node_work."""
    acc = state.account(msg.node_id)
    state.events += 1
    prefill, decode = msg.prefill_tokens, msg.decode_tokens
    layers = msg.layer_end - msg.layer_start
    active = msg.active_param_bytes
    acc.sessions += 1
    acc.prefill_tokens += prefill
    acc.decode_tokens += decode
    acc.prefill_layer_tokens += prefill * layers
    acc.decode_layer_tokens += decode * layers
    if active > 0:
        acc.prefill_work += prefill * active / 1e9
        acc.decode_work += decode * active / 1e9
    else:
        acc.unweighted_tokens += prefill + decode
    return True


def _vouch(state: LedgerState, event: dict[str, Any], subject: str) -> bool:
    """A tracker's route participation: that hop's work will be paid once (counts nothing now)."""
    if subject and subject != TRACKER_PARTICIPATION:
        return False  # a node's own participation report vouches for nothing
    try:
        p = RouteParticipation.model_validate(event)
    except ValidationError:
        state.invalid += 1
        return False
    key = f"{p.route_id}|{p.node_id}"
    state.vouched[key] = [p.session_id, p.layer_start, p.layer_end, p.n_ctx]
    while len(state.vouched) > VOUCHED_KEPT:
        del state.vouched[next(iter(state.vouched))]
    return _retry(state, key)


def _replayed(state: LedgerState, event: dict[str, Any], subject: str) -> bool:
    """A validator's verdict names the route it replayed on: no gateway drove that route, so
    its hops' claims would wait for a count that never comes, filling the stored state (one
    value in the bucket) until the oldest were refused against honest nodes. They are dropped,
    its vouches too; a claim stored after the verdict is dropped on arrival. Counts nothing."""
    if subject and subject != VALIDATOR_VERDICT:
        return False  # only the validator's word ends a route as a replay
    try:
        v = ValidationVerdict.model_validate(event)
    except ValidationError:
        state.invalid += 1
        return False
    if not v.replay_route_id:
        return False  # judged on a reference engine: no route ran
    state.replays[v.replay_route_id] = len(v.replay_nodes)
    while len(state.replays) > REPLAYS_KEPT:
        del state.replays[next(iter(state.replays))]
    for node_id in v.replay_nodes:
        state.unvouched.pop(f"{v.replay_route_id}|{node_id}", None)
        state.vouched.pop(f"{v.replay_route_id}|{node_id}", None)
    return False


def _count(state: LedgerState, event: dict[str, Any], subject: str) -> bool:
    """A gateway's record of an ended session: the tokens each of its routes' hops may be paid
    for (prompt + output: every row a hop computes is one of them). Counts nothing itself."""
    if subject and subject != GATEWAY_VALIDATION:
        return False  # anyone else's count vouches for nothing
    try:
        v = ValidationEvent.model_validate(event)
    except ValidationError:
        state.invalid += 1
        return False
    cap = v.prompt_tokens + v.output_tokens
    routes = [(r.route_id, r.hops) for r in v.routes] or [(v.route_id, v.hops)]
    paid = False
    for route_id, hops in routes:
        state.counted[route_id] = cap
        for hop in hops:
            paid |= _retry(state, f"{route_id}|{hop.node_id}")
    while len(state.counted) > VOUCHED_KEPT:
        del state.counted[next(iter(state.counted))]
    return paid


def _retry(state: LedgerState, key: str) -> bool:
    """Try the claim waiting under `key` again (a vouch or a count for it came)."""
    waiting = state.unvouched.pop(key, None)
    return _claim(state, NodeWork.model_validate(waiting)) if waiting is not None else False


def _claim(state: LedgerState, msg: NodeWork) -> bool:
    """Pay a node_work its vouch and its gateway count allow, refuse one that disagrees with
    either, keep one that lacks one."""
    key = f"{msg.route_id}|{msg.node_id}"
    v = state.vouched.get(key)
    cap = state.counted.get(msg.route_id)
    tokens = msg.prefill_tokens + msg.decode_tokens
    too_many = v is not None and bool(v[3]) and tokens > v[3]  # more than the route's context
    if (v is not None and (v[:3] != [msg.session_id, msg.layer_start, msg.layer_end] or too_many)) or (
            cap is not None and tokens > cap):  # more than the gateway counted
        _refuse(state, msg.node_id)
        return False
    if v is None or cap is None:
        state.unvouched[key] = msg.model_dump(mode="json")
        while len(state.unvouched) > UNVOUCHED_KEPT:
            old = NodeWork.model_validate(state.unvouched.pop(next(iter(state.unvouched))))
            _refuse(state, old.node_id)
        return False
    del state.vouched[key]  # a vouch pays once
    return _credit(state, msg)


def _refuse(state: LedgerState, node_id: str) -> None:
    state.refused += 1
    state.account(node_id).refused_claims += 1
