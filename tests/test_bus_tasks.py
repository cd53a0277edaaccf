"""cancel_and_wait: stopping a task that swallows a cancellation (as nats-py's flush does)."""

from __future__ import annotations

import asyncio

import pytest

from bus.tasks import cancel_and_wait


async def test_a_task_that_swallows_a_cancellation_is_cancelled_again() -> None:
    swallowed = 0

    async def flush_like() -> None:  # nats-py's Client._flush_pending: `except CancelledError: pass`
        nonlocal swallowed
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            swallowed += 1

    async def consumer(messages: asyncio.Queue[int]) -> None:
        while True:  # like `async for msg in subscription`, publishing for each message
            await messages.get()
            await flush_like()

    messages: asyncio.Queue[int] = asyncio.Queue()
    messages.put_nowait(1)
    task = asyncio.create_task(consumer(messages))
    plain = asyncio.create_task(asyncio.sleep(10))
    failing = asyncio.create_task(asyncio.sleep(0, result=None))
    await asyncio.sleep(0.05)  # the consumer is inside flush_like
    async with asyncio.timeout(5):
        await cancel_and_wait([task, plain, failing])
    assert swallowed == 1 and task.cancelled() and plain.cancelled() and failing.done()


async def test_a_failed_task_is_consumed_not_raised() -> None:
    async def boom() -> None:
        raise RuntimeError("boom")

    task = asyncio.create_task(boom())
    await asyncio.sleep(0)
    await cancel_and_wait([task])
    assert isinstance(task.exception(), RuntimeError)
    with pytest.raises(RuntimeError):
        task.result()
