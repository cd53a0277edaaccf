"""Drive one Route Session: prefill, the decode loop, stop conditions, telemetry and metrics."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Literal, Protocol

from gateway.errors import ApiError, ClientGoneError, RouteFailedApiError
from gateway.metrics import GatewayMetrics
from gateway.openai_format import TokenLogprob, Usage
from gateway.telemetry import SessionTelemetry
from gateway.text_stream import IncrementalDetokenizer, StopMatcher
from schemas.frames import FrameResult, RouteFailedError
from schemas.route import Hop, KeepHop, Phase, RouteFailure, RouteSession, inbound_start

log = logging.getLogger("meshnet.gateway.generation")


class RouteClientLike(Protocol):
    """What the decode loop needs from gateway.route_client.RouteClient."""

    async def prefill(
        self, token_ids: Sequence[int], on_progress: Callable[[int, int], object] | None = None,
        stepwise_from: int | None = None,
    ) -> FrameResult: ...

    async def decode(self, token_id: int) -> FrameResult: ...

    def decode_run(
        self, token_id: int, steps: int, stop_ids: Iterable[int] = (), flush_ms: int = 0
    ) -> AsyncGenerator[FrameResult, None]: ...

    @property
    def results_ready(self) -> bool: ...

    def interrupt(self, failure: RouteFailure) -> None: ...


RouteClientFactory = Callable[[RouteSession], AbstractAsyncContextManager[RouteClientLike]]
ReplayMode = Literal["auto", "decode", "prefill"]
REPLAY_MODES: tuple[ReplayMode, ...] = ("auto", "decode", "prefill")
RestartRoute = Callable[[RouteFailure, int, frozenset[str], list[KeepHop], int], Awaitable[RouteSession]]
"""(the failure, the new route's epoch, nodes to leave out, hops to keep, the positions they
keep) -> a new Route Session, or ApiError."""

# failures that say the gateway or a node broke the protocol, not that a hop was lost: a new
# route would break the same way
NOT_RESTARTABLE: frozenset[str] = frozenset({
    "bad_frame", "seq_mismatch", "phase_mismatch", "position_mismatch", "hop_mismatch",
    "route_mismatch", "epoch_mismatch", "invalid_value",
})


MAX_MOVES = 2  # moves one session accepts (tracker/spread.py): past that it stays where it is
STALL_STEPS = 20  # decode: no token for this many of the route's measured step times is a stall
PREFILL_STALL_FACTOR = 6  # prefill and replay (chunks of many rows, maybe queued): this many times the base


def stall_deadline(phase: str, step_s: float | None, base_s: float) -> float:
    """Seconds without any progress after which a route counts as lost (pure): in decode the
    larger of `base_s` and STALL_STEPS steps as measured on this route, before that (prefill,
    a restart's replay) PREFILL_STALL_FACTOR times `base_s`."""
    if phase == "decode":
        return max(base_s, STALL_STEPS * step_s) if step_s else base_s
    return PREFILL_STALL_FACTOR * base_s


def replays_by_prefill(mode: ReplayMode, hops: Sequence[Hop]) -> bool:
    """Whether a restart's new route rebuilds the tokens generated so far in one batched prefill
    (pure), rather than one model call per token (stepwise): always with "prefill", never with
    "decode"; with "auto" when every hop runs the "exact" KV profile, whose batched prefill gives
    the KV and logits of the decode steps that made those tokens bit for bit. A hop of the
    default profile (or one that does not say) gives prefill logits apart from its decode's,
    so "auto" replays stepwise there: on a default-profile mesh it is "decode"."""
    if mode == "auto":
        return bool(hops) and all(h.kv_profile == "exact" for h in hops)
    return mode == "prefill"


def keep_for_restart(session: RouteSession, failure: RouteFailure, history: int,
                     generated: int) -> tuple[list[KeepHop], int]:
    """The hops of a lost route a restart may continue on, and the history positions they
    keep (pure): every hop but the one the failure names as lost, keeping all of the history
    but its last token, once the session has generated any. Each of those hops then computed
    that history's rows and sent them on (else the tail could not have sampled the last token),
    so its Hot KV State holds them; the new route sends the last token through every hop.
    None for a failure in prefill, a restart's rebuild included (a hop may hold only part
    of the history then), nor when the failure does not say which hop was lost (a stall)."""
    if (not generated or failure.phase != "decode" or failure.code not in ("hop_lost", "moved")
            or not failure.node_id or history < 2):
        return [], 0
    keep = [KeepHop(node_id=h.node_id, session_id=session.session_id, layer_start=h.layer_start,
                    layer_end=h.layer_end) for h in session.hops if h.node_id != failure.node_id]
    return (keep, history - 1) if keep else ([], 0)


def may_move(*, phase: str, generated: int, restarts_allowed: bool, keep: bool, moves: int) -> bool:
    """Whether a session may follow a tracker's order to move off a hop now (pure): it decodes
    (a move keeps the other hops' Hot KV State, which needs the whole prompt there), it has a
    token (so that state holds the history), restarts are on for it (a client that turned them
    off keeps its route) and so are Kept Hops (else a move would re-prefill every hop), and it
    moved fewer than MAX_MOVES times."""
    return phase == "decode" and generated > 0 and restarts_allowed and keep and moves < MAX_MOVES


def may_restart(failure: RouteFailure, *, restarts: int, max_restarts: int) -> bool:
    """Whether a session that failed this way moves to a new route (pure): its restarts so far
    are under the bound, and the failure is a lost or broken hop, not a protocol error."""
    return restarts < max_restarts and failure.code not in NOT_RESTARTABLE


class TokenText(Protocol):
    """What the decode loop needs from the tokenizer."""

    eog_ids: frozenset[int]

    def is_eog(self, token_id: int) -> bool: ...

    def detokenizer(self) -> IncrementalDetokenizer: ...

    def token_bytes(self, token_id: int) -> bytes: ...

    def piece(self, token_id: int, *, special: bool = False) -> str: ...


@dataclass(slots=True, frozen=True)
class GenerationPlan:
    """Everything one completion needs once its Route Session exists."""

    session: RouteSession
    prompt_ids: list[int]
    max_tokens: int  # already capped by the context
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    flush_ms: int = 0  # the head may hold decoded tokens this long and send them together
    max_restarts: int = 0  # new routes the session may move to when it loses a hop
    replay: ReplayMode = "auto"  # how a restart's route rebuilds the tokens generated so far
    keep: bool = True  # a restart continues on the lost route's surviving hops (Kept Hops) when it can
    stall_s: float = 10.0  # no progress for this long (more in prefill; stall_deadline) loses the route


@dataclass(slots=True)
class Delta:
    """Text (possibly empty) and logprobs produced by one generated token."""

    text: str
    logprobs: list[TokenLogprob] | None = None


@dataclass(slots=True, frozen=True)
class Finished:
    """The end of a completion."""

    finish_reason: str  # "stop" | "length"
    usage: Usage


def decode_steps(first_is_eog: bool, max_tokens: int) -> int:
    """Decode steps a completion may need after prefill's token (pure): none after an end
    of generation, else one per token still allowed."""
    return 0 if first_is_eog else max(0, max_tokens - 1)


def finish_reason_for(
    *, token_is_eog: bool, stopped: bool, generated: int, max_tokens: int
) -> str | None:
    """Why generation ends after this token, or None to continue (pure)."""
    if token_is_eog or stopped:
        return "stop"
    if generated >= max_tokens:
        return "length"
    return None


def _failure(session: RouteSession, phase: Phase, exc: BaseException) -> RouteFailure:
    return RouteFailure(
        session_id=session.session_id,
        route_id=session.route_id,
        phase=phase,
        reason=f"{type(exc).__name__}: {exc}",
        code="route_failed",
    )


class Generation:
    """One completion over one Route Session; iterate `run()` for Deltas then one Finished."""

    def __init__(
        self,
        plan: GenerationPlan,
        *,
        tokens: TokenText,
        open_route: RouteClientFactory,
        telemetry: SessionTelemetry,
        metrics: GatewayMetrics,
        started: float,
        client_gone: Callable[[], bool] = lambda: False,
        reroute: RestartRoute | None = None,
    ) -> None:
        self.plan = plan
        self.tokens = tokens
        self.open_route = open_route
        self.telemetry = telemetry
        self.metrics = metrics
        self.started = started
        self.client_gone = client_gone
        self.output_ids: list[int] = []
        self.output_logprobs: list[float | None] = []  # the tail's logprob of each (when it gives them)
        self.failure: RouteFailure | None = None
        self.route_opened = False  # the route client (which releases the route) was entered
        self.reroute = reroute  # None: a lost hop fails the session
        self.routes: list[RouteSession] = [plan.session]  # the first route, then each restart's
        self.route_starts: list[int] = [0]  # output tokens generated before each route took over
        self.batched_replays = 0  # restarts whose route rebuilt generated tokens in one batched prefill
        self.moves = 0  # routes taken because the tracker moved the session (not restarts: no hop was lost)
        self._phase: Phase = "prefill"
        self._finish: str | None = None
        self._progress_at = 0.0  # when the route last showed progress (a chunk, a token)
        self._step_s: float | None = None  # the route's decode step time, smoothed
        self._rc: RouteClientLike | None = None

    def _logprob(self, choice: FrameResult) -> list[TokenLogprob] | None:
        if not self.plan.logprobs:
            return None

        def entry(token_id: int) -> tuple[str, bytes]:
            raw = self.tokens.token_bytes(token_id)
            return raw.decode("utf-8", errors="replace"), raw

        text, raw = entry(choice.token_id)
        top = [(*entry(t), lp) for t, lp in choice.top_logprobs]
        return [TokenLogprob(
            token=text, logprob=choice.logprob if choice.logprob is not None else 0.0, raw=raw,
            top=[(t, lp, b) for t, b, lp in top],
        )]

    async def _results(self, rc: RouteClientLike, first: FrameResult, budget: int) -> AsyncGenerator[FrameResult, None]:
        """Prefill's token, then the route's Decode Run: the head feeds each token back by
        itself, so detokenizing and writing a token overlap the route's next step. `budget`:
        the tokens still allowed, prefill's included."""
        yield first
        steps = decode_steps(self.tokens.is_eog(first.token_id), budget)
        if steps:
            run = rc.decode_run(first.token_id, steps, self.tokens.eog_ids, self.plan.flush_ms)
            self._rc = rc
            try:
                async for result in run:
                    yield result
            finally:
                self._rc = None
                await run.aclose()

    async def _rebuild(self, rc: RouteClientLike, session: RouteSession, history: list[int]) -> FrameResult:
        """Put `history` (the prompt, then any tokens generated before a restart) into the
        route's KV; the route's token for the position after it.

        Stepwise (replays_by_prefill says which), the generated tokens go in stepwise prefill
        frames: each hop runs each of their rows as a model call of its own, as their decode
        steps did on the lost route, so the new route's KV and logits are bit for bit the lost
        route's and greedy or seeded answers go on exactly. With the default KV profile,
        llama.cpp's batched prefill of the same tokens gives other logits than its step-by-step
        decode (docs/shard-runtime.md, "One-row calls"), enough to change later tokens; with the exact profile on every hop it gives the same bits, in a
        fraction of the time (docs/benchmarks.md, "Node loss")."""
        plan = self.plan
        if inbound_start(session.hops, 0) != 0:  # every route has a hop that starts empty
            raise RuntimeError(f"route {session.route_id} keeps every hop: nothing was lost")
        if len(history) == len(plan.prompt_ids):
            return await rc.prefill(history, on_progress=self._progress)
        if replays_by_prefill(plan.replay, session.hops):
            self.batched_replays += 1
            self.metrics.restart_replays.inc(replay="batched")
            return await rc.prefill(history, on_progress=self._progress)
        self.metrics.restart_replays.inc(replay="stepwise")
        return await rc.prefill(history, on_progress=self._progress, stepwise_from=len(plan.prompt_ids))

    @property
    def restart_replay(self) -> str:
        """How this session's restarts rebuilt their generated tokens: "prefill" when any did so
        in one batch, else "decode" (stepwise, or no restart)."""
        return "prefill" if self.batched_replays else "decode"

    def more_ready(self) -> bool:
        """Whether the next token has already arrived (part of a batch the head sent at once):
        a streaming answer then writes this token's chunk together with the next ones."""
        return self._rc is not None and self._rc.results_ready

    def _check_client(self) -> None:
        if self.client_gone():
            raise ClientGoneError("client disconnected")

    async def run(self) -> AsyncIterator[Delta | Finished]:
        """Prefill, then decode until EOS/stop/length; raises RouteFailedApiError on failure.

        When the route loses a hop and the plan allows it, the session moves to a new route
        (the lost node left out) that re-prefills the prompt and every token generated so far,
        and the answer goes on from the next token: the client sees one stream."""
        plan, t = self.plan, self.telemetry
        detok = self.tokens.detokenizer()
        stops = StopMatcher(plan.stop)
        session = plan.session
        excluded: set[str] = set()  # the hop this session lost last
        lost_at: float | None = None  # when the current restart (or move) began
        moving = False  # the current new route is a move's, not a restart's
        finish: str | None = None
        try:
            while True:
                try:
                    async for delta in self._on_route(session, detok, stops):
                        if lost_at is not None:  # the new route's first token: the restart is done
                            if moving:
                                self.metrics.move_seconds.observe(time.monotonic() - lost_at)
                                self.metrics.moves.inc(outcome="resumed")
                            else:
                                self.metrics.restart_seconds.observe(time.monotonic() - lost_at)
                                self.metrics.restarts.inc(outcome="resumed")
                            lost_at, moving = None, False
                        yield delta
                    finish = self._finish
                    break
                except RouteFailedError as exc:
                    restarts = len(self.routes) - 1 - self.moves
                    move = exc.failure.code == "moved" and lost_at is None and self.reroute is not None
                    failure = exc.failure.model_copy(update={"restarts": restarts})
                    if not move and (self.reroute is None or not may_restart(
                            failure, restarts=restarts, max_restarts=plan.max_restarts)):
                        if restarts:
                            failure = failure.model_copy(update={"reason": (
                                f"{failure.reason} (after {restarts} restart(s), "
                                f"at most {plan.max_restarts})")})
                        raise RouteFailedError(failure) from exc
                    assert self.reroute is not None
                    moving = move or moving
                    lost_at = lost_at if lost_at is not None else time.monotonic()
                    # only the hop just lost: one lost earlier may be back (the tracker knows
                    # which nodes are alive, and keeps a reported one out until it is heard from)
                    excluded = {failure.node_id} if failure.node_id else set()
                    epoch = len(self.routes) + 1
                    attempt = restarts + (not move)  # a move is no restart
                    if move:
                        self.moves += 1
                        log.info("session %s moves off %s (%s)", plan.session.session_id, failure.node_id,
                                 failure.reason)
                    else:
                        log.warning("session %s lost %s in %s (%s): restart %d of %d on a new route",
                                    plan.session.session_id, failure.node_id or "a hop", failure.phase,
                                    failure.reason, attempt, plan.max_restarts)
                    t.restarting(attempt, failure.reason, failure.node_id, move=move)
                    keep, keep_position = keep_for_restart(
                        session, failure, len(plan.prompt_ids) + len(self.output_ids), len(self.output_ids)
                    ) if plan.keep else ([], 0)
                    try:
                        session = await self.reroute(failure, epoch, frozenset(excluded), keep, keep_position)
                    except ApiError as route_exc:
                        if not move:
                            raise RouteFailedError(failure.model_copy(update={
                                "restarts": attempt,
                                "reason": f"{failure.reason}; restart {attempt} of {plan.max_restarts} found "
                                          f"no new route: {route_exc.message}",
                            })) from exc
                        # nowhere else to go: a route that may take the node it left again
                        log.warning("session %s found no route off %s (%s): any route", plan.session.session_id,
                                    failure.node_id, route_exc.message)
                        try:
                            session = await self.reroute(failure, epoch, frozenset(), keep, keep_position)
                        except ApiError as again_exc:
                            raise RouteFailedError(failure.model_copy(update={
                                "code": "route_failed",
                                "reason": f"{failure.reason}; the move found no new route: {again_exc.message}",
                            })) from exc
                    self.routes.append(session)
                    self.route_starts.append(len(self.output_ids))
                    kept = [h.node_id for h in session.hops if h.keep_session]
                    if kept:
                        self.metrics.restart_kept_hops.inc(len(kept))
                    t.routed(session.route_id, [h.node_id for h in session.hops], kept)
            self._phase = "finalizing"
            t.set_phase("finalizing")
            if not stops.stopped:
                tail = stops.feed(detok.flush()).emit + stops.flush()
                if tail:
                    yield Delta(tail)
        except RouteFailedError as exc:
            self.failure = exc.failure
        except (ClientGoneError, GeneratorExit):
            t.fail("client disconnected", last_phase=self._phase)
            raise
        except asyncio.CancelledError:
            t.fail("cancelled (client disconnected or gateway shutting down)", last_phase=self._phase)
            raise
        except (OSError, ValueError, RuntimeError) as exc:
            log.exception("session %s failed in %s", session.session_id, self._phase)
            self.failure = _failure(session, self._phase, exc)
        if self.failure is not None:
            if lost_at is not None:  # a restart (or move) began and never gave a token
                (self.metrics.moves if moving else self.metrics.restarts).inc(outcome="failed")
            self.metrics.failures.inc(phase=self.failure.phase)
            t.fail(self.failure.reason, last_phase=self.failure.phase)
            raise RouteFailedApiError(self.failure)
        reason = finish or "stop"
        t.complete(reason)
        yield Finished(reason, Usage(len(plan.prompt_ids), len(self.output_ids)))

    async def _on_route(self, session: RouteSession, detok: IncrementalDetokenizer,
                        stops: StopMatcher) -> AsyncIterator[Delta]:
        """Generate on one route until a stop condition (then `_finish` is set); a first route
        prefills the prompt, a restart's route also rebuilds the tokens generated so far."""
        plan, t = self.plan, self.telemetry
        restart = len(self.routes) > 1
        history = [*plan.prompt_ids, *self.output_ids]
        budget = plan.max_tokens - len(self.output_ids)
        self._phase, self._finish = "prefill", None
        async with self.open_route(session) as rc:
            self.route_opened = True
            rc.movable = self._movable  # type: ignore[attr-defined]  # fakes in tests may lack it
            if not restart:
                t.set_phase("prefill")
            self._progress_at, self._step_s = time.monotonic(), None
            watchdog = asyncio.create_task(self._watchdog(rc, session), name=f"stall-{session.session_id}")
            deltas = self._generate(rc, session, history, budget, detok, stops)
            try:
                async for delta in deltas:
                    yield delta
            finally:
                await deltas.aclose()  # its Decode Run ends now, not when the generator is collected
                watchdog.cancel()
                await asyncio.gather(watchdog, return_exceptions=True)

    def _movable(self) -> bool:
        """Whether a tracker's move order is followed now (may_move); a refusal is counted."""
        ok = may_move(phase=self._phase, generated=len(self.output_ids),
                      restarts_allowed=self.reroute is not None and self.plan.max_restarts > 0,
                      keep=self.plan.keep, moves=self.moves)
        if not ok:
            self.metrics.moves.inc(outcome="declined")
        return ok

    async def _watchdog(self, rc: RouteClientLike, session: RouteSession) -> None:
        """Interrupt the route when it shows no progress within stall_deadline: a hop that
        neither answers nor fails (a partition the tracker does not see) loses the route."""
        while True:
            limit = stall_deadline(self._phase, self._step_s, self.plan.stall_s)
            wait = self._progress_at + limit - time.monotonic()
            if wait <= 0:
                log.warning("session %s: no progress on route %s for %.1f s", session.session_id,
                            session.route_id, limit)
                rc.interrupt(RouteFailure(
                    session_id=session.session_id, route_id=session.route_id, phase=self._phase,
                    reason=f"no progress for {limit:.1f} s (the stall deadline)", code="hop_stalled"))
                return
            await asyncio.sleep(min(wait, self.plan.stall_s / 4))  # the deadline shrinks once decode starts

    def _progress(self, done: int, total: int) -> None:
        self._progress_at = time.monotonic()
        self.telemetry.prefill_progress(done, total)

    async def _generate(self, rc: RouteClientLike, session: RouteSession, history: list[int], budget: int,
                        detok: IncrementalDetokenizer, stops: StopMatcher) -> AsyncGenerator[Delta, None]:
        plan, t = self.plan, self.telemetry
        last_sampled_ms: float | None = None  # the tail's stamp of the previous output token (per tail clock)
        last_at: float | None = None  # when the previous token arrived
        choice = await self._rebuild(rc, session, history)
        self.metrics.prompt_tokens.inc(len(history))
        self._phase = "decode"
        t.set_phase("decode")
        results = self._results(rc, choice, budget)
        try:
            async for choice in results:
                self._check_client()
                now = time.monotonic()
                if last_at is not None:  # the route's step time, between its tokens
                    step = now - last_at
                    self._step_s = step if self._step_s is None else 0.8 * self._step_s + 0.2 * step
                self._progress_at = last_at = now
                token = choice.token_id
                eog = self.tokens.is_eog(token)
                scan_emit, stopped = "", False
                if not eog:
                    now = time.monotonic()
                    if not self.output_ids:
                        self.metrics.ttft.observe(now - self.started)
                    at = choice.sampled_ms
                    if at is not None and last_sampled_ms is not None:
                        self.metrics.tpot.observe(max(0.0, at - last_sampled_ms) / 1e3)
                    last_sampled_ms = at
                    self.output_ids.append(token)
                    self.output_logprobs.append(choice.logprob)
                    self.metrics.generated_tokens.inc()
                    t.token()
                    scan = stops.feed(detok.feed(token))
                    scan_emit, stopped = scan.emit, scan.stopped
                    yield Delta(scan_emit, self._logprob(choice))
                self._finish = finish_reason_for(
                    token_is_eog=eog, stopped=stopped,
                    generated=len(self.output_ids), max_tokens=plan.max_tokens,
                )
                if self._finish is not None:
                    break  # a stop string: the head stops after the step in flight
        finally:
            await results.aclose()
        if self._finish is None:
            raise RouteFailedError(RouteFailure(
                session_id=session.session_id, route_id=session.route_id, phase="decode",
                reason="the route's Decode Run ended before a stop condition", code="route_failed"))
