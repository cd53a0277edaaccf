"""A client's request body, read with a deadline that judges its progress.

A body is cut (408 `body_timeout`) once it stalls for `body_timeout` seconds or arrives slower
than `body_min_rate` bytes/s after that grace (wire/body_deadline.py), so a client on a slow
link is never cut while its body keeps coming, and one that announced a body and sends nothing
(or a trickle) holds its connection only briefly. aiohttp reads the body (`--max-body-bytes`
stays its 413); its byte count is looked at every CHECK_S seconds.
"""

from __future__ import annotations

import asyncio
import contextlib

from aiohttp import web

from gateway.errors import InvalidRequestError
from gateway.state import SETTINGS
from wire.body_deadline import body_deadline, body_late_message

CHECK_S = 0.5  # how often a body's progress is looked at


async def read_body(request: web.Request) -> bytes:
    """The whole body of `request`; an InvalidRequestError (408 `body_timeout`) once it stalls
    or trickles (the app's `body_timeout`, `body_min_rate`)."""
    if request.content.is_eof():  # the whole body came with its head: nothing to wait for
        return await request.read()
    settings = request.app[SETTINGS]
    timeout_s, min_rate = settings.body_timeout, settings.body_min_rate
    loop = asyncio.get_running_loop()
    reading = asyncio.ensure_future(request.read())
    started = last = loop.time()
    seen = request.content.total_bytes  # what came with the head
    due, why = body_deadline(started, last, seen, timeout_s, min_rate)
    try:
        while True:
            done, _ = await asyncio.wait({reading}, timeout=max(0.0, min(due - loop.time(), CHECK_S)))
            if done:
                return reading.result()
            now, got = loop.time(), request.content.total_bytes
            if got > seen:
                seen, last = got, now
            due, why = body_deadline(started, last, seen, timeout_s, min_rate)
            if now >= due:
                raise InvalidRequestError(body_late_message(why, timeout_s, min_rate), code="body_timeout", status=408)
    finally:
        if not reading.done():
            reading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reading
