"""Stopping tasks that talk to NATS: cancel, and cancel again while a cancellation is swallowed.

nats-py's `Client._flush_pending` (reached from publish, flush and unsubscribe) catches
`asyncio.CancelledError` and returns normally. A task cancelled while inside it carries on,
for example back into `async for msg in subscription`, where it waits for the next message
for ever; a plain `task.cancel(); await task` then never returns (a tracker stopped while
its heartbeat consumer is publishing, say; docs/benchmarks.md has the history).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

RECANCEL_S = 0.5  # how long a cancelled task gets before it is cancelled again


async def cancel_and_wait(tasks: Iterable[asyncio.Task[object]]) -> None:
    """Cancel `tasks` and wait until every one has ended, cancelling again any task still
    running after RECANCEL_S. Their results and exceptions are consumed."""
    tasks = list(tasks)
    pending = {t for t in tasks if not t.done()}
    while pending:
        for t in pending:
            t.cancel()
        _, pending = await asyncio.wait(pending, timeout=RECANCEL_S)
    for t in tasks:
        if not t.cancelled():
            t.exception()  # consumed: a stopped task's failure is not "never retrieved"
