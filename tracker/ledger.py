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
  never into inference: a node that only seeds earns no inference credit.
- **Exactly once.** `apply` takes events in stream order with their sequence number. A sequence at
  or below `last_seq` is skipped (a redelivery after a restart), and so is an event id seen
  among the last RECENT_IDS (a publisher's retry stored twice).
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from bus import subjects
from schemas.audit import NodeWork, SeedWork
from schemas.ledger import LedgerState

RECENT_IDS = 5_000  # event ids kept against a publisher's retry stored twice (the stream dedupes 2 min)


def apply_event(state: LedgerState, seq: int, event: dict[str, Any], subject: str = "") -> bool:
    """Count one stored audit event; False when it was already counted or counts nothing.
    Never raises: an event that does not validate, or whose body disagrees with the subject
    it was stored under, is skipped (and counted in `state.invalid`)."""
    if seq <= state.last_seq:
        state.duplicates += 1
        return False
    state.last_seq = seq
    kind = event.get("kind")
    if kind not in ("node_work", "seed"):
        return False
    try:
        msg = (NodeWork if kind == "node_work" else SeedWork).model_validate(event)
    except ValidationError:
        state.invalid += 1
        return False
    # only a node's own report of its own work counts: nats.conf lets it publish only under
    # its own id, and the body must name the same node
    if msg.source != msg.node_id or (subject and subject != f"{subjects.PREFIX}.audit.{kind}.node.{msg.node_id}"):
        state.invalid += 1
        return False
    eid = msg.event_id
    if state.seen(eid):
        state.duplicates += 1
        return False
    node_id = msg.node_id
    state.remember(eid, RECENT_IDS)
    acc = state.account(node_id)
    state.events += 1
    if isinstance(msg, SeedWork):
        acc.seed_bytes += msg.bytes_served
        acc.seed_pieces += msg.pieces
        return True
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
