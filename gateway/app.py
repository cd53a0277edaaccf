"""The gateway's aiohttp application: routes, shared state and the tasks it owns."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import web

from bus import subjects
from bus.client import Bus, Subscription, connect_as
from bus.errors import BusError
from bus.rtt import BusRtt, measure_rtt, watch_rtt
from bus.tasks import cancel_and_wait
from gateway import api_chat, api_console, api_mesh, api_props, api_telemetry, api_tokens
from gateway.admission import QueueLimits
from gateway.admission_gate import AdmissionGate
from gateway.api_keys import api_key_middleware
from gateway.audit_publisher import AuditPublisher
from gateway.errors import ApiError, InvalidRequestError
from gateway.generation import RouteClientFactory
from gateway.head_probe import probe_heads
from gateway.headers import conflicting_header
from gateway.mesh_view import MeshView
from gateway.metrics import GatewayMetrics
from gateway.replay_vault import ReplayVault
from gateway.route_watch import RouteWatch
from gateway.routing import Router
from gateway.served_model import ServedModel
from gateway.settings import GatewaySettings
from gateway.state import (
    AUDIT,
    BUS_STATE,
    GATE,
    HTTP,
    HUB,
    MESH,
    METRICS,
    MODEL,
    OPEN_ROUTE,
    ROUTER,
    SETTINGS,
    STREAMS,
    TELEMETRY_STREAMS,
    VAULT,
    WATCH,
)
from gateway.telemetry_hub import HubLimits, TelemetryHub
from gateway.telemetry_publisher import TelemetryPublisher
from schemas.node import NodeAnnouncement, NodeHeartbeat
from schemas.route import DRIVER_ALIVE_S, DriverAlive, RouteDirective, RouteSession
from schemas.tracker import TrackerStatus
from schemas.validation import ReplayRecordRequest
from wire.rtt_probe import RttProbe

log = logging.getLogger("meshnet.gateway")

TRACKER_STATUS = getattr(subjects, "TRACKER_STATUS", f"{subjects.PREFIX}.tracker.status")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def _model_ctx(app: web.Application) -> AsyncIterator[None]:
    """Load the served model's tokenizer and chat template (vocab only) for the app's life."""
    served = await asyncio.to_thread(ServedModel.load, app[SETTINGS].model)
    app[MODEL] = served
    app[MESH].default_n_ctx = served.tokenizer.n_ctx_train
    try:
        yield
    finally:
        served.close()


async def _bus_ctx(app: web.Application) -> AsyncIterator[None]:
    """Connect to NATS; follow announcements/heartbeats; publish telemetry and audit; prune."""
    settings = app[SETTINGS]
    bus = await connect_as(
        settings.nats_url, "gateway", user=settings.nats_user,
        password=settings.nats_password, name="meshnet-gateway",
    )
    app[BUS_STATE]["bus"] = bus
    head_rtts = RttProbe()
    bus_rtt = BusRtt()  # this gateway's round trip to the server; the trackers' come in their status
    await measure_rtt(bus, bus_rtt)
    driver_id = f"gw-{uuid.uuid4().hex[:12]}"  # this process, as the driver of its routes
    mesh = app[MESH]
    app[ROUTER] = Router(bus, timeout=settings.route_timeout, head_rtt=head_rtts.rtt_ms, driver_id=driver_id,
                         bus_rtt=lambda: (bus_rtt.seconds(), mesh.tracker_rtt_s()))
    publisher = TelemetryPublisher(bus, interval=settings.bus_event_interval)
    app[HUB].set_sink(publisher.offer)
    audit = AuditPublisher(bus, max_queue=settings.audit_queue, events=app[METRICS].audit_events)
    app[AUDIT] = audit

    # subscribed before startup returns: an announcement published once the gateway is up is never missed
    feeds = contextlib.AsyncExitStack()
    follows = [
        (await feeds.enter_async_context(bus.subscribe(subject, model)), handle)
        for subject, model, handle in ((subjects.ANNOUNCE_ALL, NodeAnnouncement, mesh.on_announce),
                                       (subjects.HEARTBEAT_ALL, NodeHeartbeat, mesh.on_heartbeat),
                                       (TRACKER_STATUS, TrackerStatus, mesh.on_status),
                                       (subjects.DIRECTIVE_ALL, RouteDirective, app[WATCH].on_directive))]
    tasks = [
        *(asyncio.create_task(_follow(sub, handle), name=f"gateway:{sub.subject}") for sub, handle in follows),
        asyncio.create_task(publisher.run(), name="gateway:telemetry-publisher"),
        asyncio.create_task(audit.run(), name="gateway:audit-publisher"),
        asyncio.create_task(app[HUB].run_pruner(), name="gateway:telemetry-pruner"),
        asyncio.create_task(probe_heads(mesh, head_rtts), name="gateway:heads"),
        asyncio.create_task(say_alive(bus, driver_id), name="gateway:alive"),
        asyncio.create_task(watch_rtt(bus, bus_rtt), name="gateway:bus-rtt"),
        asyncio.create_task(_exit_when_lost(app, bus), name="gateway:bus-lost"),
    ]
    # the validator's hand-over of sampled sessions' ids (answered into its inbox only)
    replay = await bus.serve(subjects.REPLAY_RECORD, ReplayRecordRequest, app[VAULT].answer)
    try:
        yield
    finally:
        await replay.stop()
        app[HUB].set_sink(None)
        if not await audit.drain(settings.audit_drain):
            log.warning("shutdown: %d audit events not stored", audit.queue.qsize())
        await cancel_and_wait(tasks)
        await feeds.aclose()
        await bus.close()


async def _exit_when_lost(app: web.Application, bus: Bus) -> None:
    """The bus lost for good (Bus.lost): without it the gateway routes nothing, so `meshnet
    gateway` stops as on SIGTERM and exits with an error, for its supervisor to start it again
    (gateway.main sets LOST_HOOK; an app embedded elsewhere only records it)."""
    await bus.lost.wait()
    app[BUS_STATE]["lost"] = True
    hook = app[BUS_STATE].get(LOST_HOOK)
    if callable(hook):
        hook()


LOST_HOOK = "on_lost"


async def _follow(sub: Subscription[Any], handle: Callable[[Any], None]) -> None:
    async for msg in sub:
        handle(msg)


async def say_alive(bus: Bus, driver_id: str) -> None:
    """Tell the hops of this gateway's routes that their driver is alive, every DRIVER_ALIVE_S."""
    subject = subjects.driver_alive(driver_id)
    while True:
        try:
            await bus.publish(subject, DriverAlive(driver_id=driver_id))  # a fresh `ts` each time
        except BusError as exc:
            log.warning("driver heartbeat not published: %s", exc)
        await asyncio.sleep(DRIVER_ALIVE_S)


async def _http_ctx(app: web.Application) -> AsyncIterator[None]:
    """The HTTP client session the route client sends activation frames with."""
    settings = app[SETTINGS]
    http = aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=5.0),
        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60.0),
    )
    app[HTTP] = http
    if OPEN_ROUTE not in app:
        app[OPEN_ROUTE] = default_route_factory(http, settings, app[BUS_STATE].get("bus"))
    try:
        yield
    finally:
        await http.close()


def default_route_factory(
    http: aiohttp.ClientSession, settings: GatewaySettings, bus: Bus | None,
) -> RouteClientFactory:
    """Open each Route Session with gateway.route_client.RouteClient over `http`.

    With a bus, the RouteClient also publishes the close/abort RouteDirective."""
    from gateway.route_client import RouteClient

    def open_route(session: RouteSession) -> RouteClient:
        return RouteClient(session, http, chunk_size=settings.chunk_size, bus=bus)  # None: per route

    return open_route


async def _on_shutdown(app: web.Application) -> None:
    """Refuse queued requests, wake telemetry followers and stop every open SSE stream (their
    routes are aborted)."""
    app[GATE].close()
    app[HUB].close()
    streams = list(app[STREAMS])
    for task in streams:
        task.cancel()
    await asyncio.gather(*streams, return_exceptions=True)


COMPLETION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})  # what requests_total counts


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Turn aiohttp's own HTTP errors on API paths into OpenAI error bodies."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400 or not request.path.startswith("/v1/"):
            raise
        code = exc.reason.lower().replace(" ", "_")
        # a wrong path or method is the client's error (OpenAI's type for it), not the server's
        err = (InvalidRequestError(exc.reason, code=code, status=exc.status) if exc.status < 500
               else ApiError(exc.reason, code=code, status=exc.status))
        if exc.status == 413:
            err = InvalidRequestError("request body too large", code="body_too_large", status=413)
            if request.path in COMPLETION_PATHS:  # refused before its handler could count it
                request.app[METRICS].requests.inc(outcome="413")
        return api_chat.error_response(err)


@web.middleware
async def _one_value_headers(request: web.Request, handler: Handler) -> web.StreamResponse:
    """A 400 naming one of Meshnet's own headers sent twice with different values (gateway/headers.py)."""
    err = conflicting_header(request.headers)
    if err is None:
        return await handler(request)
    if request.path in COMPLETION_PATHS:  # refused before its handler could count it
        request.app[METRICS].requests.inc(outcome=str(err.status))
    return api_chat.error_response(err)


def create_app(
    settings: GatewaySettings | None = None, *, open_route: RouteClientFactory | None = None
) -> web.Application:
    """The gateway application; `open_route` swaps the route client (tests of edge logic)."""
    settings = settings or GatewaySettings()
    middlewares = [_one_value_headers, _errors]
    if settings.api_keys:  # after the header check: two different Authorization headers are a 400
        middlewares.insert(1, api_key_middleware(settings.api_keys, metrics_public=settings.metrics_public))
    app = web.Application(client_max_size=settings.max_body_bytes, middlewares=middlewares)
    app[SETTINGS] = settings
    app[METRICS] = GatewayMetrics()
    app[WATCH] = RouteWatch()
    app[VAULT] = ReplayVault()
    app[GATE] = AdmissionGate(
        QueueLimits(max_queue=settings.max_queue, timeout=settings.queue_timeout),
        max_sessions=settings.max_sessions, metrics=app[METRICS], tick=settings.queue_tick,
        owners=max(1, len(settings.api_keys)),
    )
    app[MESH] = MeshView(node_timeout=settings.node_timeout)
    app[HUB] = TelemetryHub(HubLimits(
        session_history=settings.session_history, global_history=settings.global_history,
        retention_seconds=settings.retention_seconds, max_finished=settings.max_finished,
        min_decode_interval=settings.decode_event_interval,
    ))
    app[STREAMS] = set()
    app[TELEMETRY_STREAMS] = {}
    app[BUS_STATE] = {}
    if open_route is not None:
        app[OPEN_ROUTE] = open_route
    app.cleanup_ctx.extend([_model_ctx, _bus_ctx, _http_ctx])
    app.on_shutdown.append(_on_shutdown)
    app.router.add_post("/v1/chat/completions", api_chat.chat_completions)
    app.router.add_post("/v1/completions", api_chat.completions)
    app.router.add_get("/v1/models", api_mesh.list_models)
    app.router.add_get("/v1/models/{model}", api_mesh.get_model)
    app.router.add_get("/v1/sessions/{session_id}/events", api_telemetry.session_events)
    app.router.add_get("/v1/sessions/{session_id}", api_telemetry.session_state)
    app.router.add_get("/v1/telemetry", api_telemetry.all_events)
    app.router.add_get("/healthz", api_mesh.healthz)
    app.router.add_get("/health", api_mesh.healthz)  # llama-server's and vLLM's name for it
    app.router.add_get("/v1/health", api_mesh.healthz)  # llama-server's too
    app.router.add_get("/props", api_props.props)  # llama-server's (its web UI reads it at start)
    app.router.add_post("/tokenize", api_tokens.tokenize)  # llama-server's and vLLM's (gateway/api_tokens.py)
    app.router.add_post("/detokenize", api_tokens.detokenize)
    app.router.add_get("/metrics", api_mesh.metrics)
    app.router.add_get("/v1/ledger", api_mesh.ledger)
    api_console.setup(app)
    return app
