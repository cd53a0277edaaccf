"""Drive one Route Session: prefill, the decode loop, stop conditions, telemetry and metrics."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Literal, Protocol

from gateway.errors import ApiError, ClientGoneError, RouteFailedApiError
from gateway.metrics import GatewayMetrics
from gateway.openai_format import TokenLogprob, Usage
from gateway.route_client import HopMark
from gateway.session_machine import (
    Action,
    AskRoute,
    ClientGone,
    EmitToken,
    Event,
    Fail,
    Finalized,
    Finish,
    Interrupt,
    Limits,
    MoveDeclined,
    MoveOrdered,
    Phase,
    Resumed,
    RouteAborted,
    RouteBroken,
    RouteFailed,
    RouteGranted,
    RouteRefused,
    RunEnded,
    SessionRecord,
    Stalled,
    StartRoute,
    StopRoute,
    TokenArrived,
    step,
)
from gateway.telemetry import SessionTelemetry
from gateway.text_stream import IncrementalDetokenizer, StopMatcher
from schemas.frames import FrameResult, RouteFailedError
from schemas.route import Hop, KeepHop, RouteFailure, RouteSession, inbound_start

log = logging.getLogger("meshnet.gateway.generation")


class RouteClientLike(Protocol):
    """What the decode loop needs from gateway.route_client.RouteClient."""

    async def prefill(
        self, token_ids: Sequence[int], on_progress: Callable[[int, int], object] | None = None,
        stepwise_from: int | None = None,
    ) -> FrameResult: ...

    async def decode(self, token_id: int) -> FrameResult: ...

    def decode_run(
        self, token_id: int, steps: int, stop_ids: Iterable[int] = (), flush_ms: int = 0, draft: int = 0
    ) -> AsyncGenerator[FrameResult, None]: ...

    @property
    def results_ready(self) -> bool: ...

    def interrupt(self, failure: RouteFailure) -> None: ...

    @property
    def session(self) -> RouteSession: ...

    used_rows: int | None  # the rows the answer used, told to the hops by the close
    chunk_size: int  # prompt rows per prefill frame

    async def hop_marks(self, timeout: float) -> tuple[HopMark, ...]: ...


RouteClientFactory = Callable[[RouteSession], AbstractAsyncContextManager[RouteClientLike]]
ReplayMode = Literal["auto", "decode", "prefill"]
REPLAY_MODES: tuple[ReplayMode, ...] = ("auto", "decode", "prefill")
# (failure, epoch, nodes left out, kept hops, kept position, the tokens generated so far)
RestartRoute = Callable[[RouteFailure, int, frozenset[str], list[KeepHop], int, list[int]], Awaitable[RouteSession]]
"""(the failure, the new route's epoch, nodes to leave out, hops to keep, the positions they
keep) -> a new Route Session, or ApiError."""

CLIENT_CHECK_S = 0.5  # how often a session looks for its client while no token comes (prefill, restarts)
STALL_STEPS = 20  # decode: no token for this many of the route's measured step times is a stall
PREFILL_STALL_FACTOR = 3  # prefill and replay (chunks of many rows, maybe queued): this many times the base
# prefill: besides, this long per row of the route's largest frame. Progress shows a frame at a
# time: the head acknowledges each chunk it takes, and the hops' counters (hop_marks, probed while
# the head is quiet) move as each hop takes, computes and hands on a frame; a loaded 2-core machine
# prefilled two 2,000-token prompts at once at ~40 rows/s, so 20 rows/s leaves a slow hop its time
PREFILL_FLOOR_ROWS_PER_S = 20.0


def stall_deadline(phase: str, step_s: float | None, base_s: float, rows: int = 0) -> float:
    """Seconds without any progress after which a route counts as lost (pure): in decode the
    larger of `base_s` and STALL_STEPS steps as measured on this route, before that (prefill,
    a restart's replay, in frames of at most `rows` rows) PREFILL_STALL_FACTOR times `base_s`
    plus a frame's rows at PREFILL_FLOOR_ROWS_PER_S."""
    if phase == "decode":
        return max(base_s, STALL_STEPS * step_s) if step_s else base_s
    return PREFILL_STALL_FACTOR * base_s + rows / PREFILL_FLOOR_ROWS_PER_S


def hops_moved(before: Sequence[HopMark], after: Sequence[HopMark]) -> bool:
    """Whether any hop's progress mark changed between two probes (pure): a hop that did not
    answer either time shows nothing."""
    return any(a is not None and b is not None and a != b for a, b in zip(before, after, strict=False))


def speculates(draft: int, hops: Sequence[Hop]) -> int:
    """The draft bound a Decode Run on `hops` gets (pure): `draft` when every hop runs the exact
    KV profile, whose calls of several rows give each row the bits of a single step (so a
    verify step keeps exactly the tokens plain decoding makes), else 0."""
    return draft if hops and all(h.kv_profile == "exact" for h in hops) else 0


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
    draft: int = 0  # the most tokens the head may draft per decode step (on routes speculates() allows)


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
    stop_string: bool = False  # a stop string ended it ("stop"): the answer is cut there, not ended by the model

    @property
    def cut(self) -> bool:
        """Whether the answer was cut short (max_tokens or a stop string), not ended by the model."""
        return self.finish_reason == "length" or self.stop_string


def decode_steps(first_is_eog: bool, max_tokens: int) -> int:
    """Decode steps a completion may need after prefill's token (pure): none after an end
    of generation, else one per token still allowed."""
    return 0 if first_is_eog else max(0, max_tokens - 1)



@dataclass(slots=True, frozen=True)
class Arrived:
    """A token from the route (made into a TokenArrived once its text is scanned), and when the
    route gave it (the session may take it up later: a client slow to read)."""

    result: FrameResult
    at: float


WatchRoute = Callable[[str, Callable[[RouteFailure], None]], Callable[[], None]]
"""RouteWatch.watch: (route id, on a tracker's abort or move of it) -> the unwatch call."""


class Generation:
    """One completion over one or more Route Sessions; iterate `run()` for Deltas then one
    Finished. Its lifecycle is a SessionRecord changed only by session_machine.step; this class
    turns what happens (tokens, failures, directives, stalls) into events and carries out the
    actions. Each route is driven by a task of its own (`_drive`), which owns the route client."""

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
        watch: WatchRoute | None = None,
    ) -> None:
        self.plan = plan
        self.tokens = tokens
        self.open_route = open_route
        self.telemetry = telemetry
        self.metrics = metrics
        self.started = started
        self.client_gone = client_gone
        self.reroute = reroute  # None: a lost hop fails the session
        self.watch = watch
        self.limits = Limits(plan.max_tokens, plan.max_restarts, reroute is not None, plan.keep)
        self.record = SessionRecord(phase=Phase.ROUTING, prompt_tokens=len(plan.prompt_ids))
        self.output_ids: list[int] = []
        self.output_logprobs: list[float | None] = []  # the tail's logprob of each (when it gives them)
        self.drafted = 0  # speculative decoding: tokens the heads drafted, and the kept ones in the answer
        self.accepted = 0
        self._kept_due = 0  # tokens still to come of the last verify step that are its kept drafts
        self.route_opened = False  # a route client (which releases its route) was entered
        self.routes: list[RouteSession] = [plan.session]  # the first route, then each restart's
        self.route_starts: list[int] = [0]  # output tokens generated before each route took over
        self.batched_replays = 0  # restarts whose route rebuilt generated tokens in one batched prefill
        self._events: asyncio.Queue[Event | Arrived] = asyncio.Queue()
        self._driver: asyncio.Task[None] | None = None
        self._leaving = False  # the session is done with the route: its driver ends it with a close
        self._ran_out = False  # the route's Decode Run ended by itself: its driver is closing the route
        self._decided = asyncio.Event()  # the session is done with the route (its used rows are set)
        self._rc: RouteClientLike | None = None
        # the token being handled: its shown text, whether a stop string ended the answer, and
        # where its own text begins in the answer (characters)
        self._arrived: tuple[FrameResult, str, bool, int] | None = None
        # logprobs of tokens whose text is held (a stop string's possible start, part of a
        # character): they go out with the text, or not at all when it turns out a stop string
        self._held_logprobs: list[tuple[int, TokenLogprob]] = []  # with where each token's text begins
        self._fed_chars = 0  # characters of the answer's text so far, shown or held
        self._shown_chars = 0  # of them, shown
        self._progress_at = 0.0  # when the route last showed progress (a chunk, a token)
        self.prompt_ms: float | None = None  # the prompt's prefill on the route that did it: first frame to first token
        self._last_at: float | None = None  # when the route's previous token arrived
        self._step_s: float | None = None  # the route's decode step time, smoothed
        self._last_sampled_ms: float | None = None

    @property
    def failure(self) -> RouteFailure | None:
        return self.record.failure if self.record.phase is Phase.FAILED else None

    @property
    def moves(self) -> int:
        return self.record.moves

    @property
    def restart_replay(self) -> str:
        """How this session's restarts rebuilt their generated tokens: "prefill" when any did so
        in one batch, else "decode" (stepwise, or no restart)."""
        return "prefill" if self.batched_replays else "decode"

    def more_ready(self) -> bool:
        """Whether the next token has already arrived (part of a batch the head sent at once):
        a streaming answer then writes this token's chunk together with the next ones."""
        return not self._events.empty() or (self._rc is not None and self._rc.results_ready)

    async def run(self) -> AsyncIterator[Delta | Finished]:
        """Prefill, then decode until EOS/stop/length; raises RouteFailedApiError on failure
        and ClientGoneError when the client left. A lost hop (when the plan allows restarts)
        or a tracker's move continues the answer on a new route: the client sees one stream."""
        detok, stops = self.tokens.detokenizer(), StopMatcher(self.plan.stop)
        pending: list[Event | Arrived] = [RouteGranted(self.plan.session)]
        watcher = asyncio.create_task(self._watch_client(), name=f"client-{self.plan.session.session_id}")
        try:
            while not self.record.phase.terminal:
                event = pending.pop(0) if pending else await self._events.get()
                if isinstance(event, Arrived):
                    event = self._scan(event, detok, stops)
                self.record, actions = step(self.record, event, self.limits)
                if self.record.phase in (Phase.PREFILL, Phase.DECODE, Phase.FINALIZING):
                    self.telemetry.set_phase(self.record.phase.public)
                for action in actions:
                    if isinstance(action, EmitToken):
                        yield self._emit()
                    elif isinstance(action, Finish):
                        tail = "" if stops.stopped else stops.feed(detok.flush()).emit + stops.flush()
                        if tail or self._held_logprobs:
                            yield Delta(tail, [e for _, e in self._held_logprobs] or None)
                            self._held_logprobs = []
                        pending.append(Finalized())
                    else:
                        follow = await self._carry_out(action)
                        if follow is not None:
                            pending.append(follow)
        except GeneratorExit:
            self.telemetry.fail("client disconnected", last_phase=self.record.phase.public)  # type: ignore[arg-type]
            raise
        except asyncio.CancelledError:
            self.telemetry.fail("cancelled (client disconnected or gateway shutting down)",
                                last_phase=self.record.phase.public)  # type: ignore[arg-type]
            raise
        finally:
            watcher.cancel()
            await self._end_driver(close=self.record.phase is Phase.COMPLETED)
        finish = self.record.finish or "stop"
        self.telemetry.complete(finish)
        yield Finished(finish, Usage(len(self.plan.prompt_ids), len(self.output_ids), self.drafted, self.accepted),
                       stop_string=stops.stopped)

    async def _watch_client(self) -> None:
        """ClientGone once the client has left, noticed even while no token comes to notice it
        by (a long prefill, a restart's replay); a token's arrival also checks (_scan)."""
        while True:  # a poll: the transport has no "closed" callback to wait on
            if self.client_gone():
                self._events.put_nowait(ClientGone())
                return
            await asyncio.sleep(CLIENT_CHECK_S)

    def _arrival(self, result: FrameResult) -> Arrived:
        """A token the route just gave: the route's progress and step time count from here, in
        the route's driver, not from when the session takes the token up (a client that reads
        slowly holds the session, never the route; the stall watchdog watches the route)."""
        now = time.monotonic()
        if self._last_at is not None:  # the route's step time, between its tokens
            gap = now - self._last_at
            self._step_s = gap if self._step_s is None else 0.8 * self._step_s + 0.2 * gap
        self._progress_at = self._last_at = now
        return Arrived(result, now)

    def _scan(self, arrived: Arrived, detok: IncrementalDetokenizer, stops: StopMatcher) -> Event:
        """A token from the route as an event: its text goes through the stop strings first."""
        if self.client_gone():
            return ClientGone()
        result, now = arrived.result, arrived.at
        eog = self.tokens.is_eog(result.token_id)
        text = "" if eog else detok.feed(result.token_id)
        scan = None if eog else stops.feed(text)
        start = self._fed_chars
        if scan is None:
            self._arrived = (result, "", False, start)
        else:
            self._fed_chars += len(text)
            self._arrived = (result, scan.emit, scan.stopped, start)
        return TokenArrived(eog=eog, stopped=bool(scan and scan.stopped), at=now)

    def _emit(self) -> Delta:
        """The token that arrived goes to the client (counted, timed, with its logprobs)."""
        assert self._arrived is not None
        result, text, stopped, start = self._arrived
        if not self.output_ids:
            self.metrics.ttft.observe(time.monotonic() - self.started)
        at = result.sampled_ms
        if at is not None and self._last_sampled_ms is not None:
            self.metrics.tpot.observe(max(0.0, at - self._last_sampled_ms) / 1e3)
        self._last_sampled_ms = at
        self.output_ids.append(result.token_id)
        self.output_logprobs.append(result.logprob)
        self.metrics.generated_tokens.inc()
        if result.drafted:  # a verify step's first token: its kept drafts come first, then one more
            self.drafted += result.drafted
            self._kept_due = result.accepted
            self.metrics.accepted_per_trip.observe(result.accepted + 1)
        if self._kept_due:  # usage counts only the kept drafts the answer has (it may stop inside a step)
            self.accepted += 1
            self._kept_due -= 1
        self.telemetry.token(drafted=result.drafted, accepted=result.accepted, pipelined=result.pipelined)
        return Delta(text, self._logprobs_with(text, stopped, start, self._logprob(result)))

    def _logprobs_with(self, text: str, stopped: bool, start: int,
                       entries: list[TokenLogprob] | None) -> list[TokenLogprob] | None:
        """The logprobs that go out with a token's shown `text`: each token's once the text shown
        reaches where its own text begins (`start`, in characters of the answer), so none while
        its text is held (a stop string's possible start, part of a character). A stop string
        that ends the answer drops those still held: their text is the stop string, which the
        client never sees (as llama-server trims them). Usage still counts their tokens."""
        if entries is None:
            return None
        self._held_logprobs += [(start, e) for e in entries]
        self._shown_chars += len(text)
        out = [e for at, e in self._held_logprobs if at < self._shown_chars]
        self._held_logprobs = [] if stopped else [(at, e) for at, e in self._held_logprobs if at >= self._shown_chars]
        return out

    async def _carry_out(self, action: Action) -> Event | None:
        """Carry out one action; an event it leads to at once (a route granted or refused)."""
        match action:
            case StartRoute(session, kept):
                self._start_route(session, list(kept))
            case StopRoute():
                await self._end_driver(close=True)
            case Interrupt(failure):
                rc = self._rc
                if rc is not None and rc.session.route_id == failure.route_id:
                    rc.interrupt(failure)
            case AskRoute():
                return await self._ask_route(action)
            case Resumed(move, seconds):
                (self.metrics.move_seconds if move else self.metrics.restart_seconds).observe(seconds)
                (self.metrics.moves if move else self.metrics.restarts).inc(outcome="resumed")
            case MoveDeclined():
                self.metrics.moves.inc(outcome="declined")
            case Fail():
                self._fail(action)
        return None

    def _fail(self, action: Fail) -> None:
        last = action.last_phase.public
        if action.gone:
            self.telemetry.fail(action.reason, last_phase=last)  # type: ignore[arg-type]
            raise ClientGoneError(action.reason)
        failure = action.failure
        assert failure is not None
        if action.restart_failed:  # a restart (or move) began and never gave a token
            (self.metrics.moves if action.move else self.metrics.restarts).inc(outcome="failed")
        self.metrics.failures.inc(phase=failure.phase)
        self.telemetry.fail(failure.reason, last_phase=failure.phase)
        raise RouteFailedApiError(failure)

    async def _ask_route(self, ask: AskRoute) -> Event:
        assert self.reroute is not None
        f, sid = ask.failure, self.plan.session.session_id
        if ask.any_route:
            log.warning("session %s found no route off %s: any route", sid, f.node_id)
        elif ask.move:
            log.info("session %s moves off %s (%s)", sid, f.node_id, f.reason)
        else:
            # a failure naming no node (a stall, the hops gave up on a frozen gateway) lost no known hop
            what = f"lost {f.node_id}" if f.node_id else "had its route fail"
            log.warning("session %s %s in %s (%s): restart %d of %d on a new route", sid,
                        what, f.phase, f.reason, self.record.restarts, self.plan.max_restarts)
        if not ask.any_route:
            self.telemetry.restarting(self.record.restarts, f.reason, f.node_id, move=ask.move)
        try:
            session = await self.reroute(f, ask.epoch, ask.excluded, list(ask.keep), ask.keep_position,
                                         list(self.output_ids))
        except ApiError as exc:
            return RouteRefused(exc.message)
        return RouteGranted(session)

    def _start_route(self, session: RouteSession, kept: list[str]) -> None:
        """Drive `session` from a task of its own; a restart's route rebuilds what was generated."""
        if self.record.routes > 1:
            self.routes.append(session)
            self.route_starts.append(len(self.output_ids))
            self._kept_due = 0  # the old route's step ended with it
            if kept:
                self.metrics.restart_kept_hops.inc(len(kept))
            self.telemetry.routed(session.route_id, [h.node_id for h in session.hops], kept)
        self._progress_at, self._last_at, self._step_s = time.monotonic(), None, None
        history = [*self.plan.prompt_ids, *self.output_ids]
        budget = self.plan.max_tokens - len(self.output_ids)
        self._leaving = self._ran_out = False
        self._decided = asyncio.Event()
        self._driver = asyncio.create_task(self._drive(session, history, budget), name=f"route-{session.route_id}")

    async def _end_driver(self, *, close: bool) -> None:
        """End the route's task: with `close` the session is done with the route and releases
        it (the head stops after the step in flight); else it is aborted."""
        driver, self._driver = self._driver, None
        if driver is None:
            return
        self._leaving = close
        if self._rc is not None and self.output_ids:
            # done with this route for good (a stop, the end, a client that left): the answer
            # used the prompt's rows and each kept token but the last fed back; the head may
            # have run a few steps past it, which no hop then claims (RouteClient.used_rows)
            self._rc.used_rows = len(self.plan.prompt_ids) + len(self.output_ids)  # the ledger's cap: an EOG's row counts
        self._decided.set()
        if not driver.done() and not (close and self._ran_out):  # a finished run closes its route itself
            driver.cancel()
        await asyncio.gather(driver, return_exceptions=True)

    async def _drive(self, session: RouteSession, history: list[int], budget: int) -> None:
        """One route: open it, rebuild the history, run the head's Decode Run; every token and
        the way it ends go to the event queue."""
        put = self._events.put_nowait
        unwatch = self.watch(session.route_id, self._on_directive) if self.watch is not None else None
        phase: Literal["prefill", "decode"] = "prefill"
        try:
            async with self.open_route(session) as rc:
                self.route_opened, self._rc = True, rc
                watchdog = asyncio.create_task(self._watchdog(session, rc, min(len(history), rc.chunk_size)),
                                               name=f"stall-{session.session_id}")
                try:
                    first = await self._rebuild(rc, session, history)
                    self.metrics.prompt_tokens.inc(len(history))
                    phase = "decode"
                    put(self._arrival(first))
                    steps = decode_steps(self.tokens.is_eog(first.token_id), budget)
                    if steps:
                        async with contextlib.aclosing(
                                rc.decode_run(first.token_id, steps, self.tokens.eog_ids, self.plan.flush_ms,
                                              draft=speculates(self.plan.draft, session.hops))) as run:
                            async for result in run:
                                put(self._arrival(result))
                    watchdog.cancel()  # the route owes nothing more: no stall while the session catches up
                    self._ran_out = True
                    put(RunEnded())
                    # the close waits for the session's decision: a stop string it matched meanwhile
                    # sets the rows the answer used, which the close tells the hops
                    await self._decided.wait()
                except asyncio.CancelledError:
                    if not self._leaving:
                        raise
                    asyncio.current_task().uncancel()  # type: ignore[union-attr]  # done with the route: close it
                finally:
                    watchdog.cancel()
                    await asyncio.gather(watchdog, return_exceptions=True)
        except RouteFailedError as exc:
            put(RouteFailed(exc.failure, time.monotonic()))
        except Exception as exc:  # any other error of the route's driver still ends the session
            log.exception("session %s failed in %s", session.session_id, phase)
            put(RouteBroken(RouteFailure(session_id=session.session_id, route_id=session.route_id, phase=phase,
                                         reason=f"{type(exc).__name__}: {exc}", code="route_failed")))
        finally:
            self._rc = None
            if unwatch is not None:
                unwatch()

    def _on_directive(self, failure: RouteFailure) -> None:
        """The tracker aborted the route (a hop is lost) or orders the session off a hop."""
        self._events.put_nowait(MoveOrdered(failure) if failure.code == "moved" else RouteAborted(failure))

    async def _watchdog(self, session: RouteSession, rc: RouteClientLike, rows: int) -> None:
        """A Stalled event when the route shows no progress within stall_deadline (`rows`: its
        largest prefill frame's): a hop that neither answers nor fails (a partition the tracker
        does not see) loses the route. Before the first token, a route whose head has been quiet
        for `stall_s`, or is at its deadline, has its hops probed (`_probe`): the rows behind the
        head count as progress."""
        marks: tuple[HopMark, ...] | None = None
        probed = time.monotonic()
        while True:
            decoding = self.record.phase is Phase.DECODE
            limit = stall_deadline("decode" if decoding else "prefill", self._step_s, self.plan.stall_s, rows)
            now = time.monotonic()
            if not decoding and (now - max(self._progress_at, probed) >= self.plan.stall_s
                                 or now >= self._progress_at + limit):  # once more before calling it a stall
                marks, probed = await self._probe(rc, marks, probed)
                decoding = self.record.phase is Phase.DECODE
                limit = stall_deadline("decode" if decoding else "prefill", self._step_s, self.plan.stall_s, rows)
            wait = self._progress_at + limit - time.monotonic()
            if wait <= 0:
                log.warning("session %s: no progress on route %s for %.1f s", session.session_id,
                            session.route_id, limit)
                self._events.put_nowait(Stalled(RouteFailure(
                    session_id=session.session_id, route_id=session.route_id,
                    phase="decode" if decoding else "prefill",
                    reason=f"no progress for {limit:.1f} s (the stall deadline)", code="hop_stalled")))
                return
            await asyncio.sleep(min(wait, self.plan.stall_s / 4))  # the deadline shrinks once decode starts

    async def _probe(self, rc: RouteClientLike, before: tuple[HopMark, ...] | None,
                     probed: float) -> tuple[tuple[HopMark, ...], float]:
        """Ask every hop how far it got (each within half the stall timeout); progress, as of
        asking, when one moved since the last probe (`before`, asked at `probed`) and the head
        showed none since. The marks and when they were asked for."""
        asked = time.monotonic()
        marks = await rc.hop_marks(self.plan.stall_s / 2)
        if before is not None and self._progress_at <= probed and hops_moved(before, marks):
            self._progress_at = asked
        return marks, asked

    def _progress(self, done: int, total: int) -> None:
        self._progress_at = time.monotonic()
        self.telemetry.prefill_progress(done, total)

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

    async def _rebuild(self, rc: RouteClientLike, session: RouteSession, history: list[int]) -> FrameResult:
        """Put `history` (the prompt, then any tokens generated before a restart) into the
        route's KV; the route's token for the position after it.

        Stepwise (replays_by_prefill says which), the generated tokens go in stepwise prefill
        frames: each hop runs each of their rows as a model call of its own, as their decode
        steps did on the lost route, so the new route's KV and logits are bit for bit the lost
        route's and greedy or seeded answers go on exactly. With the default KV profile,
        llama.cpp's batched prefill of the same tokens gives other logits than its step-by-step
        decode (docs/shard-runtime.md, "One-row calls"); with the exact profile on every hop it
        gives the same bits, in a fraction of the time (docs/benchmarks.md, "Node loss")."""
        plan = self.plan
        if inbound_start(session.hops, 0) != 0:  # every route has a hop that starts empty
            raise RuntimeError(f"route {session.route_id} keeps every hop: nothing was lost")
        if len(history) == len(plan.prompt_ids):
            t0 = time.monotonic()
            first = await rc.prefill(history, on_progress=self._progress)
            self.prompt_ms = (time.monotonic() - t0) * 1000
            return first
        if replays_by_prefill(plan.replay, session.hops):
            self.batched_replays += 1
            self.metrics.restart_replays.inc(replay="batched")
            return await rc.prefill(history, on_progress=self._progress)
        self.metrics.restart_replays.inc(replay="stepwise")
        return await rc.prefill(history, on_progress=self._progress, stepwise_from=len(plan.prompt_ids))
