"""Credit-based backpressure: a slow tail slows its upstream; nobody buffers the prompt."""

from __future__ import annotations

import numpy as np

from gateway.route_client import RouteClient
from tests.fixtures.mesh import Mesh, NodeProc

WINDOW = 2
CHUNK = 16
HIDDEN = 576
TAIL_DELAY_MS = 300


async def prefill_through(mesh: Mesh, head: NodeProc, tail: NodeProc, n_prompt: int) -> tuple[dict, dict, int]:
    session = await mesh.route([head, tail], prompt_tokens=n_prompt)
    prompt = np.random.default_rng(n_prompt).integers(100, 40000, size=n_prompt).tolist()
    async with RouteClient(session, mesh.http, chunk_size=CHUNK, bus=mesh.bus, ramp=False) as rc:  # equal chunks
        await rc.prefill(prompt)
        waits = rc.credit_waits
    h = await mesh.session_stats(head, session.session_id)
    t = await mesh.session_stats(tail, session.session_id)
    return h, t, waits


async def test_slow_tail_bounds_what_the_head_buffers(mesh: Mesh) -> None:
    args = ["--window", str(WINDOW)]
    head = await mesh.spawn((0, 15), args=args)
    # far slower than the head's own chunk compute (about 20 ms here, a few times that on a
    # loaded machine), so the tail is the route's bottleneck
    tail = await mesh.spawn((15, 30), args=args, env={"MESHNET_TEST_DELAY_MS": str(TAIL_DELAY_MS)})
    short_h, short_t, short_waits = await prefill_through(mesh, head, tail, 8 * CHUNK)
    long_h, long_t, long_waits = await prefill_through(mesh, head, tail, 24 * CHUNK)
    for h, t in ((short_h, short_t), (long_h, long_t)):
        assert h["max_buffered"] <= WINDOW and t["max_buffered"] <= WINDOW
        assert t["max_buffered_bytes"] <= WINDOW * CHUNK * HIDDEN * 4
        assert h["credit_waits"] > 0  # the head really waited for the slow tail's credit
    # what the head holds does not grow with the prompt: same peak for 3x the prompt
    assert long_h["max_buffered_bytes"] == short_h["max_buffered_bytes"]
    assert long_h["max_buffered"] == short_h["max_buffered"]
    # the slowness propagated to the caller: it waited for the head's credit, more for a longer prompt
    assert long_waits > short_waits > 0
    assert long_h["prefill_tokens"] == 24 * CHUNK and long_t["prefill_tokens"] == 24 * CHUNK
