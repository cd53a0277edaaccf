"""The node's aiohttp app: session listing and release, health, capability. The frame plane
(frames, credit polls, Return Streams) is wire.server.FrameServer's alone: a connection whose
first request is for the app is handed here, and a frame on it is refused (`refuse_frame`)."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import AsyncIterator

import orjson
from aiohttp import web

from nodes.server.frame_plane import authorize
from nodes.server.hop_machine import HopPhase
from nodes.server.runtime import NodeRuntime
from schemas.credentials import CREDENTIAL_HEADER
from schemas.frames import (
    FRAMES_PATH,
    LINKS_PATH,
    SESSIONS_PATH,
    FrameError,
)
from wire.server import Reply, error_reply

log = logging.getLogger("meshnet.node.http")

RUNTIME = web.AppKey("runtime", NodeRuntime)
STATS_TOKEN_ENV = "MESHNET_NODE_TOKEN"  # the bearer token that shows a node's per-session rows (unset: nobody)


def _json(data: object, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def _reply(reply: Reply) -> web.Response:
    return web.Response(body=reply.body, status=reply.status, content_type="application/json")


def _error(err: FrameError) -> web.Response:
    return _reply(error_reply(err))


async def refuse_frame(request: web.Request) -> web.Response:
    """A frame or credit poll on a connection the app serves (its first request was for the app):
    the frame plane is served only by wire.server.FrameServer, on connections that start with it."""
    return _error(FrameError(code="bad_frame", message=(
        "frames, Seam Links and credit polls go on a connection of their own: this one began with a request for "
        "the node's app (listings, health, DELETE); open a new connection for the frame plane")))


def _operator(request: web.Request) -> bool:
    """Whether the caller presented this node's stats token (`Authorization: Bearer`, STATS_TOKEN_ENV)."""
    token = request.app[RUNTIME].opts.stats_token
    given = request.headers.get("Authorization", "")
    if not token or not given.startswith("Bearer "):
        return False
    return hmac.compare_digest(given[len("Bearer "):].strip().encode("utf-8", "replace"), token.encode())


async def list_sessions(request: web.Request) -> web.Response:
    """Totals over the live sessions (counts, engine sessions, cache bytes, slots); to a caller
    with the node's stats token, every live and parked session's row too (ids, token counts)."""
    rt = request.app[RUNTIME]
    engine = await rt.runner.snapshot()
    body: dict[str, object] = {
        "node_id": rt.node_id,
        "live_sessions": len(rt.table.live),
        "parked_sessions": len(rt.table.parked),
        "engine_sessions": len(engine),
        "cache_bytes": sum(c for _, c in engine.values()),
        "ended": rt.table.ended_total,
        "max_sessions": rt.table.max_sessions,
        "free_session_slots": rt.table.free_slots,
        "kept_total": rt.table.kept_total,
        "scheduler": rt.scheduler.stats(),
        "seam_links": rt.cfg.seams.stats(),  # per next-hop node: open lanes, messages and parts sent
        "shared_prefix": rt.runner.shared_prefix_stats(),
    }
    if not _operator(request):
        return _json(body)
    rows = []
    for sid, hs in rt.table.live.items():
        pos, cache = engine.get(sid, (0, 0))
        rows.append({**hs.stats(), "engine_position": pos, "cache_bytes": cache})
    body["sessions"] = rows
    # sessions that lost another hop, their Hot KV State held for a restart (hop_machine.parks)
    body["parked"] = [{"session_id": sid, "position": engine.get(sid, (0, 0))[0],
                       "cache_bytes": engine.get(sid, (0, 0))[1],
                       "seconds_left": round((hs.life.kept_until or 0.0) - time.monotonic(), 2)}
                      for sid, hs in rt.table.parked.items()]
    return _json(body)


async def get_session(request: web.Request) -> web.Response:
    """One session's counters, live or recently ended: to the holder of this hop's credential
    for it (its route's driver) or of the node's stats token."""
    rt = request.app[RUNTIME]
    sid = request.match_info["session_id"]
    hs = rt.table.live.get(sid) or rt.table.ended.get(sid)
    if not _operator(request) and (hs is None or authorize(hs, request.headers.get(CREDENTIAL_HEADER)) is not None):
        # the same answer whether or not the session exists
        return _error(FrameError(code="bad_credential", message=f"this session's {CREDENTIAL_HEADER} or the "
                                 "node's stats token (Authorization: Bearer) is needed"))
    if hs is None:
        return _error(FrameError(code="unknown_session", message=f"no session {sid}"))
    engine = await rt.runner.snapshot()
    pos, cache = engine.get(sid, (0, 0))
    return _json({**hs.stats(), "engine_position": pos, "cache_bytes": cache})


def row_count(text: str) -> int | None:
    """A `used` query value of at most 18 ASCII digits as an int, else None (pure): str.isdigit
    also takes '²', and int() refuses it (and more than 4,300 digits), a 500 for the DELETE."""
    return int(text) if len(text) <= 18 and text.isascii() and text.isdigit() else None


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
    how = HopPhase.ABORTED if action == "abort" else HopPhase.CLOSED
    reason = q.get("reason") or f"{action} by caller"
    lost = next((i for i, h in enumerate(hs.route.hops) if h.node_id == q.get("lost")), None)
    if lost is None and (used := row_count(q.get("used", ""))) is not None:
        hs.used_rows = used  # the rows the driver's answer used: the hop claims none beyond
    failure = None  # an abort because another hop was lost: the session waits for a restart (hop_machine.parks)
    if how is HopPhase.ABORTED and lost is not None:
        failure = hs.make_failure(hs.phase, f"session aborted: {reason}", lost, code="hop_lost")
    ended = await rt.table.end(sid, how, reason, failure)
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
    app[RUNTIME].cfg.seams.close()


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
    app.router.add_post(FRAMES_PATH, refuse_frame)
    app.router.add_post(LINKS_PATH, refuse_frame)
    app.router.add_get(SESSIONS_PATH, list_sessions)
    app.router.add_get(SESSIONS_PATH + "/{session_id}", get_session)
    app.router.add_get(SESSIONS_PATH + "/{session_id}/credit", refuse_frame)
    app.router.add_delete(SESSIONS_PATH + "/{session_id}", delete_session)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/v1/capability", capability)
    app.cleanup_ctx.append(_sessions)
    app.cleanup_ctx.append(_reaper)
    app.cleanup_ctx.extend(runtime.background())
    return app
