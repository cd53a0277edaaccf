"""NodeRuntime: one loaded shard with its session table, HTTP settings and (optional) bus."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from bus.client import Bus
from nodes.drafters import Drafter, PromptLookup
from nodes.server.engine_turns import EngineTurns
from nodes.server.hop_evidence import DEFAULT_BUDGET_MB, EvidenceShelf
from nodes.server.runner import EngineRunner
from nodes.server.scheduler import MIXED_PREFILL_ROWS, PREFILL_SLICE_S, HopScheduler
from nodes.server.session import HopConfig
from nodes.server.table import KEEP_S, SessionTable
from schemas.credentials import new_frame_key
from schemas.frames import DEFAULT_VERIFY_DEPTH, DEFAULT_WINDOW, Compression, WireDtype

DEFAULT_LEASE_S = 600.0


@dataclass(slots=True)
class NodeOptions:
    """How a node serves frames and sessions (from `meshnet node` flags)."""

    node_id: str
    window: int = DEFAULT_WINDOW
    wire_dtype: WireDtype = "f32"
    compression: Compression = "none"
    max_sessions: int | None = None  # at most this many sessions (default: what the KV memory holds)
    mixed_prefill_rows: int = MIXED_PREFILL_ROWS  # prefill rows in a batch that carries decode rows
    prefill_slice_s: float | None = PREFILL_SLICE_S  # longest batch of prefill rows only (None: no bound)
    lease_s: float = DEFAULT_LEASE_S  # idle sessions are expired after this
    grace_s: float = 5.0  # how long a frame waits for its session's open directive (a busy node reads the bus late)
    reap_interval_s: float = 5.0
    keep_s: float = KEEP_S  # a session that lost another hop keeps its KV this long for a restart (0: never)
    heartbeat_s: float = 1.0
    announce_s: float = 10.0
    test_delay_s: float = 0.0
    evidence_mb: int = DEFAULT_BUDGET_MB  # Hop Evidence kept for the validator (0: none)
    stats_token: str = ""  # shows per-session rows on GET /v1/sessions ("": nobody sees them)
    verify_depth: int = DEFAULT_VERIFY_DEPTH  # a head's verify steps of one run in flight (pipelined)


class NodeRuntime:
    """Everything the activation app and the bus loops share for one shard."""

    def __init__(self, runner: EngineRunner, opts: NodeOptions, *, url: str, bus: Bus | None = None,
                 drafter: Drafter | None = None, turns: EngineTurns | None = None) -> None:
        """`turns`: the composite node whose engine thread this shard shares (None: its own)."""
        self.opts = opts
        self.node_id = opts.node_id
        self.url = url
        self.bus = bus
        self.runner = runner
        engine = runner.engine
        self.capability = engine.capability()
        self.scheduler = HopScheduler(runner, mixed_prefill_rows=opts.mixed_prefill_rows,
                                      slice_s=opts.prefill_slice_s, expected=self._decoding_sessions,
                                      turns=turns)
        self.cfg = HopConfig(
            node_id=opts.node_id, runner=self.runner, scheduler=self.scheduler, hidden_size=engine.hidden_size,
            n_ctx=self.capability.n_ctx, window=opts.window, wire_dtype=opts.wire_dtype,
            compression=opts.compression, test_delay_s=opts.test_delay_s, frame_key=new_frame_key(),
            evidence=EvidenceShelf(opts.node_id, opts.evidence_mb << 20),
            drafter=drafter or PromptLookup(), verify_depth=opts.verify_depth,
        )
        max_sessions = self.capability.max_sessions
        if opts.max_sessions is not None:
            max_sessions = max(1, min(opts.max_sessions, max_sessions))
        self.table = SessionTable(self.cfg, self.capability, max_sessions=max_sessions,
                                  lease_s=opts.lease_s, grace_s=opts.grace_s, keep_s=opts.keep_s)
        self.presence = None
        if bus is not None:
            from nodes.server.presence import Presence

            self.presence = Presence(bus, node_id=opts.node_id, url=url, capability=self.capability,
                                     frame_key=self.cfg.frame_key, evidence=self.cfg.evidence,
                                     table=self.table, runner=self.runner,
                                     heartbeat_s=opts.heartbeat_s, announce_s=opts.announce_s,
                                     window=opts.window)

    def _decoding_sessions(self) -> int:
        """Sessions whose decode steps run through this hop now (a Decode Run or a lane)."""
        return sum(1 for hs in self.table.live.values() if hs.life.phase.holds_steps)

    def background(self) -> list[Callable[[object], AsyncIterator[None]]]:
        """Cleanup contexts for the app: the bus loops when a bus is attached."""
        return [self.presence.tasks()] if self.presence is not None else []
