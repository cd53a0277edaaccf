"""Very long links (satellite, intercontinental, mobile: RTT 300-700 ms, with jitter): real nodes
behind relays at RTT 500 ms. A prompt's chunks must not wait a round trip each on any seam."""

from __future__ import annotations

import numpy as np

from gateway.route_client import RouteClient
from tests.fixtures.wan import FarMesh

DELAY_S = 0.25  # one way: RTT 500 ms per seam, the gateway's link to the head too
JITTER_S = 0.05
CHUNK = 16
N_PROMPT = 12 * CHUNK
TAIL_DELAY_MS = 100  # the tail slower than the head, far faster than a round trip


async def test_a_prompt_crosses_far_seams_a_window_per_round_trip(far_mesh: FarMesh) -> None:
    """The head gets several chunks per round trip from the gateway, and the tail several from
    the head: each hop then holds frames waiting for its compute (max_buffered > 1). When
    every chunk waited for its ack (a round trip) before the next went, a hop never held more
    than the one it computed, and the prompt took chunks x RTT to cross each seam."""
    head = await far_mesh.spawn((0, 15), delay_s=DELAY_S, jitter_s=JITTER_S, seed=1)
    tail = await far_mesh.spawn((15, 30), delay_s=DELAY_S, jitter_s=JITTER_S, seed=2,
                                args=["--window", "4"], env={"MESHNET_TEST_DELAY_MS": str(TAIL_DELAY_MS)})
    mesh = far_mesh.mesh
    session = await mesh.route([head, tail], prompt_tokens=N_PROMPT)
    prompt = np.random.default_rng(7).integers(100, 40000, size=N_PROMPT).tolist()
    async with RouteClient(session, mesh.http, chunk_size=CHUNK, bus=mesh.bus, ramp=False) as rc:
        first = await rc.prefill(prompt)
    assert first.position == N_PROMPT
    h = await mesh.session_stats(head, session.session_id)
    t = await mesh.session_stats(tail, session.session_id)
    assert h["prefill_tokens"] == N_PROMPT and t["prefill_tokens"] == N_PROMPT
    assert h["max_buffered"] > 1, f"the head got one chunk per round trip: {h}"
    assert t["max_buffered"] > 1, f"the tail got one chunk per round trip: {t}"
    assert t["max_buffered"] <= 4  # the tail's credit window still bounds what it holds
