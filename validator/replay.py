"""Run a sampled session again: on a route of other nodes, or on a whole-model reference.

Both start from the gateway's ReplayRecord (prompt ids, output ids, the tail's logprobs and
the seeded sampling). A route replay generates freely with the same sampling (the tail's draw
depends only on seed and position) and is compared token by token. A reference replay is fed
the original's own tokens (teacher-forced), so one early near-tie cannot hide the rest, and
also records which token the reference itself would have chosen at each position.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import numpy as np

from bus.client import Bus
from gateway.errors import ApiError
from gateway.route_client import RouteClient, chunk_size_for_hops, plan_chunks
from gateway.routing import Router
from gateway.session_ids import new_session_id
from nodes.engine import ShardEngine
from nodes.engine_factory import load_engine
from schemas.route import RoutePolicy, RouteRequest, RouteSession
from schemas.sampling import SamplingParams
from schemas.validation import ReplayRecord
from validator.compare import ForcedStep, Run
from validator.forced import ForcedScorer
from validator.hop_check import ONE_SESSION_KV, RangeEngines

log = logging.getLogger("meshnet.validator.replay")

NO_CAPACITY_WAIT_S = 10.0  # a replay waits this long for a disjoint route with room


def replay_sampling(sampling: SamplingParams) -> SamplingParams:
    """The original's sampling as the tail ran it (logprobs asked): a replay route must look
    like any other session to its nodes, so it asks for nothing more (no alternatives)."""
    return sampling.model_copy(update={"logprobs": True})


class NoDisjointRoute(Exception):
    """The tracker has no route that avoids every node of the original."""


@dataclass(slots=True)
class RouteReplay:
    run: Run
    session: RouteSession


async def replay_on_route(bus: Bus, http: aiohttp.ClientSession, record: ReplayRecord, *, model: str,
                          exclude: list[str], route_timeout: float = 5.0) -> RouteReplay:
    """Generate the record's output again on a route with none of `exclude`; raises
    NoDisjointRoute when the tracker has none (after waiting NO_CAPACITY_WAIT_S for room)."""
    router = Router(bus, timeout=route_timeout)
    request = RouteRequest(model=model, session_id=new_session_id(),  # like any gateway session's
                           sampling=replay_sampling(record.sampling), prompt_tokens=len(record.prompt_ids),
                           policy=RoutePolicy(exclude_nodes=sorted(exclude)))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + NO_CAPACITY_WAIT_S
    while True:
        try:
            session = await router.create(request)
            break
        except ApiError as exc:
            code = getattr(exc, "route_code", exc.code)
            if code == "no_capacity" and loop.time() < deadline:
                await asyncio.sleep(0.5)
                continue
            raise NoDisjointRoute(f"{code}: {exc.message}") from exc
    n = len(record.output_ids)
    ids: list[int] = []
    lps: list[float | None] = []
    top: list[list[tuple[int, float]]] = []
    async with RouteClient(session, http, chunk_size=route_chunk_size(record), bus=bus) as rc:
        first = await rc.prefill(record.prompt_ids)
        results = [first]
        if n > 1:
            async for r in rc.decode_run(first.token_id, n - 1):
                results.append(r)
        for r in results[:n]:
            ids.append(r.token_id)
            lps.append(r.logprob)
            top.append(list(r.top_logprobs))
    return RouteReplay(Run(ids, lps, top), session)


class Reference:
    """A whole-model engine (llama.cpp or the PyTorch reference) that replays sessions."""

    def __init__(self, backend: str, model_path: Path, n_layer: int, *, n_ctx: int = 4096,
                 n_threads: int | None = None, kv_profile: str = "exact") -> None:
        self.backend = backend
        self.model_path = model_path
        self.kv_profile = kv_profile  # llama.cpp's: it judges only runs of hops of this profile
        opts: dict[str, object] = {"n_threads": n_threads, "n_threads_batch": n_threads} if n_threads else {}
        if backend != "torch":
            opts["kv_profile"] = kv_profile
        self.engine: ShardEngine = load_engine(backend, model_path, 0, n_layer, n_ctx=n_ctx, max_sessions=1,
                                                 kv_memory=ONE_SESSION_KV, **opts)
        self.n_ctx = n_ctx
        self.n_layer = n_layer
        # engines of single layer ranges, to check each hop of a failing route on its own rows
        # (only llama.cpp's compute like the hops, bit for bit)
        self.ranges = RangeEngines(model_path, n_layer, kv_profile=kv_profile, n_ctx=n_ctx, n_threads=n_threads) \
            if backend == "llama.cpp" else None
        self._count = 0
        self._lock = threading.Lock()  # forced() runs on a worker thread: close() waits for it
        self._closed = False

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self.engine.close()
                if self.ranges is not None:
                    self.ranges.close()

    def forced(self, record: ReplayRecord, chunk_size: int) -> tuple[list[ForcedStep], list[int]]:
        """Feed the prompt (in the route's chunks) and then each original token; per output
        position, the reference's logprob of the original's token and of its own best, and
        the token the reference's own sampler would have drawn there."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the reference engine is closed")
            return self._forced(record, chunk_size)

    def _forced(self, record: ReplayRecord, chunk_size: int) -> tuple[list[ForcedStep], list[int]]:
        self._count += 1
        sid = f"ref-{self._count}"
        sampling = record.sampling
        self.engine.open_session(sid, sampling)
        scorer = ForcedScorer(sampling, self.model_path)
        steps: list[ForcedStep] = []
        own: list[int] = []
        try:
            prompt = np.asarray(record.prompt_ids, dtype=np.int32)
            out = None
            for a, b in plan_chunks(len(prompt), chunk_size, ramp=True):
                out = self.engine.forward(sid, a, token_ids=prompt[a:b], want_logits=True)
            position = len(prompt)
            for i, token in enumerate(record.output_ids):
                assert out is not None and out.logits is not None
                step, choice = scorer.step(out.logits, token, position + i)
                steps.append(step)
                own.append(choice)
                if i + 1 < len(record.output_ids):
                    out = self.engine.forward(sid, position + i, token_ids=np.asarray([token], np.int32),
                                              want_logits=True)
        finally:
            self.engine.close_session(sid)
        return steps, own


def route_chunk_size(record: ReplayRecord) -> int:
    """The prefill chunk the original's first route used (the gateway's, else the route's default)."""
    if record.prefill_chunk_size:
        return record.prefill_chunk_size
    return chunk_size_for_hops(record.routes[0].hops if record.routes else [])
