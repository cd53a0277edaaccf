"""Each hop of a real 2-hop route publishes Hop Telemetry: prefill done, throttled decode, closed."""

from __future__ import annotations

import asyncio
import itertools
import time

from bus import subjects
from bus.client import Bus
from gateway.route_client import RouteClient
from nodes.server.hop_telemetry import DECODE_INTERVAL_S
from schemas.telemetry import HopTelemetry
from tests.fixtures.mesh import Mesh

PROMPT = [1, 9690, 314, 253, 2362, 28, 2909, 1458, 2]  # any in-vocabulary ids; the head embeds them
N_DECODE = 12
DELAY_MS = 120  # per frame on every node, so decode spans several throttle intervals


async def test_each_hop_publishes_prefill_decode_and_closed(mesh: Mesh) -> None:
    user, password = mesh.nats.credentials("monitor")
    monitor = await Bus.connect(mesh.nats.url, role="monitor", user=user, password=password, name="monitor")
    env = {"MESHNET_TEST_DELAY_MS": str(DELAY_MS)}
    nodes = [await mesh.spawn((0, 12), env=env), await mesh.spawn((12, 30), env=env)]
    got: list[tuple[str, HopTelemetry]] = []
    try:
        async with monitor.subscribe_any(subjects.SESSION_ALL) as sub:
            session = await mesh.route(nodes, prompt_tokens=len(PROMPT))
            sid = session.session_id

            async def collect() -> None:
                closed = 0
                async for subj, msg in sub.with_subjects():
                    if isinstance(msg, HopTelemetry) and msg.session_id == sid:
                        got.append((subj, msg))
                        closed += msg.phase in ("closed", "failed")
                        if closed == len(nodes):
                            return

            collector = asyncio.create_task(collect())
            async with RouteClient(session, mesh.http, chunk_size=4, bus=mesh.bus) as rc:
                token = (await rc.prefill(PROMPT)).token_id
                decode_started = time.time()
                for _ in range(N_DECODE):
                    token = (await rc.decode(token)).token_id
                decode_span = time.time() - decode_started
            await asyncio.wait_for(collector, 60.0)  # the closed events follow the release
            assert sub.n_schema_errors == 0
    finally:
        await monitor.close()

    # each hop on its own subject, which only its own bus user may publish
    assert {s for s, _ in got} == {subjects.hop_telemetry(sid, n.node_id) for n in nodes}
    events = [m for _, m in got]
    assert {m.node_id for m in events} == {n.node_id for n in nodes}
    for i, node in enumerate(nodes):
        mine = sorted((m for m in events if m.node_id == node.node_id), key=lambda m: m.ts)
        assert all((m.hop_index, m.layer_start, m.layer_end, m.route_id) ==
                   (i, *node.layers, session.route_id) for m in mine)
        phases = [m.phase for m in mine]
        assert phases[0] == "prefill" and phases[-1] == "closed"
        assert phases.count("prefill") == 1 and phases.count("closed") == 1
        prefill, closed, decode = mine[0], mine[-1], mine[1:-1]
        assert (prefill.position, prefill.prefill_tokens, prefill.decode_tokens) == (len(PROMPT), len(PROMPT), 0)
        assert prefill.cache_bytes > 0 and prefill.compute_ms > 0

        # decode progress: at least one event, throttled to one per interval per session
        assert decode and all(m.phase == "decode" for m in decode)
        assert len(decode) < N_DECODE and len(decode) <= decode_span / DECODE_INTERVAL_S + 1
        for before, after in itertools.pairwise(mine[:-1]):
            assert after.ts - before.ts >= DECODE_INTERVAL_S * 0.99
        positions = [m.position for m in decode]
        assert positions == sorted(positions) and len(set(positions)) == len(positions)
        assert all(m.position == len(PROMPT) + m.decode_tokens for m in decode)
        assert all(0 < m.decode_tokens <= N_DECODE and m.cache_bytes > 0 for m in decode)

        # the end: cache freed, full counts, cumulative compute
        assert (closed.position, closed.prefill_tokens, closed.decode_tokens) == (
            len(PROMPT) + N_DECODE, len(PROMPT), N_DECODE)
        assert closed.cache_bytes == 0 and closed.reason and closed.reason.startswith("closed")
        assert closed.compute_ms >= max(m.compute_ms for m in mine)
