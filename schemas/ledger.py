"""The Work Ledger's stored state: per node, inference work and seeding bytes (tracker/ledger.py
fills it from the audit stream; it is one JSON value in the MESH_LEDGER key-value bucket).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from pydantic import TypeAdapter

LEDGER_BUCKET = "MESH_LEDGER"
LEDGER_KEY = "ledger"
LEDGER_VERSION = 1


@dataclass
class NodeAccount:
    """One node's earnings. A plain dataclass, as is LedgerState: the ledger folds tens of
    thousands of events a second into them (bench/ledger.py), and a pydantic model's attribute
    writes cost more than the rest of the fold; the stored JSON is checked on load instead."""

    node_id: str
    sessions: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    prefill_layer_tokens: int = 0
    decode_layer_tokens: int = 0
    prefill_work: float = 0.0  # GB of active parameters × tokens
    decode_work: float = 0.0
    unweighted_tokens: int = 0  # tokens whose shard did not state its parameter bytes
    refused_claims: int = 0  # its work reports that no tracker vouched for, or claiming more than the route's
    # context or the gateway's count of the session's tokens allows, and its reports of its own seeding
    seed_bytes: int = 0  # bytes of verified pieces its fetchers received from it
    seed_pieces: int = 0
    seed_corrupt_pieces: int = 0  # pieces it sent that did not verify (credited nothing)

    @property
    def inference_work(self) -> float:
        return self.prefill_work + self.decode_work

    def model_dump(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class LedgerState:
    """Everything the ledger keeps (stored as one JSON value in its key-value bucket)."""

    version: int = LEDGER_VERSION
    last_seq: int = 0
    events: int = 0  # events counted
    duplicates: int = 0  # events skipped as already counted
    invalid: int = 0  # node_work/seed events that did not validate or disagreed with their subject
    refused: int = 0  # claims refused: node_work nobody vouched for or beyond its counts, a seeder's own seed report
    nodes: dict[str, NodeAccount] = field(default_factory=dict)
    recent_ids: list[str] = field(default_factory=list)
    # "route_id|node_id" -> [session_id, layer_start, layer_end, n_ctx]: the hops a tracker put on
    # routes and whose work is not counted yet (oldest first, at most VOUCHED_KEPT)
    vouched: dict[str, list[Any]] = field(default_factory=dict)
    # route_id -> the gateway's count of its session's tokens (prompt + output): no hop of the
    # route is paid for more (oldest first, at most VOUCHED_KEPT)
    counted: dict[str, int] = field(default_factory=dict)
    # "route_id|node_id" -> the node_work event that came before its vouch or its count (at most UNVOUCHED_KEPT)
    unvouched: dict[str, dict[str, Any]] = field(default_factory=dict)
    # route_id -> its hop count: routes a validator replayed on (its verdicts), paid to nobody
    # (oldest first, at most tracker/ledger.py REPLAYS_KEPT)
    replays: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._recent = set(self.recent_ids)  # recent_ids as a set (not stored)

    @classmethod
    def model_validate(cls, raw: Any) -> LedgerState:
        """The stored JSON value, checked (pydantic.ValidationError when it is not a ledger)."""
        return _STATE.validate_python(raw)

    def model_dump(self, mode: str = "python") -> dict[str, Any]:
        return _STATE.dump_python(self, mode=mode)

    def seen(self, event_id: str) -> bool:
        return event_id in self._recent

    def remember(self, event_id: str, keep: int) -> None:
        self.recent_ids.append(event_id)
        self._recent.add(event_id)
        self.remember_only(keep)

    def remember_only(self, keep: int) -> None:
        """Keep the last `keep` event ids."""
        if len(self.recent_ids) > keep:
            for old in self.recent_ids[: len(self.recent_ids) - keep]:
                self._recent.discard(old)
            del self.recent_ids[: len(self.recent_ids) - keep]

    def account(self, node_id: str) -> NodeAccount:
        acc = self.nodes.get(node_id)
        if acc is None:
            acc = self.nodes[node_id] = NodeAccount(node_id=node_id)
        return acc


_STATE: TypeAdapter[LedgerState] = TypeAdapter(LedgerState)


def ledger_view(state: LedgerState) -> dict[str, Any]:
    """What `meshnet ledger --json` and `GET /v1/ledger` show."""
    nodes = sorted(state.nodes.values(), key=lambda a: (-a.inference_work, -a.seed_bytes, a.node_id))
    return {
        "version": state.version, "last_seq": state.last_seq, "events": state.events,
        "duplicates_skipped": state.duplicates, "invalid_skipped": state.invalid, "refused_claims": state.refused,
        "unvouched_claims": len(state.unvouched),
        "units": {"work": "GB of active parameters per token x tokens", "seed": "bytes of verified pieces fetchers received"},
        "nodes": [{**a.model_dump(), "prefill_work": round(a.prefill_work, 6), "decode_work": round(a.decode_work, 6)}
                  for a in nodes],
    }
