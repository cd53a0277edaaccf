"""Check each hop of a failing route on its own evidence: fetch its rows, recompute its layers.

For every hop of the route that made the first bad token, the validator asks the node for its
Hop Evidence (nodes/server/hop_evidence.py): the rows it received and the rows it sent, by
position. It runs the hop's layer range on its own engine of that range (llama.cpp, the hop's
KV profile) over the hop's inputs, fed as the route fed them (the prompt in the gateway's chunks,
then one row per decode step), and compares:
- a head or middle hop: the rows it computes with the rows the hop sent (validator/localize.py);
- the tail: the logprob of each token the gateway recorded with the one it computes.
A head's inputs are the session's token ids, which the validator has from the gateway.
validator/localize.py turns the checks into blame.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bus import subjects
from bus.client import Bus
from bus.errors import BusError
from gateway.route_client import plan_chunks
from nodes.engine import ShardEngine, ShardOutput
from nodes.engine_factory import load_engine
from schemas.audit import RouteTaken
from schemas.base import SchemaError
from schemas.validation import HopEvidence, HopEvidenceRequest, ReplayRecord
from validator.compare import EXACT_TOLERANCE, Run, score_forced
from validator.forced import ForcedScorer
from validator.localize import (
    ROW_TOLERANCE,
    SEAM_TOLERANCE,
    HopCheck,
    SeamCheck,
    first_beyond,
    row_errors,
)

log = logging.getLogger("meshnet.validator.hop_check")
# a reference engine holds one session of the validator's --ctx whatever that costs: no node's
# --kv-memory budget applies to it (the engines refuse a session beyond their budget)
ONE_SESSION_KV = 1 << 62

MAX_PAGES = 4096


@dataclass(slots=True)
class HopRows:
    """A hop's evidence of one session: rows in (None on a head) and out (None on a tail)."""

    node_id: str
    kept: int
    inbound: np.ndarray | None
    outbound: np.ndarray | None


def _rows(b64: str, width: int) -> np.ndarray:
    raw = base64.b64decode(b64) if b64 else b""
    if width <= 0 or len(raw) % (4 * width):
        raise ValueError(f"rows of {len(raw)} bytes are not a whole number of rows of width {width}")
    return np.frombuffer(raw, dtype="<f4").reshape(-1, width)


async def fetch_hop_rows(bus: Bus, node_id: str, session_id: str, validator_id: str, *,
                         timeout: float = 3.0) -> HopRows | str:
    """A node's evidence of a session, page by page; a string says why there is none."""
    inbound: list[np.ndarray] = []
    outbound: list[np.ndarray] = []
    start, kept = 0, 0
    for _ in range(MAX_PAGES):
        try:
            page = await bus.request(subjects.node_evidence(node_id), HopEvidenceRequest(
                session_id=session_id, validator_id=validator_id, start=start), HopEvidence, timeout=timeout)
        except (BusError, SchemaError) as exc:
            return f"{node_id} gave no evidence ({type(exc).__name__}: {exc})"
        if not page.found:
            return f"{node_id}: {page.reason}"
        if page.start != start or page.node_id != node_id:
            return f"{node_id} answered for another page or node"
        try:
            rin, rout = _rows(page.inbound, page.width), _rows(page.outbound, page.width)
        except ValueError as exc:
            return f"{node_id} sent malformed rows ({exc})"
        kept = page.kept
        inbound.append(rin)
        outbound.append(rout)
        got = max(len(rin), len(rout))
        start += got
        if got == 0 or start >= max(page.inbound_length, page.outbound_length):
            cat = lambda parts, n: np.concatenate(parts) if n else None  # noqa: E731
            return HopRows(node_id, kept, cat(inbound, page.inbound_length), cat(outbound, page.outbound_length))
    return f"{node_id} sent more than {MAX_PAGES} pages"


class RangeEngines:
    """The validator's engines of single layer ranges (llama.cpp), loaded when first needed."""

    def __init__(self, model_path: Path, n_layer: int, *, kv_profile: str = "exact", n_ctx: int = 4096,
                 n_threads: int | None = None) -> None:
        self.model_path = model_path
        self.n_layer = n_layer
        self.kv_profile = kv_profile
        self.n_ctx = n_ctx
        self.n_threads = n_threads
        self._engines: dict[tuple[int, int], ShardEngine] = {}
        self._lock = threading.Lock()  # recomputations run on a worker thread, one at a time
        self._count = 0

    def close(self) -> None:
        with self._lock:
            for engine in self._engines.values():
                engine.close()
            self._engines.clear()

    def _engine(self, start: int, end: int) -> ShardEngine:
        key = (start, end)
        if key not in self._engines:
            opts: dict[str, object] = {"n_threads": self.n_threads, "n_threads_batch": self.n_threads} \
                if self.n_threads else {}
            self._engines[key] = load_engine("llama.cpp", self.model_path, start, end, n_ctx=self.n_ctx,
                                             max_sessions=1, kv_memory=ONE_SESSION_KV, kv_profile=self.kv_profile,
                                             **opts)
        return self._engines[key]

    def run(self, start: int, end: int, inputs: np.ndarray, n_prompt: int,
            chunk_size: int) -> tuple[np.ndarray | None, list[np.ndarray]]:
        """Layers [start, end) over `inputs` (token ids, or rows), fed as a route feeds them: the
        first `n_prompt` positions in the prompt's chunks, then one position per step. Returns the
        output rows (None for a tail range) and, for a tail range, the logits of the prompt's
        last position and of every later one."""
        with self._lock:
            engine = self._engine(start, end)
            self._count += 1
            sid = f"hop-check-{self._count}"
            engine.open_session(sid)
            tail = end == self.n_layer
            hidden: list[np.ndarray] = []
            logits: list[np.ndarray] = []
            try:
                n = len(inputs)
                spans = [(a, min(b, n)) for a, b in plan_chunks(n_prompt, chunk_size, ramp=True) if a < n]
                for a, b in [*spans, *((p, p + 1) for p in range(n_prompt, n))]:
                    out = self._forward(engine, sid, a, inputs[a:b], want_logits=tail and b >= n_prompt)
                    if out.hidden is not None:
                        hidden.append(out.hidden.copy())
                    if out.logits is not None:
                        logits.append(out.logits.copy())
            finally:
                engine.close_session(sid)
            return (np.concatenate(hidden) if hidden else None), logits

    @staticmethod
    def _forward(engine: ShardEngine, sid: str, position: int, rows: np.ndarray, *, want_logits: bool) -> ShardOutput:
        if rows.ndim == 1:  # a head's inputs: token ids
            return engine.forward(sid, position, token_ids=rows.astype(np.int32), want_logits=want_logits)
        return engine.forward(sid, position, hidden=np.ascontiguousarray(rows, dtype=np.float32),
                              want_logits=want_logits)


def check_hop(engines: RangeEngines, route: RouteTaken, index: int, rows: HopRows | str, record: ReplayRecord,
              chunk_size: int) -> HopCheck:
    """One hop's own computation against its evidence (blocking: run it on a worker thread)."""
    hop = route.hops[index]
    if isinstance(rows, str):
        return HopCheck(hop.node_id, index, "unproven", rows)
    if rows.kept:
        return HopCheck(hop.node_id, index, "unproven", f"a Kept Hop: rows below {rows.kept} came from an earlier "
                                                          "session's computation")
    n_prompt = len(record.prompt_ids)
    tail = index == len(route.hops) - 1
    if index == 0:
        inputs = np.asarray([*record.prompt_ids, *record.output_ids], dtype=np.int32)
        if rows.outbound is not None:
            inputs = inputs[:len(rows.outbound)]
    else:
        inputs = rows.inbound if rows.inbound is not None else np.zeros((0, 1), np.float32)
    if len(inputs) < n_prompt:
        return HopCheck(hop.node_id, index, "unproven", f"it kept {len(inputs)} input rows of a {n_prompt}-token prompt")
    if tail:
        return _check_tail(engines, hop.node_id, index, hop.layer_start, inputs, record, chunk_size)
    assert rows.outbound is not None
    computed, _ = engines.run(hop.layer_start, hop.layer_end, inputs, n_prompt, chunk_size)
    sent = rows.outbound[:len(inputs)]
    if computed is None or len(computed) < len(sent):
        return HopCheck(hop.node_id, index, "unproven", "the recomputation gave fewer rows than it sent")
    errors = row_errors(sent, computed[:len(sent)])
    bad = first_beyond(errors, ROW_TOLERANCE)
    if bad is not None:
        return HopCheck(hop.node_id, index, "wrong", f"position {bad} of {len(sent)}: rows {errors[bad]:.2e} "
                                                     f"off their recomputation (tolerance {ROW_TOLERANCE:g})")
    return HopCheck(hop.node_id, index, "right", f"{len(sent)} rows within {float(errors.max()):.1e}")


def _check_tail(engines: RangeEngines, node_id: str, index: int, start: int, inputs: np.ndarray,
                record: ReplayRecord, chunk_size: int) -> HopCheck:
    n_prompt = len(record.prompt_ids)
    _, logits = engines.run(start, engines.n_layer, inputs, n_prompt, chunk_size)
    scorer = ForcedScorer(record.sampling, engines.model_path)  # judged on the row the tail chose from
    steps = [scorer.step(lg, token, n_prompt + i)[0]
             for i, (token, lg) in enumerate(zip(record.output_ids, logits, strict=False))]
    cmp = score_forced(Run(record.output_ids[:len(steps)], record.output_logprobs[:len(steps)]), steps,
                       greedy=record.sampling.greedy, tolerance=EXACT_TOLERANCE)
    if cmp.outcome == "fail":
        return HopCheck(node_id, index, "wrong", f"its tokens are not what its layers give for its inputs: {cmp.why}")
    if cmp.outcome == "inconclusive":
        return HopCheck(node_id, index, "unproven", "it kept no rows of the decode steps")
    return HopCheck(node_id, index, "right", cmp.why)


def check_seam(s: str, r: str, sender: HopRows | str, receiver: HopRows | str) -> SeamCheck:
    """Whether what hop `s` sent is what the next hop `r` received (pure)."""
    if not isinstance(sender, HopRows) or not isinstance(receiver, HopRows) \
            or sender.outbound is None or receiver.inbound is None:
        return SeamCheck(s, r, None, "one side kept no rows")
    n = min(len(sender.outbound), len(receiver.inbound))
    if n == 0:
        return SeamCheck(s, r, None, "no rows in common")
    errors = row_errors(receiver.inbound[:n], sender.outbound[:n])
    bad = first_beyond(errors, SEAM_TOLERANCE)
    if bad is not None:
        return SeamCheck(s, r, False, f"position {bad}: {errors[bad]:.2e} apart")
    return SeamCheck(s, r, True, f"{n} rows within {float(errors.max()):.1e}")


async def check_route(bus: Bus, engines: RangeEngines, route: RouteTaken, record: ReplayRecord, chunk_size: int,
                      validator_id: str) -> tuple[list[HopCheck], list[SeamCheck]]:
    """Every hop of `route` on its evidence of the route's session, and every seam."""
    evidence = [await fetch_hop_rows(bus, h.node_id, route.session_id, validator_id) for h in route.hops]
    hops = []
    for i, rows in enumerate(evidence):
        hops.append(await asyncio.to_thread(check_hop, engines, route, i, rows, record, chunk_size))
    names = [h.node_id for h in route.hops]
    seams = [check_seam(names[i], names[i + 1], evidence[i], evidence[i + 1]) for i in range(len(names) - 1)]
    return hops, seams
