"""The validator: replays the sessions the gateway sampled, and publishes a verdict on each.

It reads the gateway's validation events through a durable JetStream consumer (so a restart
loses none), and for each sampled, completed session:
1. asks the gateway for its ids and digest salt (mesh.gateway.replay, answered into the
   validator's inbox) and checks them against the event's digests (validator/evidence.py);
2. replays it on a route with no node in common with the original's routes, else on its
   whole-model reference engine (llama.cpp by default, or PyTorch);
3. compares (validator/compare.py), and when two routes disagree, asks the reference which
   of them is wrong;
4. stores both runs' output ids and the salt in the MESH_VERDICTS bucket (which monitors
   cannot read) and publishes a ValidationVerdict, its digests under the same salt, on
   mesh.audit.validation_verdict.validator, which the trackers' quarantine acts on.
Replays run one at a time: validation is background work and must not crowd out users.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import aiohttp

from bus import subjects
from bus.client import Bus
from bus.errors import BusError
from bus.jetstream import DurableAuditReader, KeyValueStore, StoredEvent
from schemas.audit import (
    DIGEST_SCHEME,
    RouteTaken,
    ValidationEvent,
    ValidationVerdict,
    VerdictOutcome,
    token_ids_digest,
)
from schemas.base import SchemaError
from schemas.frames import RouteFailedError
from schemas.validation import VERDICT_BUCKET, ReplayRecord, ReplayRecordRequest
from validator.compare import (
    Blame,
    Comparison,
    Run,
    comparable,
    compare_runs,
    merge,
    rebuilt_exactly,
    route_nodes,
    routes_profile,
    score_forced,
    tolerance_for,
)
from validator.evidence import evidence, record_matches
from validator.hop_check import check_route
from validator.localize import localize
from validator.replay import NoDisjointRoute, Reference, replay_on_route, route_chunk_size

log = logging.getLogger("meshnet.validator")

VALIDATOR_DURABLE = "meshnet-validator"
EVIDENCE_TTL_S = 7 * 24 * 3600.0


@dataclass(slots=True)
class ValidatorStats:
    judged: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)
    missed: int = 0  # sampled sessions whose ids no gateway held any more
    skipped: int = 0  # events that are not sampled, completed sessions with digests


@dataclass(frozen=True, slots=True)
class Judgement:
    outcome: VerdictOutcome
    blame: Blame
    backend: str
    tolerance: float
    comparison: Comparison
    replay: Run | None = None
    replay_route_id: str = ""
    replay_nodes: tuple[str, ...] = ()
    reason: str = ""


class Validator:
    """`await Validator(bus, ...).run()` judges sampled sessions until cancelled."""

    def __init__(self, bus: Bus, *, validator_id: str = "validator", reference: Reference | None = None,
                 route_replay: bool = True, record_timeout: float = 2.0, durable: str = VALIDATOR_DURABLE) -> None:
        self.bus = bus
        self.validator_id = validator_id
        self.reference = reference
        self.route_replay = route_replay
        self.record_timeout = record_timeout
        self.durable = durable
        self.stats = ValidatorStats()
        self.verdicts: list[ValidationVerdict] = []  # the latest ones (bounded), for tests and status
        self._http: aiohttp.ClientSession | None = None
        self._next_seq: int | None = None  # the stream sequence after the last event handled

    async def run(self) -> None:
        async with aiohttp.ClientSession() as http:
            self._http = http
            while True:
                try:
                    evidence = await KeyValueStore.open(self.bus, VERDICT_BUCKET, create=True,
                                                        ttl_s=EVIDENCE_TTL_S)
                    await self._serve(evidence)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # the server restarting, say: the durable consumer resumes
                    log.warning("validator stopped (%s: %s); again in 1 s", type(exc).__name__, exc)
                    await asyncio.sleep(1.0)

    async def _serve(self, evidence: KeyValueStore) -> None:
        reader = DurableAuditReader(self.bus, self.durable, filter_subject=subjects.audit("validation", "gateway"),
                                    from_start=False, ack_wait_s=600.0, max_ack_pending=64)
        # after a failure, start again right after the last event handled (acknowledging a later
        # one would acknowledge the rest of the batch, unjudged)
        await reader.open(start_seq=self._next_seq)
        try:
            while True:
                for stored in await reader.fetch(4, timeout=1.0):
                    await self._handle(stored, evidence)
                    self._next_seq = stored.seq + 1
                    await reader.ack([stored])
        finally:
            await reader.close()

    async def _handle(self, stored: StoredEvent, evidence: KeyValueStore) -> None:
        try:
            event = ValidationEvent.model_validate(stored.data)
        except ValueError:
            self.stats.skipped += 1
            return
        if (not event.sampled or event.outcome != "completed" or not event.output_tokens
                or event.digest_scheme is None):  # nothing to check the gateway's ids against
            self.stats.skipped += 1
            return
        try:
            verdict, ids = await self.judge(event)
        except Exception:
            log.exception("session %s: not judged", event.session_id)
            return
        if verdict is None:
            return
        await evidence.put_json(verdict.evidence_key, ids)
        await self.bus.publish_audit(verdict)
        self.verdicts = [*self.verdicts[-255:], verdict]
        self.stats.judged += 1
        self.stats.outcomes[verdict.outcome] = self.stats.outcomes.get(verdict.outcome, 0) + 1
        log.info("session %s: %s on %s (%s)%s", event.session_id, verdict.outcome, verdict.replay_backend,
                 verdict.reason, f"; implicates {', '.join(verdict.implicated)}" if verdict.implicated else "")

    async def fetch_record(self, event: ValidationEvent) -> ReplayRecord | None:
        """The session's ids from the gateway that holds them (None: no gateway has them)."""
        try:
            return await self.bus.request(
                subjects.REPLAY_RECORD,
                ReplayRecordRequest(session_id=event.session_id, validator_id=self.validator_id),
                ReplayRecord, timeout=self.record_timeout)
        except (BusError, SchemaError) as exc:
            log.info("session %s: no gateway gave its ids (%s)", event.session_id, exc)
            return None

    async def judge(self, event: ValidationEvent) -> tuple[ValidationVerdict | None, dict[str, object]]:
        """Replay one sampled session; its verdict and the evidence (both runs' ids, the salt)."""
        started = time.monotonic()
        record = await self.fetch_record(event)
        if record is None:
            self.stats.missed += 1
            return None, {}
        routes = event.routes or record.routes
        if not record_matches(event, record):
            j = Judgement("inconclusive", Blame(), "none", 0.0, Comparison(0, None, None),
                          reason="the gateway's ids do not match the event's digests")
        else:
            j = await self._judge_record(record, routes, event.model_revision)
        verdict = ValidationVerdict(
            source="validator", validator_id=self.validator_id, session_id=event.session_id,
            route_id=event.route_id, validation_event_id=event.event_id, model=event.model,
            model_revision=event.model_revision, sampling=record.sampling,
            digest_scheme=DIGEST_SCHEME, prompt_digest=event.prompt_digest or "", prompt_tokens=len(record.prompt_ids),
            original_routes=routes, replay_backend=j.backend, replay_route_id=j.replay_route_id,
            replay_nodes=list(j.replay_nodes), output_tokens=len(record.output_ids),
            compared_tokens=j.comparison.compared, original_output_digest=event.output_digest or "",
            replay_output_digest=token_ids_digest(j.replay.ids, record.salt()) if j.replay is not None else "",
            first_diff=j.comparison.first_diff, max_logprob_diff=j.comparison.max_logprob_diff,
            tolerance=j.tolerance, outcome=j.outcome, implicated=j.blame.implicated, cleared=j.blame.cleared,
            blame_basis="hop_evidence",
            reason=j.reason or j.comparison.why, elapsed_ms=(time.monotonic() - started) * 1e3,
        )
        verdict.evidence_key = verdict.event_id
        return verdict, evidence(record, j.replay)

    async def _judge_record(self, record: ReplayRecord, routes: list[RouteTaken], model: str) -> Judgement:
        original = Run(record.output_ids, record.output_logprobs)
        exclude = route_nodes(routes)
        if not rebuilt_exactly(record.restart_replay, routes):
            return Judgement("inconclusive", Blame(), "none", 0.0, Comparison(0, None, None),
                             reason=f"restarted with replay {record.restart_replay!r}: its routes rebuilt the "
                                    "generated tokens in one batch on hops without the exact KV profile, which "
                                    "no replay reproduces bit for bit")
        profile = routes_profile(routes)
        why_not_route = "route replay is off"
        if record.private:  # its ids may go to no node outside the client's allow list
            why_not_route = "a private session is replayed only on the validator's own reference"
        elif profile is None:  # no route computes like a mix of profiles
            why_not_route = "the original's routes mixed KV profiles"
        elif self.route_replay:
            assert self._http is not None
            try:
                rr = await replay_on_route(self.bus, self._http, record, model=model, exclude=exclude)
                taken = RouteTaken(session_id=rr.session.session_id, route_id=rr.session.route_id, epoch=1,
                                   hops=list(rr.session.hops), from_token=0)
                replay_profile = routes_profile([taken])
                if not comparable(profile, replay_profile, "route"):
                    raise NoDisjointRoute(f"the one found ran KV profile {replay_profile or 'mixed'}, "
                                          f"the original {profile}")
                return await self._judge_route_replay(record, routes, original, rr.run, rr.session.route_id,
                                                      [h.node_id for h in rr.session.hops], taken)
            except NoDisjointRoute as exc:
                why_not_route = f"no route without {', '.join(exclude)} ({exc})"
            except RouteFailedError as exc:
                why_not_route = f"the replay route failed ({exc.failure.reason})"
        if self.reference is None:
            return Judgement("inconclusive", Blame(), "none", 0.0, Comparison(0, None, None),
                             reason=f"{why_not_route}, and this validator has no reference engine")
        if not comparable(profile, self.reference.kv_profile, self.reference.backend):
            return Judgement("inconclusive", Blame(), "none", 0.0, Comparison(0, None, None),
                             reason=f"{why_not_route}, and the original's hops ran KV profile "
                                    f"{profile or 'mixed'}, the reference {self.reference.kv_profile} "
                                    "(meshnet validator --kv-profile)")
        cmp, own = await self._score(record, original)
        blame, why = await self._blame(record, routes, cmp)
        return Judgement(cmp.outcome, blame, self.reference.backend, tolerance_for(self.reference.backend), cmp,
                         replay=Run(own, []), reason=f"{cmp.why} ({why_not_route}: replayed on the reference){why}")

    async def _score(self, record: ReplayRecord, run: Run) -> tuple[Comparison, list[int]]:
        assert self.reference is not None
        forced_record = record.model_copy(update={"output_ids": list(run.ids)})
        steps, own = await asyncio.to_thread(self.reference.forced, forced_record, route_chunk_size(record))
        return score_forced(run, steps, greedy=record.sampling.greedy,
                            tolerance=tolerance_for(self.reference.backend)), own

    async def _judge_route_replay(self, record: ReplayRecord, routes: list[RouteTaken], original: Run,
                                  replay: Run, replay_route_id: str, replay_nodes: list[str],
                                  replay_route: RouteTaken) -> Judgement:
        tol = tolerance_for("route")
        cmp = compare_runs(original, replay, tol)
        if cmp.outcome == "pass":
            blame = Blame(cleared=list(dict.fromkeys([*route_nodes(routes), *replay_nodes])))
            return Judgement("pass", blame, "route", tol, cmp, replay, replay_route_id, tuple(replay_nodes))
        if cmp.outcome == "inconclusive":
            return Judgement("inconclusive", Blame(), "route", tol, cmp, replay, replay_route_id, tuple(replay_nodes))
        # one of the two routes is wrong: each hop of both shows its own work
        replayed = record.model_copy(update={"output_ids": list(replay.ids), "output_logprobs": list(replay.logprobs)})
        mine, why_mine = await self._blame(record, routes, cmp)
        theirs, why_theirs = await self._blame(replayed, [replay_route], cmp)
        blame = merge(mine, theirs)
        outcome: VerdictOutcome = "fail" if blame.implicated else "inconclusive"
        return Judgement(outcome, blame, "route", tol, cmp, replay, replay_route_id, tuple(replay_nodes),
                         reason=f"{cmp.why}; original route{why_mine or ': -'}; replay route{why_theirs or ': -'}")

    async def _blame(self, record: ReplayRecord, routes: list[RouteTaken], cmp: Comparison) -> tuple[Blame, str]:
        """Whom a judgement of `record`'s run on `routes` blames, and why (", ..."): a pass clears
        every node; a failure blames the hops of its route whose own evidence shows them wrong
        (validator/localize.py). Nothing else implicates a node."""
        if cmp.outcome == "pass":
            return Blame(cleared=route_nodes(routes)), ""
        if cmp.outcome != "fail":
            return Blame(), ""
        ranges = self.reference.ranges if self.reference is not None else None
        if ranges is None or not comparable(routes_profile(routes), ranges.kv_profile, "llama.cpp"):
            return Blame(), ("; nobody is blamed: checking each hop needs a llama.cpp reference of the "
                             "hops' KV profile (meshnet validator --kv-profile)")
        if len(routes) > 1:
            return Blame(), "; nobody is blamed: a restarted session's hops are not checked one by one"
        hops, seams = await check_route(self.bus, ranges, routes[0], record, route_chunk_size(record),
                                        self.validator_id)
        blame, why = localize(hops, seams)
        checked = ", ".join(f"{h.node_id} {h.status}: {h.detail}" for h in hops)
        return blame, f"; hop evidence ({checked}): {why}"
