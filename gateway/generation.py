"""Drive one Route Session: prefill, the decode loop, stop conditions, telemetry and metrics."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Protocol

from gateway.errors import ClientGoneError, RouteFailedApiError
from gateway.metrics import GatewayMetrics
from gateway.openai_format import TokenLogprob, Usage
from gateway.telemetry import SessionTelemetry
from gateway.text_stream import IncrementalDetokenizer, StopMatcher
from schemas.frames import FrameResult, RouteFailedError
from schemas.route import Phase, RouteFailure, RouteSession

log = logging.getLogger("meshnet.gateway.generation")


class RouteClientLike(Protocol):
    """What the decode loop needs from gateway.route_client.RouteClient."""

    async def prefill(
        self, token_ids: Sequence[int], on_progress: Callable[[int, int], object] | None = None
    ) -> FrameResult: ...

    async def decode(self, token_id: int) -> FrameResult: ...

    def decode_run(
        self, token_id: int, steps: int, stop_ids: Iterable[int] = (), flush_ms: int = 0
    ) -> AsyncGenerator[FrameResult, None]: ...

    @property
    def results_ready(self) -> bool: ...


RouteClientFactory = Callable[[RouteSession], AbstractAsyncContextManager[RouteClientLike]]


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
    ) -> None:
        self.plan = plan
        self.tokens = tokens
        self.open_route = open_route
        self.telemetry = telemetry
        self.metrics = metrics
        self.started = started
        self.client_gone = client_gone
        self.output_ids: list[int] = []
        self.failure: RouteFailure | None = None
        self.route_opened = False  # the route client (which releases the route) was entered
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

    async def _results(self, rc: RouteClientLike, first: FrameResult) -> AsyncGenerator[FrameResult, None]:
        """Prefill's token, then the route's Decode Run: the head feeds each token back by
        itself, so detokenizing and writing a token overlap the route's next step."""
        yield first
        steps = decode_steps(self.tokens.is_eog(first.token_id), self.plan.max_tokens)
        if steps:
            run = rc.decode_run(first.token_id, steps, self.tokens.eog_ids, self.plan.flush_ms)
            self._rc = rc
            try:
                async for result in run:
                    yield result
            finally:
                self._rc = None
                await run.aclose()

    def more_ready(self) -> bool:
        """Whether the next token has already arrived (part of a batch the head sent at once):
        a streaming answer then writes this token's chunk together with the next ones."""
        return self._rc is not None and self._rc.results_ready

    def _check_client(self) -> None:
        if self.client_gone():
            raise ClientGoneError("client disconnected")

    async def run(self) -> AsyncIterator[Delta | Finished]:
        """Prefill, then decode until EOS/stop/length; raises RouteFailedApiError on failure."""
        plan, t = self.plan, self.telemetry
        session = plan.session
        detok = self.tokens.detokenizer()
        stops = StopMatcher(plan.stop)
        phase: Phase = "prefill"
        finish: str | None = None
        last_sampled_ms: float | None = None  # the tail's stamp of the previous output token
        try:
            async with self.open_route(session) as rc:
                self.route_opened = True
                t.set_phase("prefill")
                choice = await rc.prefill(plan.prompt_ids, on_progress=t.prefill_progress)
                self.metrics.prompt_tokens.inc(len(plan.prompt_ids))
                phase = "decode"
                t.set_phase("decode")
                results = self._results(rc, choice)
                try:
                    async for choice in results:
                        self._check_client()
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
                            self.metrics.generated_tokens.inc()
                            t.token()
                            scan = stops.feed(detok.feed(token))
                            scan_emit, stopped = scan.emit, scan.stopped
                            yield Delta(scan_emit, self._logprob(choice))
                        finish = finish_reason_for(
                            token_is_eog=eog, stopped=stopped,
                            generated=len(self.output_ids), max_tokens=plan.max_tokens,
                        )
                        if finish is not None:
                            break  # a stop string: the head stops after the step in flight
                finally:
                    await results.aclose()
                if finish is None:
                    raise RouteFailedError(RouteFailure(
                        session_id=session.session_id, route_id=session.route_id, phase="decode",
                        reason="the route's Decode Run ended before a stop condition", code="route_failed"))
                phase = "finalizing"
                t.set_phase("finalizing")
                if not stops.stopped:
                    tail = stops.feed(detok.flush()).emit + stops.flush()
                    if tail:
                        yield Delta(tail)
        except RouteFailedError as exc:
            self.failure = exc.failure
        except (ClientGoneError, GeneratorExit):
            t.fail("client disconnected", last_phase=phase)
            raise
        except asyncio.CancelledError:
            t.fail("cancelled (client disconnected or gateway shutting down)", last_phase=phase)
            raise
        except (OSError, ValueError, RuntimeError) as exc:
            log.exception("session %s failed in %s", session.session_id, phase)
            self.failure = _failure(session, phase, exc)
        if self.failure is not None:
            self.metrics.failures.inc(phase=self.failure.phase)
            t.fail(self.failure.reason, last_phase=self.failure.phase)
            raise RouteFailedApiError(self.failure)
        reason = finish or "stop"
        t.complete(reason)
        yield Finished(reason, Usage(len(plan.prompt_ids), len(self.output_ids)))
