"""Generation Telemetry over HTTP: one session's SSE stream, its latest state, all sessions."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import orjson
from aiohttp import web

from gateway.api_chat import client_gone, error_response
from gateway.api_keys import key_owner
from gateway.errors import (
    ApiError,
    InvalidRequestError,
    SessionNotFoundError,
    TooManyStreamsError,
)
from gateway.openai_format import sse_comment, sse_event
from gateway.session_ids import check_session_id
from gateway.state import HUB, SETTINGS, STREAMS, TELEMETRY_STREAMS
from gateway.telemetry_hub import SessionRecord, TelemetryHub
from schemas.telemetry import GenerationTelemetry


def last_event_id(request: web.Request) -> int:
    """The SSE resume point: Last-Event-ID header (or ?last_event_id=), default 0."""
    raw = request.headers.get("Last-Event-ID") or request.query.get("last_event_id") or "0"
    try:
        value = int(raw)
    except ValueError:
        raise InvalidRequestError(
            "Last-Event-ID must be an integer event id", param="Last-Event-ID",
            code="invalid_value",
        ) from None
    return max(value, 0)


def _event_bytes(event: GenerationTelemetry, event_id: int) -> bytes:
    return sse_event(event.to_json().decode(), event_id=event_id)


async def _open_sse(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={
        "content-type": "text/event-stream", "cache-control": "no-cache",
        "x-accel-buffering": "no",
    })
    await resp.prepare(request)
    await resp.write(sse_comment("telemetry stream open"))
    return resp


async def _wait_for_record(
    hub: TelemetryHub, resp: web.StreamResponse, session_id: str, wait: float, keepalive: float
) -> SessionRecord | None:
    """Wait (bounded) for a session that has not started yet, sending keep-alives meanwhile."""
    deadline = time.monotonic() + wait
    while True:
        remaining = deadline - time.monotonic()
        record = await hub.wait_for(session_id, max(0.0, min(keepalive, remaining)))
        if record is not None or remaining <= keepalive or hub.closed:
            return record
        await resp.write(sse_comment())


def stream_client(request: web.Request) -> str:
    """Who holds a telemetry stream, for the per-client bound: a digest of its API key when it
    sends one, else its address."""
    return key_owner(request.headers.get("Authorization")) or f"addr-{request.remote or 'unknown'}"


def _check_stream_slot(request: web.Request) -> None:
    """Refuse a new telemetry stream when the gateway's bound on open streams, or the client's
    own share of it, is reached: idle streams of one client never lock the others out. A
    stream whose client has left is stopped here rather than counted: its handler would only
    notice at its next keep-alive write, seconds later."""
    app = request.app
    settings = app[SETTINGS]
    live: list[str] = []
    for task, req in list(app[TELEMETRY_STREAMS].items()):
        if client_gone(req):
            task.cancel()  # its _Tracked exit forgets it
        else:
            live.append(stream_client(req))
    if len(live) >= settings.max_telemetry_streams:
        raise TooManyStreamsError(settings.max_telemetry_streams)
    if live.count(stream_client(request)) >= settings.max_telemetry_streams_per_client:
        raise TooManyStreamsError(settings.max_telemetry_streams_per_client, per_client=True)


class _Tracked:
    """Registers the current handler task as an open SSE stream (for shutdown and the bounds)."""

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.task = asyncio.current_task()

    def __enter__(self) -> None:
        if self.task is not None:
            self.request.app[STREAMS].add(self.task)
            self.request.app[TELEMETRY_STREAMS][self.task] = self.request

    def __exit__(self, *_exc: object) -> None:
        if self.task is not None:
            self.request.app[STREAMS].discard(self.task)
            self.request.app[TELEMETRY_STREAMS].pop(self.task, None)


async def session_events(request: web.Request) -> web.StreamResponse:
    """GET /v1/sessions/{id}/events: SSE of one session's telemetry until it ends."""
    app = request.app
    hub, settings = app[HUB], app[SETTINGS]
    try:
        session_id = check_session_id(request.match_info["session_id"], "session_id")
        after = last_event_id(request)
        _check_stream_slot(request)
    except ApiError as exc:
        return error_response(exc)
    with _Tracked(request):  # registered right after the slot check: no await in between
        resp = await _open_sse(request)
        try:
            record = hub.get(session_id) or await _wait_for_record(
                hub, resp, session_id, settings.session_wait, settings.keepalive
            )
            if record is None:
                err = SessionNotFoundError(session_id)
                await resp.write(sse_event(orjson.dumps(err.body()).decode(), event="error"))
            else:
                async for event in hub.follow(record, after, settings.keepalive):
                    if event is None:
                        await resp.write(sse_comment())
                    else:
                        await resp.write(_event_bytes(event, event.seq))
            await resp.write_eof()
        except ConnectionError:
            pass
    return resp


async def all_events(request: web.Request) -> web.StreamResponse:
    """GET /v1/telemetry: SSE of every session's telemetry (ids are gateway-wide)."""
    app = request.app
    try:
        after = last_event_id(request)
        _check_stream_slot(request)
    except ApiError as exc:
        return error_response(exc)
    with _Tracked(request):
        resp = await _open_sse(request)
        try:
            follow: AsyncIterator[tuple[int, GenerationTelemetry] | None] = app[HUB].follow_all(
                after, app[SETTINGS].keepalive
            )
            async for item in follow:
                if item is None:
                    await resp.write(sse_comment())
                else:
                    await resp.write(_event_bytes(item[1], item[0]))
            await resp.write_eof()
        except ConnectionError:
            pass
    return resp


async def session_state(request: web.Request) -> web.Response:
    """GET /v1/sessions/{id}: the latest telemetry of a session (404 if unknown)."""
    try:
        session_id = check_session_id(request.match_info["session_id"], "session_id")
        record = request.app[HUB].get(session_id)
        if record is None:
            raise SessionNotFoundError(session_id)
    except ApiError as exc:
        return error_response(exc)
    return web.Response(body=record.latest.to_json(), content_type="application/json")
