"""Which asyncio event loop a Meshnet process runs on.

Every frame on a route pays the event loop's own cost several times per hop, so the node
and gateway processes run on uvloop when it is installed (MESHNET_LOOP=asyncio opts out).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop factory unless MESHNET_LOOP=asyncio or uvloop is missing (then None)."""
    if os.environ.get("MESHNET_LOOP", "uvloop").lower() != "uvloop":
        return None
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def run(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run on the chosen loop."""
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(main)
