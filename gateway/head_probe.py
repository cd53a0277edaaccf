"""The gateway's round trips to the nodes that may head its routes (layer 0 onwards), measured
with wire/rtt_probe.py. Every route request carries them (`RouteRequest.head_rtt_ms`): the
tracker adds the gateway-to-head round trip to a route's cost like any other seam's."""

from __future__ import annotations

import asyncio

from gateway.mesh_view import MeshView
from wire.rtt_probe import PROBE_INTERVAL_S, RttProbe


def heads(mesh: MeshView) -> dict[str, str]:
    """Live nodes whose shard starts at layer 0: node id -> activation URL."""
    return {a.node_id: a.activation_url for a in mesh.live() if a.capability.layers.start == 0}


async def probe_heads(mesh: MeshView, probe: RttProbe) -> None:
    """Name the mesh's heads to `probe` and measure them, every PROBE_INTERVAL_S (until cancelled)."""
    probing = asyncio.create_task(probe.run(), name="gateway:head-probe")
    try:
        while True:
            probe.name(heads(mesh))
            await asyncio.sleep(PROBE_INTERVAL_S)
    finally:
        probing.cancel()
        await asyncio.gather(probing, return_exceptions=True)
