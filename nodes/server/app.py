"""The activation HTTP app: frames in, credit and results out, session listing and release."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import orjson
from aiohttp import web

from nodes.server.admission import check_frame
from nodes.server.runtime import NodeRuntime
from nodes.server.session import HopSession
from schemas.frames import (
    CREDIT_POLL_S,
    FRAME_HEADER,
    FRAMES_PATH,
    SESSIONS_PATH,
    CreditGrant,
    FrameAck,
    FrameError,
    FrameFormatError,
    FrameHeader,
    FrameResult,
    decode_rows,
    wire_request_bytes,
)

log = logging.getLogger("meshnet.node.http")

RUNTIME = web.AppKey("runtime", NodeRuntime)
ZSTD_SLACK = 1024  # a zstd body may be a little larger than its raw size


def _json(data: object, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def _error(err: FrameError) -> web.Response:
    return web.Response(body=err.model_dump_json(exclude_none=True), status=err.status,
                        content_type="application/json")


def _ack(hs: HopSession, seq: int, result: FrameResult | None = None) -> web.Response:
    ack = FrameAck(seq=seq, credit=hs.credit, done=hs.done, result=result)
    return web.Response(body=ack.model_dump_json(exclude_none=True), status=200 if result else 202,
                        content_type="application/json")


async def post_frame(request: web.Request) -> web.Response:
    """Admit one frame (header checks before the body is read), queue it, answer with credit."""
    rt = request.app[RUNTIME]
    raw = request.headers.get(FRAME_HEADER)
    if raw is None:
        return _error(FrameError(code="bad_frame", message=f"missing {FRAME_HEADER} header"))
    try:
        header = FrameHeader.from_header(raw)
    except FrameFormatError as exc:
        return _error(FrameError(code="bad_frame", message=str(exc)))
    length = request.content_length
    if length is None or length > header.raw_size + ZSTD_SLACK:
        return _error(FrameError(code="bad_frame", message=f"body length {length} does not fit the header"))
    found = await rt.table.lookup(header.session_id)
    if isinstance(found, FrameError):
        return _error(found)
    if (err := check_frame(found.view(), header)) is not None:
        return _error(err)
    body = await request.read()
    try:
        rows = decode_rows(header, body)
    except FrameFormatError as exc:
        return _error(FrameError(code="bad_frame", message=str(exc)))
    # re-check after the await: another frame or a directive may have changed the session
    hs = rt.table.live.get(header.session_id)
    if hs is None or hs is not found:
        again = await rt.table.lookup(header.session_id, wait=False)
        return _error(again if isinstance(again, FrameError) else
                      FrameError(code="unknown_session", message="session was replaced"))
    if (err := check_frame(hs.view(), header)) is not None:
        return _error(err)
    wire = wire_request_bytes(request.method, request.path_qs, list(request.raw_headers), len(body))
    item = hs.accept(header, rows, wire, len(body))
    if item.reply is None:
        return _ack(hs, header.seq)
    outcome = await item.reply
    if isinstance(outcome, FrameResult):
        return _ack(hs, header.seq, outcome)
    return _error(FrameError(code="session_failed", message=outcome.reason, failure=outcome))


async def get_credit(request: web.Request) -> web.Response:
    """Long-poll: answer once the session's credit passes `above` (or after CREDIT_POLL_S)."""
    rt = request.app[RUNTIME]
    sid = request.match_info["session_id"]
    found = await rt.table.lookup(sid)
    if isinstance(found, FrameError):
        return _error(found)
    q = request.query
    if q.get("route_id") != found.route.route_id or q.get("epoch") != str(found.route.epoch):
        return _error(FrameError(code="route_mismatch", message="route or epoch does not match"))
    above = int(q.get("above", "-1"))
    await found.wait_credit_above(above, CREDIT_POLL_S)
    if found.state != "open":
        gone = await rt.table.lookup(sid, wait=False)
        if isinstance(gone, FrameError):
            return _error(gone)
    return web.Response(body=CreditGrant(credit=found.credit, done=found.done).model_dump_json(),
                        content_type="application/json")


async def list_sessions(request: web.Request) -> web.Response:
    """Every live session with its counters, engine position and cache bytes."""
    rt = request.app[RUNTIME]
    engine = await rt.runner.snapshot()
    rows = []
    for sid, hs in rt.table.live.items():
        pos, cache = engine.get(sid, (0, 0))
        rows.append({**hs.stats(), "engine_position": pos, "cache_bytes": cache})
    return _json({
        "node_id": rt.node_id,
        "sessions": rows,
        "engine_sessions": len(engine),
        "cache_bytes": sum(c for _, c in engine.values()),
        "ended": rt.table.ended_total,
    })


async def get_session(request: web.Request) -> web.Response:
    """One session's counters, live or recently ended."""
    rt = request.app[RUNTIME]
    sid = request.match_info["session_id"]
    hs = rt.table.live.get(sid) or rt.table.ended.get(sid)
    if hs is None:
        return _error(FrameError(code="unknown_session", message=f"no session {sid}"))
    engine = await rt.runner.snapshot()
    pos, cache = engine.get(sid, (0, 0))
    return _json({**hs.stats(), "engine_position": pos, "cache_bytes": cache})


async def delete_session(request: web.Request) -> web.Response:
    """Close or abort a session on this hop (the route's owner calls it on every hop)."""
    rt = request.app[RUNTIME]
    sid = request.match_info["session_id"]
    q = request.query
    hs = rt.table.live.get(sid)
    if hs is not None and q.get("route_id") not in (None, hs.route.route_id):
        return _error(FrameError(code="route_mismatch", message="route does not match"))
    action = q.get("action", "close")
    state = "aborted" if action == "abort" else "closed"
    ended = await rt.table.end(sid, state, q.get("reason") or f"{action} by caller")
    return _json({"session_id": sid, "ended": ended})


async def healthz(request: web.Request) -> web.Response:
    """Liveness and what this node serves."""
    rt = request.app[RUNTIME]
    cap = rt.capability
    return _json({"ok": True, "node_id": rt.node_id, "layers": [cap.layers.start, cap.layers.end],
                  "n_layer": cap.layers.n_layer, "sessions": len(rt.table.live), "url": rt.url})


async def capability(request: web.Request) -> web.Response:
    """This node's Capability Report."""
    return web.Response(body=request.app[RUNTIME].capability.model_dump_json(),
                        content_type="application/json")


async def _sessions(app: web.Application) -> AsyncIterator[None]:
    yield
    await app[RUNTIME].table.close_all("node shutting down")


async def _reaper(app: web.Application) -> AsyncIterator[None]:
    rt = app[RUNTIME]

    async def loop() -> None:
        while True:
            await asyncio.sleep(rt.opts.reap_interval_s)
            await rt.table.expire_idle()

    task = asyncio.create_task(loop(), name="session-reaper")
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def create_app(runtime: NodeRuntime) -> web.Application:
    """The node's activation server for `runtime` (frames, credit, sessions, health)."""
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[RUNTIME] = runtime
    app.router.add_post(FRAMES_PATH, post_frame)
    app.router.add_get(SESSIONS_PATH, list_sessions)
    app.router.add_get(SESSIONS_PATH + "/{session_id}", get_session)
    app.router.add_get(SESSIONS_PATH + "/{session_id}/credit", get_credit)
    app.router.add_delete(SESSIONS_PATH + "/{session_id}", delete_session)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/v1/capability", capability)
    app.cleanup_ctx.append(_sessions)
    app.cleanup_ctx.append(_reaper)
    app.cleanup_ctx.extend(runtime.background())
    return app
