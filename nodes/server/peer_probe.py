"""A node's candidates for its round-trip probe (wire/rtt_probe.py): every node it may send
activations to, the nodes serving the layers right after its own, of the same model revision,
and on a head also every tail (on 3 or more hops the tail sends each token straight back to the
head: the tracker counts that trip too). It learns them from the tracker's status (every node
with its activation URL, mesh.tracker.status) and from the routes through it; its heartbeat
reports the round trips."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from bus import subjects
from bus.client import Bus
from schemas.route import RouteSession
from schemas.tracker import NodeSummary, TrackerStatus
from wire.rtt_probe import RttProbe


def probe_targets(summaries: Iterable[NodeSummary], *, node_id: str, model_revision: str,
                  layer_end: int, head: bool = False) -> dict[str, str]:
    """The nodes a node measures its round trip to (pure), of the same model revision: those it
    may send activations to (starting where its range ends) and, on a `head`, the tails (ending
    at the model's last layer; their tokens come back to it); node id -> activation URL."""
    return {s.node_id: s.activation_url for s in summaries
            if s.node_id != node_id and s.activation_url and s.model_revision == model_revision
            and (s.layer_start == layer_end or (head and s.layer_start >= layer_end and s.layer_end == s.n_layer))}


class PeerProbe:
    """The node's RttProbe, fed with its next hops."""

    def __init__(self, *, node_id: str, model_revision: str, layer_start: int, layer_end: int,
                 n_layer: int) -> None:
        self.node_id = node_id
        self.model_revision = model_revision
        self.layer_end = layer_end
        self.head = layer_start == 0
        self.tail = layer_end >= n_layer  # a tail sends activations to nobody
        self.rtt = RttProbe()

    def on_status(self, status: TrackerStatus) -> None:
        self.rtt.name(probe_targets(status.nodes, node_id=self.node_id, model_revision=self.model_revision,
                                    layer_end=self.layer_end, head=self.head))

    def on_route(self, session: RouteSession, hop_index: int) -> None:
        """A route through this node names its next hop (and to its head, its tail)."""
        if hop_index + 1 < len(session.hops):
            nxt, tail = session.hops[hop_index + 1], session.hops[-1]
            self.rtt.name({nxt.node_id: nxt.activation_url, **({tail.node_id: tail.activation_url}
                                                               if hop_index == 0 else {})})

    def rtt_ms(self) -> dict[str, float]:
        return self.rtt.rtt_ms()

    async def run(self, bus: Bus) -> None:
        """Follow the tracker's status and probe (until cancelled); a tail has nothing to probe."""
        if self.tail:
            return
        async with bus.subscribe(subjects.TRACKER_STATUS, TrackerStatus) as sub:
            probing = asyncio.create_task(self.rtt.run(), name="rtt-probe")
            try:
                async for status in sub:
                    self.on_status(status)
            finally:
                probing.cancel()
                await asyncio.gather(probing, return_exceptions=True)
