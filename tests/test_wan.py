"""A 2-hop route of real nodes, each behind a relay at RTT 20 ms, gives llama.cpp's greedy tokens."""

from __future__ import annotations

import time
from pathlib import Path

from gateway.route_client import RouteClient
from tests.fixtures.wan import FarMesh
from tests.test_route_exact import PROMPT, reference_greedy

N_GENERATE = 16
DELAY_S = 0.010  # one way: RTT 20 ms per hop


async def test_greedy_over_two_far_hops_equals_llama_cpp(far_mesh: FarMesh, model_path: Path) -> None:
    from llama_cpp import Llama

    tok = Llama(model_path=str(model_path), vocab_only=True, verbose=False)
    prompt = tok.tokenize(PROMPT.encode(), add_bos=False, special=True)
    expected = reference_greedy(model_path, prompt, N_GENERATE)
    nodes = [await far_mesh.spawn(r, delay_s=DELAY_S) for r in [(0, 15), (15, 30)]]
    session = await far_mesh.mesh.route(nodes, prompt_tokens=len(prompt))
    assert all(h.activation_url.endswith(f":{r.port}") for h, r in zip(session.hops, far_mesh.relays, strict=True))
    async with RouteClient(session, far_mesh.mesh.http, bus=far_mesh.mesh.bus) as rc:
        first = await rc.prefill(prompt)
        t0 = time.monotonic()
        tokens = [first.token_id]
        while len(tokens) < N_GENERATE:
            tokens.append((await rc.decode(tokens[-1])).token_id)
        elapsed = time.monotonic() - t0
    assert tokens == expected
    # every decoded token crossed the relays there and back: at least one round trip of 2D
    assert elapsed >= (N_GENERATE - 1) * 2 * DELAY_S
