"""POST /v1/chat/completions and POST /v1/completions: validate, route, then stream SSE chunks
or answer once. The two endpoints differ only in how a body becomes prompt ids (an `Endpoint`)
and how the answers look (an `AnswerFormat`); admission, routing and generation are one path."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from gateway.chat_request import (
    ALLOW_HEADER,
    POLICY_HEADER,
    RESTART_HEADER,
    VALIDATE_HEADER,
    ChatRequest,
    check_context,
    parse_chat_request,
    parse_json_body,
    restart_wanted,
    route_policy_wanted,
    validate_flagged,
)
from gateway.completion_request import CompletionRequest, parse_completion_request
from gateway.errors import (
    ApiError,
    ClientGoneError,
    InvalidRequestError,
    ModelNotFoundError,
    QueueRefusedError,
    RouteFailedApiError,
    RouteUnavailableError,
)
from gateway.generation import Delta, Finished, Generation, GenerationPlan, RestartRoute
from gateway.metrics import GatewayMetrics
from gateway.openai_format import (
    AnswerFormat,
    ChatFormat,
    ChunkFactory,
    TextFormat,
    TokenLogprob,
    sse_data,
)
from gateway.session_ids import (
    SESSION_HEADER,
    check_session_id,
    is_valid_session_id,
    new_session_id,
)
from gateway.state import (
    AUDIT,
    GATE,
    HUB,
    MESH,
    METRICS,
    MODEL,
    OPEN_ROUTE,
    ROUTER,
    SETTINGS,
    STREAMS,
    VAULT,
    WATCH,
)
from gateway.telemetry import SessionTelemetry
from gateway.tokenizer import ModelTokenizer
from gateway.validation import (
    SAMPLING_KEY,
    in_sample,
    new_digest_salt,
    replayable_sampling,
    routes_taken,
    validation_event,
)
from schemas.route import KeepHop, RouteFailure, RoutePolicy, RouteRequest, RouteSession
from schemas.sampling import SamplingParams
from schemas.validation import ReplayRecord

log = logging.getLogger("meshnet.gateway.chat")

def error_response(exc: ApiError, session_id: str | None = None) -> web.Response:
    """An OpenAI error body with the error's status and headers (and the session header when known)."""
    headers = exc.headers()
    if session_id:
        headers[SESSION_HEADER] = session_id
    return web.json_response(exc.body(), status=exc.status, headers=headers or None)


def _client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


CLIENT_CLOSED_REQUEST = 499  # status recorded (never delivered) when the client left


Request = ChatRequest | CompletionRequest


@dataclass(slots=True, frozen=True)
class Endpoint:
    """What one endpoint adds to the shared path: its body parser, how its request becomes
    prompt ids (run off the event loop; refuses what cannot fit `n_ctx`), its answers' shape."""

    parse: Callable[[dict[str, Any]], Request]
    encode: Callable[[ModelTokenizer, Request, int], list[int]]
    answer: Callable[[str, _Admitted, ModelTokenizer], AnswerFormat]


def _chat_answer(session_id: str, admitted: _Admitted, _tok: ModelTokenizer) -> AnswerFormat:
    return ChatFormat(ChunkFactory(f"chatcmpl-{session_id}", int(time.time()), admitted.model_name,
                                   include_usage=admitted.chat.include_usage))


def _text_answer(session_id: str, admitted: _Admitted, tok: ModelTokenizer) -> AnswerFormat:
    req = admitted.chat
    assert isinstance(req, CompletionRequest)
    echo = ""
    if req.echo:
        echo = req.prompt if isinstance(req.prompt, str) else b"".join(tok.token_bytes(t) for t in req.prompt).decode(
            "utf-8", "replace")
    return TextFormat(f"cmpl-{session_id}", int(time.time()), admitted.model_name,
                      include_usage=req.include_usage, echo=echo)


def _encode_chat(tok: ModelTokenizer, req: Request, n_ctx: int) -> list[int]:
    assert isinstance(req, ChatRequest)
    return tok.encode_chat([m.as_template_dict() for m in req.messages], n_ctx=n_ctx)


def _encode_text(tok: ModelTokenizer, req: Request, n_ctx: int) -> list[int]:
    assert isinstance(req, CompletionRequest)
    if isinstance(req.prompt, str):
        return tok.encode_text(req.prompt, n_ctx=n_ctx)
    if any(not 0 <= t < tok.n_vocab for t in req.prompt):
        raise InvalidRequestError(f"prompt holds a token id beyond this model's vocabulary of {tok.n_vocab}",
                                  param="prompt", code="invalid_value")
    return list(req.prompt)


CHAT = Endpoint(parse_chat_request, _encode_chat, _chat_answer)
TEXT = Endpoint(parse_completion_request, _encode_text, _text_answer)


@dataclass(slots=True)
class _Admitted:
    """A validated request with its prompt ids and its session's telemetry."""

    chat: Request
    prompt_ids: list[int]
    telemetry: SessionTelemetry
    model_name: str
    revision: str
    restart: bool  # a lost hop moves the session to a new route
    policy: RoutePolicy  # which nodes its routes may use
    sampling: SamplingParams  # what the tail samples with (a validated session's: replayable_sampling)
    sampled: bool = False  # kept for the validator's replay (--validate-rate, or flagged)
    flagged: bool = False  # the client asked for validation


async def _admit(request: web.Request, session_id: str, endpoint: Endpoint) -> _Admitted:
    """Everything that must pass before a request may wait for a route: body, model, context."""
    app = request.app
    served, mesh = app[MODEL], app[MESH]
    settings = app[SETTINGS]
    try:
        async with asyncio.timeout(settings.body_timeout):  # a body that never arrives holds nothing for long
            raw = await request.read()
    except TimeoutError:
        raise InvalidRequestError(f"request body not received within {settings.body_timeout:g} s",
                                  code="body_timeout", status=408) from None
    chat = endpoint.parse(parse_json_body(raw))
    restart = restart_wanted(chat.restart, request.headers.get(RESTART_HEADER), settings.restart)
    default = RoutePolicy(kind=settings.route_policy, allow_nodes=list(settings.allow_nodes))  # type: ignore[arg-type]
    policy = route_policy_wanted(chat.route_policy, request.headers.get(POLICY_HEADER),
                                 request.headers.get(ALLOW_HEADER), default)
    if not served.matches(chat.model, mesh):
        raise ModelNotFoundError(chat.model)
    if any(t >= served.tokenizer.n_vocab for t, _ in chat.sampling.logit_bias):
        raise InvalidRequestError(f"logit_bias names a token id beyond this model's vocabulary of "
                                  f"{served.tokenizer.n_vocab}", param="logit_bias", code="invalid_value")
    routable = mesh.find(served.revision)
    n_ctx = mesh.context_of(served.revision)
    # rendering and tokenizing never run on the event loop: many small messages can cost seconds
    prompt_ids = await asyncio.to_thread(endpoint.encode, served.tokenizer, chat, n_ctx)
    check_context(len(prompt_ids), chat.max_tokens, n_ctx)
    flagged = validate_flagged(chat.validate, request.headers.get(VALIDATE_HEADER))
    sampled = flagged or in_sample(session_id, settings.validate_rate, SAMPLING_KEY)
    # with validation on, every session runs as a sampled one would (logprobs asked, seeded): a
    # node reading the route's sampling cannot tell which sessions will be replayed
    replayable = sampled or settings.validate_rate > 0
    sampling = replayable_sampling(chat.sampling, secrets.randbits(63)) if replayable else chat.sampling
    telemetry = app[HUB].open(session_id, served.public_name(routable))
    telemetry.route_policy = policy.kind
    return _Admitted(chat, prompt_ids, telemetry, served.public_name(routable), served.revision, restart, policy,
                     sampling, sampled, flagged)


def _refused(metrics: GatewayMetrics, t: SessionTelemetry, exc: ApiError, session_id: str) -> web.Response:
    """The error answer of a request whose session failed (or never got a route)."""
    if not t.terminal:
        metrics.failures.inc(phase=t.phase)
        t.fail(exc.message)
    metrics.requests.inc(outcome=str(exc.status))
    return error_response(exc, session_id)


def _end_unfinished(metrics: GatewayMetrics, t: SessionTelemetry) -> None:
    """A session left without an outcome (cancelled, say) ends as failed."""
    if not t.terminal:
        metrics.failures.inc(phase=t.phase)
        t.fail("gateway stopped the session", last_phase=t.phase)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """OpenAI-compatible chat completions over a Route Session (waiting in the admission
    queue while no route has room)."""
    return await _handle(request, CHAT)


async def completions(request: web.Request) -> web.StreamResponse:
    """OpenAI's legacy text completions: a prompt (text or token ids) instead of messages."""
    return await _handle(request, TEXT)


async def _handle(request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
    """Admit, queue for a route, serve: the path both endpoints share."""
    started = time.monotonic()
    app = request.app
    metrics = app[METRICS]
    session_id = request.headers.get(SESSION_HEADER) or new_session_id()
    try:
        check_session_id(session_id)
        admitted = await _admit(request, session_id, endpoint)
    except ApiError as exc:
        metrics.requests.inc(outcome=str(exc.status))
        return error_response(exc, session_id if is_valid_session_id(session_id) else None)
    t = admitted.telemetry
    route_request = RouteRequest(
        model=admitted.revision, session_id=session_id, sampling=admitted.sampling,
        prompt_tokens=len(admitted.prompt_ids), policy=admitted.policy,
    )

    async def try_route(waited: bool) -> RouteSession | None:
        """A route, or None while every route is full (the request keeps its place)."""
        if not waited:
            t.set_phase("routing")  # a queued request stays `queued` until its route is granted
        try:
            return await app[ROUTER].create(route_request)
        except RouteUnavailableError as exc:
            if exc.route_code == "no_capacity":
                return None
            raise

    try:
        async with app[GATE].admitted(
            try_route, on_wait=t.queued, client_gone=lambda: _client_gone(request)
        ) as session:
            return await _serve(request, admitted, session, started, endpoint)
    except ClientGoneError:
        t.fail("client disconnected while queued")
        metrics.requests.inc(outcome="client_gone")
        return web.Response(status=CLIENT_CLOSED_REQUEST)
    except ApiError as exc:
        return _refused(metrics, t, exc, session_id)
    finally:
        _end_unfinished(metrics, t)


async def _serve(
    request: web.Request, admitted: _Admitted, session: RouteSession, started: float, endpoint: Endpoint
) -> web.StreamResponse:
    """Drive one admitted Route Session to its answer; the route is released before this returns."""
    app = request.app
    metrics = app[METRICS]
    t = admitted.telemetry
    session_id = session.session_id
    generation: Generation | None = None
    try:
        t.routed(session.route_id, [h.node_id for h in session.hops])
        max_tokens = check_context(len(admitted.prompt_ids), admitted.chat.max_tokens, session.n_ctx)
        settings = app[SETTINGS]
        generation = Generation(
            GenerationPlan(session, admitted.prompt_ids, max_tokens, admitted.chat.stop,
                           admitted.chat.sampling.logprobs, settings.token_flush_ms,
                           max_restarts=settings.max_restarts if admitted.restart else 0,
                           replay=settings.restart_replay,  # type: ignore[arg-type]
                           keep=settings.restart_keep == "on",
                           stall_s=settings.stall_timeout),
            tokens=app[MODEL].tokenizer, open_route=app[OPEN_ROUTE], telemetry=t,
            metrics=metrics, started=started, client_gone=lambda: _client_gone(request),
            reroute=_rerouter(app, admitted, session), watch=app[WATCH].watch,
        )
        fmt = endpoint.answer(session_id, admitted, app[MODEL].tokenizer)
        if admitted.chat.stream:
            return await _stream(request, admitted, generation, session_id, fmt)
        return await _complete(admitted, generation, session_id, fmt)
    except ApiError as exc:
        return _refused(metrics, t, exc, session_id)
    finally:
        _end_unfinished(metrics, t)
        _record_validation(app, session, admitted, generation, t)
        if generation is None or not generation.route_opened:
            # the route client never ran, so nothing else releases the route
            await app[ROUTER].release(session, "abort", t.failure_reason)


RESTART_ROUTE_WAIT_S = 10.0  # a restart waits this long for a route with room (then it fails)


def restart_session_id(session_id: str, epoch: int) -> str:
    """The Route Session id of a session's route of `epoch` (> 1): nodes and the tracker keep
    each route's session apart, the client keeps its own id."""
    suffix = f"-e{epoch}"
    return session_id[: 64 - len(suffix)] + suffix


def _rerouter(app: web.Application, admitted: _Admitted, first: RouteSession) -> RestartRoute:
    """Asks the tracker for a restart's route: same model and sampling, the lost nodes left out,
    room for the prompt and what was generated; while every such route is full it waits in the
    admission gate (keeping its place) for RESTART_ROUTE_WAIT_S at most."""

    async def reroute(failure: RouteFailure, epoch: int, excluded: frozenset[str], keep: list[KeepHop],
                      keep_position: int) -> RouteSession:
        request = RouteRequest(
            model=admitted.revision, session_id=restart_session_id(first.session_id, epoch),
            sampling=admitted.sampling, prompt_tokens=len(admitted.prompt_ids), epoch=epoch,
            move=failure.code == "moved",
            policy=admitted.policy.model_copy(update={"exclude_nodes": sorted(excluded)}),  # same policy
            keep=keep, keep_position=keep_position,
        )
        refusal: list[RouteUnavailableError] = []

        async def attempt() -> RouteSession | None:
            try:
                return await app[ROUTER].create(request)
            except RouteUnavailableError as exc:
                if exc.route_code != "no_capacity":
                    raise
                refusal[:] = [exc]
                return None

        session = await app[GATE].retry(attempt, RESTART_ROUTE_WAIT_S)
        if session is None:
            raise refusal[-1]
        return session

    return reroute


def _record_validation(
    app: web.Application, session: RouteSession, admitted: _Admitted,
    generation: Generation | None, t: SessionTelemetry,
) -> None:
    """Hand the ended session's validation AuditEvent to the background publisher (never waits)."""
    audit = app.get(AUDIT)
    if audit is None:
        return
    failed = t.phase == "failed"
    try:
        routes = list(zip(generation.routes, generation.route_starts, strict=True)) if generation else []
        sampled = admitted.sampled and not failed and generation is not None and bool(generation.output_ids)
        salt = new_digest_salt() if sampled else None  # the event's digests are under it; only the vault has it
        if salt is not None and generation is not None:  # kept before the event goes out: the validator asks on seeing it
            app[VAULT].keep(ReplayRecord(
                session_id=session.session_id, digest_salt=salt.hex(), prompt_ids=admitted.prompt_ids,
                output_ids=generation.output_ids, output_logprobs=generation.output_logprobs, sampling=admitted.sampling,
                routes=routes_taken(routes), prefill_chunk_size=app[SETTINGS].chunk_size or 0,
                private=admitted.policy.kind == "private", restart_replay=generation.restart_replay,
            ))
        event = validation_event(
            session, prompt_ids=admitted.prompt_ids,
            output_ids=generation.output_ids if generation is not None else (),
            finish_reason=t.finish_reason,
            failed_phase=(t.last_phase or "routing") if failed else None,
            failure_reason=t.failure_reason if failed else None,
            routes=routes, digest_salt=salt, flagged=admitted.flagged,
        )
    except Exception:  # never in the way of the response or of releasing the route
        log.exception("session %s: validation event not built", session.session_id)
        return
    audit.offer(event)


async def _complete(admitted: _Admitted, generation: Generation, session_id: str,
                    fmt: AnswerFormat) -> web.Response:
    """Run the whole generation, then answer with one object."""
    parts: list[str] = []
    logprobs: list[TokenLogprob] | None = [] if admitted.chat.sampling.logprobs else None
    finished: Finished | None = None
    try:
        async for ev in generation.run():
            if isinstance(ev, Delta):
                parts.append(ev.text)
                if logprobs is not None and ev.logprobs:
                    logprobs.extend(ev.logprobs)
            else:
                finished = ev
    except ClientGoneError:
        generation.metrics.requests.inc(outcome="client_gone")
        return web.Response(status=CLIENT_CLOSED_REQUEST)
    assert finished is not None
    body = fmt.body("".join(parts), finished.finish_reason, finished.usage, logprobs)
    generation.metrics.requests.inc(outcome="200")
    return web.json_response(body, headers={SESSION_HEADER: session_id, POLICY_HEADER: admitted.policy.kind})


async def _stream(
    request: web.Request, admitted: _Admitted, generation: Generation, session_id: str, fmt: AnswerFormat
) -> web.StreamResponse:
    """Send SSE chunks as tokens arrive; errors become an error chunk."""
    resp = web.StreamResponse(headers={
        "content-type": "text/event-stream", "cache-control": "no-cache",
        SESSION_HEADER: session_id, POLICY_HEADER: admitted.policy.kind,
    })
    await resp.prepare(request)
    streams = request.app[STREAMS]
    task = asyncio.current_task()
    if task is not None:
        streams.add(task)
    events = generation.run()
    outcome = "200"
    held: list[bytes] = []  # chunks of tokens that arrived together, written in one go
    try:
        opening = fmt.opening()
        if opening is not None:
            await resp.write(sse_data(opening))
        async for ev in events:
            if isinstance(ev, Delta):
                if ev.text or ev.logprobs:
                    held.append(sse_data(fmt.delta(ev.text, ev.logprobs)))
                if held and not generation.more_ready():
                    await resp.write(b"".join(held))
                    held.clear()
                continue
            held.append(sse_data(fmt.finish(ev.finish_reason)))
            if admitted.chat.include_usage:
                held.append(sse_data(fmt.usage(ev.usage)))
            held.append(sse_data("[DONE]"))
            await resp.write(b"".join(held))
            held.clear()
    except RouteFailedApiError as exc:
        outcome = "route_failed"
        await _write_quietly(resp, b"".join([*held, sse_data(exc.body())]))
    except (ConnectionResetError, ClientGoneError):
        outcome = "client_gone"
        log.info("client left session %s", session_id)
    except asyncio.CancelledError:
        if request.app[GATE].closed:  # the gateway shuts down: the client is told so, and the stream ends
            outcome = "shutting_down"
            gone = QueueRefusedError("the gateway is shutting down; retry later", code="shutting_down", retry_after=1)
            await _write_quietly(resp, b"".join([*held, sse_data(gone.body()), sse_data("[DONE]")]))
            await _write_eof_quietly(resp)
        raise
    finally:
        await events.aclose()
        if task is not None:
            streams.discard(task)
        generation.metrics.requests.inc(outcome=outcome)
    await _write_eof_quietly(resp)
    return resp


async def _write_quietly(resp: web.StreamResponse, data: bytes) -> None:
    try:
        await resp.write(data)
    except ConnectionResetError:
        pass


async def _write_eof_quietly(resp: web.StreamResponse) -> None:
    try:
        await resp.write_eof()
    except ConnectionResetError:
        pass
