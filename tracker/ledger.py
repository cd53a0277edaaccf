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

from schemas.ledger import LedgerState

RECENT_IDS = 20_000


def apply_event(state: LedgerState, seq: int, event: dict[str, Any]) -> bool:
    """Count one stored audit event; False when it was already counted or counts nothing."""
    if seq <= state.last_seq:
        state.duplicates += 1
        return False
    state.last_seq = seq
    eid = event.get("event_id")
    if eid and eid in state.recent_ids[-RECENT_IDS:]:
        state.duplicates += 1
        return False
    kind = event.get("kind")
    node_id = event.get("node_id")
    if kind not in ("node_work", "seed") or not isinstance(node_id, str) or event.get("source") != node_id:
        return False  # only a node's own report of its own work counts (the subject binds both)
    if eid:
        state.recent_ids.append(eid)
        if len(state.recent_ids) > RECENT_IDS:
            del state.recent_ids[: len(state.recent_ids) - RECENT_IDS]
    acc = state.account(node_id)
    state.events += 1
    if kind == "seed":
        acc.seed_bytes += int(event.get("bytes_served", 0))
        acc.seed_pieces += int(event.get("pieces", 1) or 1)
        return True
    prefill, decode = int(event.get("prefill_tokens", 0)), int(event.get("decode_tokens", 0))
    layers = int(event.get("layer_end", 0)) - int(event.get("layer_start", 0))
    active = int(event.get("active_param_bytes", 0) or 0)
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
