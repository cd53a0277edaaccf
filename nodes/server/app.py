"""The node's aiohttp app: session listing and release, health, capability, frames (wire.server.FrameServer takes the frame plane first)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence

import orjson
from aiohttp import web

from nodes.server.frame_plane import Admitted, admit_frame, authorize, credit_reply, run_frame
from nodes.server.runtime import NodeRuntime
from schemas.credentials import CREDENTIAL_HEADER
from schemas.frames import (
    FRAME_HEADER,
    FRAMES_PATH,
    RUN_CONTENT_TYPE,
    SESSIONS_PATH,
    FrameError,
)
from wire.client import wire_request_bytes
from wire.server import Reply, error_reply

log = logging.getLogger("meshnet.node.http")

RUNTIME = web.AppKey("runtime", NodeRuntime)


def _json(data: object, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def _reply(reply: Reply) -> web.Response:
    return web.Response(body=reply.body, status=reply.status, content_type="application/json")


def _error(err: FrameError) -> web.Response:
    return _reply(error_reply(err))


async def post_frame(request: web.Request) -> web.StreamResponse:
    """A frame that arrived on a connection the app already serves (FrameServer takes the rest)."""
    rt = request.app[RUNTIME]
    admitted = await admit_frame(rt, request.headers.get(FRAME_HEADER), request.content_length,
                                 credential=request.headers.get(CREDENTIAL_HEADER))
    if isinstance(admitted, FrameError):
        return _error(admitted)
    body = await request.read()
    wire = wire_request_bytes(request.method, request.path_qs, list(request.raw_headers), len(body))
    if admitted.header.is_run:
        return await _stream_run(request, rt, admitted, body, wire)
    answered: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
    run_frame(rt, admitted, body, wire, answered.set_result)
    return _reply(await answered)


class _QueuedRun:
    """A Decode Run's events on their way to an aiohttp StreamResponse (a RunStream)."""

    def __init__(self, request: web.Request, queue: asyncio.Queue[Reply | bytes | None]) -> None:
        self.request = request
        self.queue = queue
        self.started = False

    def send(self, events: Sequence[bytes]) -> bool:
        t = self.request.transport
        if t is None or t.is_closing():
            return False
        self.started = self.started or bool(events)
        for event in events:
            self.queue.put_nowait(event)
        return True

    def end(self, events: Sequence[bytes]) -> None:
        self.started = True
        for event in events:
            self.queue.put_nowait(event)
        self.queue.put_nowait(None)


async def _stream_run(request: web.Request, rt: NodeRuntime, admitted: Admitted, body: bytes,
                      wire: int) -> web.StreamResponse:
    queue: asyncio.Queue[Reply | bytes | None] = asyncio.Queue()
    run_frame(rt, admitted, body, wire, queue.put_nowait, _QueuedRun(request, queue))
    item = await queue.get()
    if isinstance(item, Reply):
        return _reply(item)
    resp = web.StreamResponse(headers={"Content-Type": RUN_CONTENT_TYPE, "Cache-Control": "no-store"})
    resp.enable_chunked_encoding()
    await resp.prepare(request)
    while isinstance(item, bytes):
        await resp.write(item)  # one chunk per event
        item = await queue.get()
    await resp.write_eof()
    return resp


async def get_credit(request: web.Request) -> web.Response:
    """The credit long-poll on a connection the app already serves."""
    return _reply(await credit_reply(request.app[RUNTIME], request.match_info["session_id"], request.query,
                                     request.headers.get(CREDENTIAL_HEADER)))


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
        "max_sessions": rt.table.max_sessions,
        "free_session_slots": rt.table.free_slots,
        # sessions that lost another hop, their Hot KV State held for a restart (table.parks)
        "parked": [{"session_id": sid, "position": engine.get(sid, (0, 0))[0],
                    "cache_bytes": engine.get(sid, (0, 0))[1], "seconds_left": round(p.until - time.monotonic(), 2)}
                   for sid, p in rt.table.parked.items()],
        "kept_total": rt.table.kept_total,
        "scheduler": rt.scheduler.stats(),
        "shared_prefix": rt.runner.shared_prefix_stats(),
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
    if hs is None:
        return _json({"session_id": sid, "ended": False})  # nothing to end (ended, refused or never open)
    if (err := authorize(hs, request.headers.get(CREDENTIAL_HEADER))) is not None:
        return _error(err)  # only the route's owner may end it, and give its reason
    if q.get("route_id") not in (None, hs.route.route_id):
        return _error(FrameError(code="route_mismatch", message="route does not match"))
    action = q.get("action", "close")
    state = "aborted" if action == "abort" else "closed"
    reason = q.get("reason") or f"{action} by caller"
    lost = next((i for i, h in enumerate(hs.route.hops) if h.node_id == q.get("lost")), None)
    failure = None  # an abort because another hop was lost: the session waits for a restart (table.parks)
    if state == "aborted" and lost is not None:
        failure = hs.make_failure(hs.phase, f"session aborted: {reason}", lost, code="hop_lost")
    ended = await rt.table.end(sid, state, reason, failure)
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
    """The node's HTTP app for `runtime`: sessions, health, capability, and the frame plane.

    FrameServer (nodes/server/frame_server.py) sits in front of this app on the same socket
    and serves frame-plane requests itself until a connection asks for anything else; from
    then on the connection is the app's, which serves frames through the same handlers."""
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
