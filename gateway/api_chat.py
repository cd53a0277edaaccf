"""POST /v1/chat/completions and POST /v1/completions: validate, route, then stream SSE chunks
or answer once. The two endpoints differ only in how a body becomes prompt ids (an `Endpoint`)
and how the answers look (an `AnswerFormat`); admission, routing and generation are one path."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from gateway.api_keys import key_owner
from gateway.chat_request import (
    ALLOW_HEADER,
    POLICY_HEADER,
    RESTART_HEADER,
    SPECULATIVE_HEADER,
    VALIDATE_HEADER,
    ChatRequest,
    check_context,
    parse_chat_request,
    parse_json_body,
    restart_wanted,
    route_policy_wanted,
    speculative_wanted,
    validate_flagged,
)
from gateway.chat_template import TemplateError
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
from gateway.headers import list_header
from gateway.held_wait import HELD_WAIT_MAX_S, LOST_NODE_WAIT_S, HeldWait
from gateway.metrics import GatewayMetrics
from gateway.neutral_params import thinks
from gateway.openai_format import (
    AnswerFormat,
    ChatFormat,
    ChunkFactory,
    TextFormat,
    TokenLogprob,
    Usage,
    sse_data,
)
from gateway.request_body import read_body
from gateway.response_format import check_compiles
from gateway.routing import other_models_error, revision_mismatch_error
from gateway.session_ids import (
    SESSION_HEADER,
    check_session_id,
    is_valid_session_id,
    new_session_id,
)
from gateway.session_machine import NODE_GONE
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
from gateway.tool_calls import JsonFallback, ToolCallFormat, dialect_for
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
from schemas.session_id import derived_session_id
from schemas.validation import ReplayRecord

log = logging.getLogger("meshnet.gateway.chat")

def error_response(exc: ApiError, session_id: str | None = None) -> web.Response:
    """An OpenAI error body with the error's status and headers (and the session header when known)."""
    headers = exc.headers()
    if session_id:
        headers[SESSION_HEADER] = session_id
    return web.json_response(exc.body(), status=exc.status, headers=headers or None)


def client_gone(request: web.Request) -> bool:
    """Whether the request's client has closed its connection."""
    transport = request.transport
    return transport is None or transport.is_closing()


def queue_owner(request: web.Request) -> str | None:
    """Whose share of the admission queue a request takes: its API key's digest when the
    gateway has keys; None on an open gateway, where a token is anyone's choice (a fresh one
    per request must not buy a fresh place near the head of the line)."""
    if not request.app[SETTINGS].api_keys:
        return None
    return key_owner(request.headers.get("Authorization"))


CLIENT_CLOSED_REQUEST = 499  # status recorded (never delivered) when the client left


Request = ChatRequest | CompletionRequest


@dataclass(slots=True, frozen=True)
class Endpoint:
    """What one endpoint adds to the shared path: its body parser, how its request becomes
    prompt ids (run off the event loop; refuses what cannot fit `n_ctx`), its answers' shape."""

    parse: Callable[[dict[str, Any]], Request]
    encode: Callable[[ModelTokenizer, Request, int], list[int]]
    answer: Callable[[str, _Admitted, ModelTokenizer], AnswerFormat]


def _chat_answer(session_id: str, admitted: _Admitted, tok: ModelTokenizer) -> AnswerFormat:
    chat = ChatFormat(ChunkFactory(f"chatcmpl-{session_id}", int(time.time()), admitted.model_name,
                                   include_usage=admitted.chat.include_usage))
    tools = getattr(admitted.chat, "tools", None)
    return chat if tools is None else ToolCallFormat(chat, dialect_for(tok.template.source), tools)


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
    if req.reasoning_auto and thinks(tok.template.source):
        raise InvalidRequestError(
            'reasoning_format "auto" would split this model\'s thoughts into reasoning_content (its chat template '
            'has thinking markers), which this gateway does not do; use "none" (thoughts stay in the content)',
            param="reasoning_format", code="unsupported_parameter")
    given = [m.as_template_dict() for m in req.messages]
    dialect = dialect_for(tok.template.source)
    messages, variables = dialect.render(given, req.tools)
    try:
        return tok.encode_chat(messages, n_ctx=n_ctx, variables=variables)
    except TemplateError:
        # the fallback's own system message, refused by a template without a system role: the
        # tools go into the first user turn (a system message the client sent stays an error)
        if not (isinstance(dialect, JsonFallback) and req.tools and all(m["role"] != "system" for m in given)):
            raise
    messages, variables = JsonFallback(in_system=False).render(given, req.tools)
    return tok.encode_chat(messages, n_ctx=n_ctx, variables=variables)


def _encode_text(tok: ModelTokenizer, req: Request, n_ctx: int) -> list[int]:
    assert isinstance(req, CompletionRequest)
    if req.suffix:
        if not isinstance(req.prompt, str):
            raise InvalidRequestError("suffix needs a text prompt", param="suffix", code="invalid_value")
        if tok.fim_ids is None:
            raise InvalidRequestError("suffix (fill in the middle) needs a model with FIM tokens; this one has none",
                                      param="suffix", code="unsupported_value")
        return tok.encode_infill(req.prompt, req.suffix, n_ctx=n_ctx, param=req.prompt_param)
    if isinstance(req.prompt, str):
        return tok.encode_text(req.prompt, n_ctx=n_ctx, param=req.prompt_param)
    if any(not 0 <= t < tok.n_vocab for t in req.prompt):
        raise InvalidRequestError(f"{req.prompt_param} holds a token id beyond this model's vocabulary of "
                                  f"{tok.n_vocab}", param=req.prompt_param, code="invalid_value")
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
    speculative: bool  # the head may draft tokens
    policy: RoutePolicy  # which nodes its routes may use
    sampling: SamplingParams  # what the tail samples with (a validated session's: replayable_sampling)
    sampled: bool = False  # kept for the validator's replay (--validate-rate, or flagged)
    flagged: bool = False  # the client asked for validation


async def _admit(request: web.Request, session_id: str, endpoint: Endpoint) -> _Admitted:
    """Everything that must pass before a request may wait for a route: body, model, context."""
    app = request.app
    served, mesh = app[MODEL], app[MESH]
    settings = app[SETTINGS]
    chat = endpoint.parse(parse_json_body(await read_body(request)))
    restart = restart_wanted(chat.restart, request.headers.get(RESTART_HEADER), settings.restart)
    speculative = speculative_wanted(chat.speculative, request.headers.get(SPECULATIVE_HEADER))
    default = RoutePolicy(kind=settings.route_policy, allow_nodes=list(settings.allow_nodes))  # type: ignore[arg-type]
    policy = route_policy_wanted(chat.route_policy, request.headers.get(POLICY_HEADER),
                                 list_header(request.headers, ALLOW_HEADER), default)
    if not served.matches(chat.model, mesh):
        raise ModelNotFoundError(chat.model)
    if any(t >= served.tokenizer.n_vocab for t, _ in chat.sampling.logit_bias):
        raise InvalidRequestError(f"logit_bias names a token id beyond this model's vocabulary of "
                                  f"{served.tokenizer.n_vocab}", param="logit_bias", code="invalid_value")
    sampling = chat.sampling  # a forced tool call's constraint first: a schema that cannot be is a 400
    tools = getattr(chat, "tools", None)
    if tools is not None and tools.forced:  # the call is always produced, and always valid
        try:
            constraint = dialect_for(served.tokenizer.template.source).constraint(tools)
        except ValueError as exc:  # the tools' schema is too large for a constraint
            raise InvalidRequestError(f"invalid tools: {exc}", param="tools", code="invalid_value") from None
        if constraint is not None:
            check_compiles(constraint, "tools")  # a tool's parameters the grammar compiler refuses
        sampling = sampling.model_copy(update={"constraint": constraint})
    routable = mesh.find(served.revision)
    n_ctx = mesh.context_of(served.revision)
    # rendering and tokenizing never run on the event loop: many small messages can cost seconds
    prompt_ids = await asyncio.to_thread(endpoint.encode, served.tokenizer, chat, n_ctx)
    check_context(len(prompt_ids), chat.max_tokens, n_ctx, chat.prompt_param)
    flagged = validate_flagged(chat.validate, request.headers.get(VALIDATE_HEADER))
    sampled = flagged or in_sample(session_id, settings.validate_rate, SAMPLING_KEY)
    # with validation on, every session runs as a sampled one would (logprobs asked, seeded): a
    # node reading the route's sampling cannot tell which sessions will be replayed
    replayable = sampled or settings.validate_rate > 0
    sampling = replayable_sampling(sampling, secrets.randbits(63)) if replayable else sampling
    telemetry = app[HUB].open(session_id, served.public_name(routable))
    telemetry.route_policy = policy.kind
    return _Admitted(chat, prompt_ids, telemetry, served.public_name(routable), served.revision, restart,
                     speculative, policy, sampling, sampled, flagged)


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
    if admitted.chat.choices > 1:
        return await _serve_choices(request, admitted, session_id, started, endpoint)
    try:
        async with app[GATE].admitted(
            route_asker(app, admitted, session_id), on_wait=t.queued, client_gone=lambda: client_gone(request),
            owner=queue_owner(request),
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


def route_asker(app: web.Application, admitted: _Admitted,
                session_id: str) -> Callable[[bool], Awaitable[RouteSession | None]]:
    """The admission gate's ask for a session's route: a route, or None while every route is
    full (the request keeps its place)."""
    t = admitted.telemetry
    route_request = RouteRequest(
        model=admitted.revision, session_id=session_id, sampling=admitted.sampling,
        prompt_tokens=len(admitted.prompt_ids), policy=admitted.policy,
        context_tokens=len(admitted.prompt_ids) + (admitted.chat.max_tokens or 1),
    )

    held = HeldWait()

    async def try_route(waited: bool) -> RouteSession | None:
        if not waited:
            t.set_phase("routing")  # a queued request stays `queued` until its route is granted
        try:
            return await app[ROUTER].create(route_request)
        except RouteUnavailableError as exc:
            if exc.route_code == "no_capacity" or held.waits(exc):  # (a node held out after a loss: it queues)
                return None
            served = app[MODEL]
            if exc.route_code == "no_nodes" and (others := app[MESH].other_revisions(served.aliases, served.revision)):
                raise revision_mismatch_error(served.revision, others) from exc
            if exc.route_code == "no_nodes" and (models := app[MESH].live_models()):
                raise other_models_error(exc, models) from exc
            raise

    return try_route


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
        generation = _generation(request, admitted, session, started)
        fmt = endpoint.answer(session_id, admitted, app[MODEL].tokenizer)
        if admitted.chat.stream:
            return await _stream(request, admitted, generation, session_id, fmt)
        return await _complete(admitted, generation, session_id, fmt)
    except ApiError as exc:
        return _refused(metrics, t, exc, session_id)
    finally:
        await _ended(app, admitted, session, generation)


def _generation(request: web.Request, admitted: _Admitted, session: RouteSession, started: float) -> Generation:
    """The Generation that drives an admitted Route Session (ApiError: its prompt cannot fit)."""
    app = request.app
    t = admitted.telemetry
    t.routed(session.route_id, [h.node_id for h in session.hops])
    max_tokens = check_context(len(admitted.prompt_ids), admitted.chat.max_tokens, session.n_ctx, admitted.chat.prompt_param)
    settings = app[SETTINGS]
    return Generation(
        GenerationPlan(session, admitted.prompt_ids, max_tokens, admitted.chat.stop,
                       admitted.chat.sampling.logprobs, settings.token_flush_ms,
                       max_restarts=settings.max_restarts if admitted.restart else 0,
                       replay=settings.restart_replay,  # type: ignore[arg-type]
                       keep=settings.restart_keep == "on",
                       stall_s=settings.stall_timeout,
                       draft=settings.draft if admitted.speculative else 0),
        tokens=app[MODEL].tokenizer, open_route=app[OPEN_ROUTE], telemetry=t,
        metrics=app[METRICS], started=started, client_gone=lambda: client_gone(request),
        reroute=_rerouter(app, admitted, session), watch=app[WATCH].watch,
    )


async def _ended(app: web.Application, admitted: _Admitted, session: RouteSession,
                 generation: Generation | None) -> None:
    """After a session's answer: its telemetry ends, its validation event is handed over, and
    its route is released if the route client never ran (nothing else would)."""
    t = admitted.telemetry
    _end_unfinished(app[METRICS], t)
    _record_validation(app, session, admitted, generation, t)
    if generation is None or not generation.route_opened:
        await app[ROUTER].release(session, "abort", t.failure_reason)


RESTART_ROUTE_WAIT_S = 10.0  # a restart waits this long for a route with room (then it fails)
# what a restart asks again for, within RESTART_ROUTE_WAIT_S: before, a node lost while the
# tracker did not answer (nats-server frozen for 8 s, a tracker restarting) failed the stream
# after one --route-timeout, though the tracker answered again seconds later
RESTART_WAITS_FOR = frozenset({"no_capacity", "tracker_timeout"})
# a restart that found no route without its lost hop, and whose any-route ask the tracker refuses
# only because it holds that node out after the loss, waits for it (gateway/held_wait.py): before,
# one connection reset between two live hops failed the answer of a mesh without a replica
RESTART_ASKS_FOR_S = max(RESTART_ROUTE_WAIT_S, HELD_WAIT_MAX_S + LOST_NODE_WAIT_S)


def restart_session_id(session_id: str, epoch: int) -> str:
    """The Route Session id of a session's route of `epoch` (> 1): nodes and the tracker keep
    each route's session apart, the client keeps its own id."""
    return derived_session_id(session_id, f"-e{epoch}")


def _rerouter(app: web.Application, admitted: _Admitted, first: RouteSession) -> RestartRoute:
    """Asks the tracker for a restart's route: same model and sampling, the lost nodes left out,
    room for the prompt and what was generated; while every such route is full it waits in the
    admission gate (keeping its place) for RESTART_ROUTE_WAIT_S at most."""

    async def reroute(failure: RouteFailure, epoch: int, excluded: frozenset[str], keep: list[KeepHop],
                      keep_position: int, generated: list[int]) -> RouteSession:
        sampling = admitted.sampling  # a tail whose choice depends on what came before starts from it
        if sampling.stateful:
            sampling = sampling.model_copy(update={"generated": tuple(generated)})
        request = RouteRequest(
            model=admitted.revision, session_id=restart_session_id(first.session_id, epoch),
            sampling=sampling, prompt_tokens=len(admitted.prompt_ids), epoch=epoch,
            context_tokens=len(admitted.prompt_ids) + (admitted.chat.max_tokens or 1),
            move=failure.code == "moved",
            policy=admitted.policy.model_copy(update={"exclude_nodes": sorted(excluded)}),  # same policy
            keep=keep, keep_position=keep_position,
        )
        refusal: list[RouteUnavailableError] = []
        lost = failure.node_id if failure.code in NODE_GONE and failure.node_id not in excluded else None
        began, held = time.monotonic(), HeldWait(lost)

        async def attempt() -> RouteSession | None:
            try:
                return await app[ROUTER].create(request)
            except RouteUnavailableError as exc:
                # a full mesh, or no tracker answering (the bus or the only tracker frozen, or
                # restarting): both pass; so does a lost node the tracker holds out. A
                # tracker's refusal of any other kind does not.
                full = exc.route_code in RESTART_WAITS_FOR and time.monotonic() - began < RESTART_ROUTE_WAIT_S
                if not full and not held.waits(exc):
                    raise
                refusal[:] = [exc]
                return None

        session = await app[GATE].retry(attempt, RESTART_ASKS_FOR_S)
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
            app[METRICS].sampled.inc()
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
    body = fmt.body("".join(parts), finished.finish_reason, finished.usage, logprobs, finished.cut)
    generation.metrics.requests.inc(outcome="200")
    return web.json_response(body, headers={SESSION_HEADER: session_id, POLICY_HEADER: admitted.policy.kind})


def _chunks(fmt: AnswerFormat) -> ChunkFactory:
    """The chunk builder of a chat answer's format (with tools or without)."""
    return fmt.inner.chunks if isinstance(fmt, ToolCallFormat) else fmt.chunks  # type: ignore[attr-defined]


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
    progress = getattr(admitted.chat, "return_progress", False)
    try:
        opening = fmt.opening()
        if opening is not None:
            await _send(request, resp, sse_data(opening))
        async for ev in events:
            if progress:  # the first token (or the end) came: the route has processed the prompt
                held.append(sse_data(_chunks(fmt).prompt_progress(len(admitted.prompt_ids), generation.prompt_ms)))
                progress = False
            if isinstance(ev, Delta):
                if ev.text or ev.logprobs:
                    held.extend(sse_data(c) for c in fmt.delta(ev.text, ev.logprobs))
                if held and not generation.more_ready():
                    await _send(request, resp, b"".join(held))
                    held.clear()
                continue
            held.extend(sse_data(c) for c in fmt.finish(ev.finish_reason, ev.cut))
            if admitted.chat.include_usage:
                held.append(sse_data(fmt.usage(ev.usage)))
            held.append(sse_data("[DONE]"))
            await _send(request, resp, b"".join(held))
            held.clear()
    except RouteFailedApiError as exc:
        outcome = "route_failed"
        await _write_quietly(resp, b"".join([*held, sse_data(exc.body())]))
    except (ConnectionError, ClientGoneError):  # a reset, or the plain "Connection lost" of a write
        outcome = "client_gone"                   # that waited on a client that had stopped reading
        log.info("client left session %s", session_id)
    except asyncio.CancelledError:
        if request.app[GATE].closed:  # the gateway shuts down: the client is told so, and the stream ends
            outcome = "shutting_down"
            await _end_for_shutdown(resp, held)
        raise
    finally:
        await events.aclose()
        if task is not None:
            streams.discard(task)
        generation.metrics.requests.inc(outcome=outcome)
    await _write_eof_quietly(resp)
    return resp


async def _end_for_shutdown(resp: web.StreamResponse, held: list[bytes]) -> None:
    """End a stream the gateway's shutdown cuts: the chunks held, a `shutting_down` error, [DONE]."""
    gone = QueueRefusedError("the gateway is shutting down; retry later", code="shutting_down", retry_after=1)
    await _write_quietly(resp, b"".join([*held, sse_data(gone.body()), sse_data("[DONE]")]))
    await _write_eof_quietly(resp)


async def _send(request: web.Request, resp: web.StreamResponse, data: bytes) -> None:
    """Write an answer's stream on to its client. A client that takes nothing of it for
    `write_timeout` seconds (it stopped reading: the write waits for its full buffers) has left:
    its connection is dropped, and ClientGoneError ends its sessions, which releases their routes
    (else a reader that never reads holds every hop's Hot KV State, and a session slot, for as
    long as it keeps its connection)."""
    timeout = request.app[SETTINGS].write_timeout
    try:
        async with asyncio.timeout(timeout):
            await resp.write(data)
    except TimeoutError:
        if request.transport is not None:
            request.transport.abort()
        raise ClientGoneError(f"the client read nothing of its stream for {timeout:g} s") from None


async def _write_quietly(resp: web.StreamResponse, data: bytes) -> None:
    try:
        await resp.write(data)
    except ConnectionError:
        pass


async def _write_eof_quietly(resp: web.StreamResponse) -> None:
    try:
        await resp.write_eof()
    except ConnectionError:
        pass


# -- n > 1: several choices, each its own Route Session --------------------------------------

class Routed:
    """Choice 0 got its route: a streamed answer may send its headers (before this, a refusal
    is still answered with its own status, as one choice's is)."""


ChoiceEvent = tuple[int, "Routed | Delta | Finished | Exception"]


def choice_session_id(session_id: str, index: int) -> str:
    """The Route Session id of choice `index` (> 0) of a request (the client's id is choice 0's)."""
    return derived_session_id(session_id, f"-n{index}")


async def _choice(app: web.Application, admitted: _Admitted, session_id: str, index: int,
                  endpoint: Endpoint) -> _Admitted:
    """Choice `index` of a request: its own session, telemetry and seed (the request's + index),
    and in a batch of completion prompts, its prompt (the n choices of each prompt in turn)."""
    sampling = admitted.sampling
    if sampling.seed is not None:
        sampling = sampling.model_copy(update={"seed": (sampling.seed + index) % 2**63})
    chat, prompt_ids = admitted.chat, admitted.prompt_ids
    if isinstance(chat, CompletionRequest) and index // chat.n > 0:
        chat = dataclasses.replace(chat, prompt=chat.prompts[index // chat.n], batch_index=index // chat.n)
        n_ctx = app[MESH].context_of(admitted.revision)
        prompt_ids = await asyncio.to_thread(endpoint.encode, app[MODEL].tokenizer, chat, n_ctx)
        check_context(len(prompt_ids), chat.max_tokens, n_ctx, chat.prompt_param)  # as _admit does the first
    telemetry = app[HUB].open(session_id, admitted.model_name)
    telemetry.route_policy = admitted.policy.kind
    return dataclasses.replace(admitted, chat=chat, prompt_ids=prompt_ids, telemetry=telemetry, sampling=sampling)


async def _run_choice(request: web.Request, index: int, admitted: _Admitted, session_id: str, started: float,
                      out: asyncio.Queue[ChoiceEvent], after: asyncio.Event | None, prefilled: asyncio.Event) -> None:
    """Admit, route and generate one choice, putting its events (or its error) on `out`. It waits
    for `after` (choice 0's first token) so that its prompt's rows are on the hops to share."""
    app, t = request.app, admitted.telemetry
    try:
        if after is not None:
            await after.wait()
        # choice 0 queues as any request; the others belong to a request already taken
        async with app[GATE].admitted(route_asker(app, admitted, session_id), on_wait=t.queued,
                                      client_gone=lambda: client_gone(request), bounded=index == 0,
                                      owner=queue_owner(request)) as session:
            generation: Generation | None = None
            if index == 0:
                await out.put((index, Routed()))
            try:
                generation = _generation(request, admitted, session, started)
                async for ev in generation.run():
                    prefilled.set()
                    await out.put((index, ev))
            finally:
                await _ended(app, admitted, session, generation)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        if isinstance(exc, ApiError) and not t.terminal:
            t.fail(exc.message)
        await out.put((index, exc))
    finally:
        prefilled.set()
        _end_unfinished(app[METRICS], t)


async def _serve_choices(request: web.Request, admitted: _Admitted, session_id: str, started: float,
                         endpoint: Endpoint) -> web.StreamResponse:
    """n > 1: every choice is its own Route Session; choice 0 goes first, the others once its
    prompt is on the hops (they reuse its rows there: nodes/shared_prefix.py). One answer
    gathers them, each under its index; usage counts the prompt once."""
    app, n = request.app, admitted.chat.choices
    sids = [session_id, *(choice_session_id(session_id, i) for i in range(1, n))]
    choices = [admitted]
    try:
        for i in range(1, n):
            choices.append(await _choice(app, admitted, sids[i], i, endpoint))
    except ApiError as exc:  # a batch's later prompt that cannot fit: no choice is left open
        for choice in choices:
            choice.telemetry.fail(exc.message)
        app[METRICS].requests.inc(outcome=str(exc.status))
        return error_response(exc, session_id)
    fmts = [endpoint.answer(session_id, c, app[MODEL].tokenizer) for c in choices]  # one answer: one id
    per = admitted.chat.n  # choices per prompt: usage counts each prompt once
    prompt_tokens = sum(len(c.prompt_ids) for c in choices[::per])
    events: asyncio.Queue[ChoiceEvent] = asyncio.Queue()
    first = asyncio.Event()
    tasks = [asyncio.create_task(_run_choice(request, i, c, sids[i], started, events, None if i == 0 else first,
                                             first if i == 0 else asyncio.Event()))
             for i, c in enumerate(choices)]
    try:
        if admitted.chat.stream:
            return await _stream_choices(request, admitted, fmts, events, session_id, prompt_tokens)
        return await _complete_choices(app, admitted, fmts, events, session_id, prompt_tokens)
    except ClientGoneError:
        app[METRICS].requests.inc(outcome="client_gone")
        return web.Response(status=CLIENT_CLOSED_REQUEST)
    except ApiError as exc:
        app[METRICS].requests.inc(outcome=str(exc.status))
        return error_response(exc, session_id)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _indexed(chunks: list[dict[str, Any]], index: int) -> list[dict[str, Any]]:
    for chunk in chunks:
        for choice in chunk["choices"]:
            choice["index"] = index
    return chunks


async def _complete_choices(app: web.Application, admitted: _Admitted, fmts: list[AnswerFormat],
                            events: asyncio.Queue[ChoiceEvent], session_id: str, prompt_tokens: int) -> web.Response:
    n = len(fmts)
    parts: list[list[str]] = [[] for _ in range(n)]
    logprobs: list[list[TokenLogprob] | None] = [[] if admitted.chat.sampling.logprobs else None for _ in range(n)]
    finished: list[Finished | None] = [None] * n
    while any(f is None for f in finished):
        i, ev = await events.get()
        if isinstance(ev, Exception):
            raise ev
        if isinstance(ev, Routed):
            continue
        if isinstance(ev, Delta):
            parts[i].append(ev.text)
            if logprobs[i] is not None and ev.logprobs:
                logprobs[i].extend(ev.logprobs)  # type: ignore[union-attr]
        else:
            finished[i] = ev
    done = [f for f in finished if f is not None]
    bodies = [fmts[i].body("".join(parts[i]), done[i].finish_reason, done[i].usage, logprobs[i], done[i].cut)
              for i in range(n)]
    body = bodies[0]
    body["choices"] = [_indexed([b], i)[0]["choices"][0] for i, b in enumerate(bodies)]
    body["usage"] = Usage.total(prompt_tokens, [f.usage for f in done]).as_dict()
    app[METRICS].requests.inc(outcome="200")
    return web.json_response(body, headers={SESSION_HEADER: session_id, POLICY_HEADER: admitted.policy.kind})


async def _stream_choices(request: web.Request, admitted: _Admitted, fmts: list[AnswerFormat],
                          events: asyncio.Queue[ChoiceEvent], session_id: str, prompt_tokens: int) -> web.StreamResponse:
    _, ev = await events.get()  # choice 0's first event: Routed, or why it got no route
    if isinstance(ev, Exception):
        raise ev  # a 503 queue_full (with Retry-After) or routing error, as one choice's, not an SSE error
    resp = web.StreamResponse(headers={"content-type": "text/event-stream", "cache-control": "no-cache",
                                       SESSION_HEADER: session_id, POLICY_HEADER: admitted.policy.kind})
    await resp.prepare(request)
    streams, task = request.app[STREAMS], asyncio.current_task()
    if task is not None:  # the gateway's shutdown stops it as it stops one choice's stream
        streams.add(task)
    finished: list[Finished | None] = [None] * len(fmts)
    try:
        opening = [_indexed([o], i) for i, f in enumerate(fmts) if (o := f.opening()) is not None]
        await _send(request, resp, b"".join(sse_data(c) for chunks in opening for c in chunks))
        while any(f is None for f in finished):
            i, ev = await events.get()
            if isinstance(ev, Exception):
                raise ev
            if isinstance(ev, Delta):
                chunks = fmts[i].delta(ev.text, ev.logprobs) if ev.text or ev.logprobs else []
            else:
                finished[i], chunks = ev, fmts[i].finish(ev.finish_reason, ev.cut)
            await _send(request, resp, b"".join(sse_data(c) for c in _indexed(chunks, i)))
        tail = []
        if admitted.chat.include_usage:
            done = [f for f in finished if f is not None]
            tail.append(sse_data(fmts[0].usage(Usage.total(prompt_tokens, [f.usage for f in done]))))
        await _send(request, resp, b"".join([*tail, sse_data("[DONE]")]))
        request.app[METRICS].requests.inc(outcome="200")
    except RouteFailedApiError as exc:  # as one choice's stream: the error chunk ends it, without [DONE]
        request.app[METRICS].requests.inc(outcome="route_failed")
        await _write_quietly(resp, sse_data(exc.body()))
    except ApiError as exc:
        request.app[METRICS].requests.inc(outcome=str(exc.status))
        await _write_quietly(resp, b"".join([sse_data(exc.body()), sse_data("[DONE]")]))
    except (ConnectionError, ClientGoneError):
        request.app[METRICS].requests.inc(outcome="client_gone")
    except asyncio.CancelledError:
        if request.app[GATE].closed:
            request.app[METRICS].requests.inc(outcome="shutting_down")
            await _end_for_shutdown(resp, [])
        raise
    finally:
        if task is not None:
            streams.discard(task)
    await _write_eof_quietly(resp)
    return resp
