"""The web console: static files at `/` and `/console/*`, and the Mesh State it draws
(GET /v1/mesh as JSON, GET /v1/mesh/events as SSE of its changes). docs/console.md."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

from aiohttp import web

from bus import subjects
from bus.tasks import cancel_and_wait
from gateway.api_chat import error_response
from gateway.api_telemetry import _check_stream_slot, _open_sse, _Tracked
from gateway.errors import ApiError
from gateway.mesh_board import MeshBoard, MeshState
from gateway.openai_format import sse_comment, sse_event
from gateway.state import BUS_STATE, GATE, HUB, METRICS, SETTINGS
from schemas.artifacts import ArtifactProgress
from schemas.audit import ValidationVerdict
from schemas.node import NodeAnnouncement, NodeHeartbeat
from schemas.tracker import TrackerStatus

STATIC = Path(__file__).with_name("console")
FILES = {"index.html": "text/html", "console.js": "text/javascript", "console.css": "text/css"}
BOARD = web.AppKey("mesh_board", MeshBoard)
TICK_S = 1.0  # the stream re-reads the board at least this often (ages, expiry)
MIN_GAP_S = 0.5  # and sends at most this often
# the page may load only its own files and talk only to this gateway: no CDN, no external request
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


def mesh_state(app: web.Application) -> MeshState:
    """The Mesh State with this gateway's queue depth and live sessions."""
    gate = app[GATE]
    live = [r.latest for r in app[HUB].records() if not r.telemetry.terminal]
    return app[BOARD].state(queue_depth=gate.queue.depth, active=gate.active,
                            max_sessions=gate.max_sessions, sessions=live)


async def index(request: web.Request) -> web.FileResponse:
    """GET /: the console page."""
    return _file("index.html")


async def static(request: web.Request) -> web.FileResponse:
    """GET /console/{name}: the console's script and style sheet."""
    name = request.match_info["name"]
    if name not in FILES:
        raise web.HTTPNotFound()
    return _file(name)


def _file(name: str) -> web.FileResponse:
    return web.FileResponse(STATIC / name, headers={
        "Content-Type": f"{FILES[name]}; charset=utf-8", "Content-Security-Policy": CSP,
        "Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"})


async def mesh(request: web.Request) -> web.Response:
    """GET /v1/mesh: the Mesh State as JSON."""
    return web.Response(body=mesh_state(request.app).model_dump_json(), content_type="application/json")


def _changes(state: MeshState) -> str:
    """The state without its clocks: what decides whether followers get a new event."""
    return state.model_dump_json(exclude={"ts": True, "nodes": {"__all__": {"age_s"}}})


async def mesh_events(request: web.Request) -> web.StreamResponse:
    """GET /v1/mesh/events: SSE `mesh` events, each a whole Mesh State, when it changes."""
    app = request.app
    try:
        _check_stream_slot(request)
    except ApiError as exc:
        return error_response(exc)
    board, hub, keepalive = app[BOARD], app[HUB], app[SETTINGS].keepalive
    with _Tracked(request):
        resp = await _open_sse(request)
        last, quiet = "", 0.0
        try:
            while not hub.closed:
                changed = board.changed
                state = mesh_state(app)
                key = _changes(state)
                if key != last:
                    last, quiet = key, 0.0
                    await resp.write(sse_event(state.model_dump_json(), event="mesh"))
                    await asyncio.sleep(MIN_GAP_S)
                elif quiet >= keepalive:
                    quiet = 0.0
                    await resp.write(sse_comment())
                try:
                    await asyncio.wait_for(changed.wait(), TICK_S)
                except TimeoutError:
                    quiet += TICK_S
            await resp.write_eof()
        except ConnectionError:
            pass
    return resp


async def _board_ctx(app: web.Application) -> AsyncIterator[None]:
    """Follow announcements, heartbeats, tracker status and verdicts into the board."""
    bus = app[BUS_STATE].get("bus")
    board = app[BOARD]

    def on_verdict(msg: ValidationVerdict) -> None:
        board.on_verdict(msg)
        app[METRICS].verdicts.inc(outcome=str(msg.outcome))

    feeds = [
        (subjects.ANNOUNCE_ALL, NodeAnnouncement, board.on_announce),
        (subjects.HEARTBEAT_ALL, NodeHeartbeat, board.on_heartbeat),
        (subjects.TRACKER_STATUS, TrackerStatus, board.on_status),
        (subjects.audit_kind(subjects.VERDICT_KIND), ValidationVerdict, on_verdict),
        (f"{subjects.PREFIX}.artifact.*.progress.*", ArtifactProgress, board.on_progress),
    ]

    async def follow(subject, model, on) -> None:  # type: ignore[no-untyped-def]
        async with bus.subscribe(subject, model) as sub:  # type: ignore[union-attr]
            async for msg in sub:
                on(msg)

    tasks = [] if bus is None else [
        asyncio.create_task(follow(*feed), name=f"console:{feed[0]}") for feed in feeds]
    try:
        yield
    finally:
        await cancel_and_wait(tasks)


def setup(app: web.Application) -> None:
    """Add the console's routes and its board (after the bus context, which it reads)."""
    app[BOARD] = MeshBoard(node_timeout=app[SETTINGS].node_timeout)
    app.cleanup_ctx.append(_board_ctx)
    app.router.add_get("/", index)
    app.router.add_get("/console/{name}", static)
    app.router.add_get("/v1/mesh", mesh)
    app.router.add_get("/v1/mesh/events", mesh_events)
