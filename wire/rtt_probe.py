"""RttProbe: round trips to a set of peers, measured with a small request each.

A node probes the nodes it may send activations to (nodes/server/peer_probe.py), the gateway
the nodes that may head its routes (gateway/head_probe.py). Each probe is a `GET /healthz` on a
kept-alive connection; the report is the smallest of the last SAMPLES round trips per peer (a
late sample is queueing or a new connection's handshake, not distance). A peer that does not
answer a probe (refused, reset, no answer within PROBE_TIMEOUT_S) reports MAX_RTT_MS until it
answers again: a node whose activation address cannot be reached, while its heartbeats still
reach the bus, is priced as far as can be, so routes take another replica where one exists. So
is one whose address answers as another node (its /healthz names another `node_id`): a wrong
`--advertise`, or a hostname that resolves to loopback on the prober's machine, where the same
port serves the prober itself or a neighbour, is measured as near otherwise, and every frame
sent there is refused. The tracker adds each seam's round trip to a route's cost
(tracker/routing.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Mapping

import aiohttp
import orjson

from schemas.node import MAX_RTT_MS, MAX_RTT_PEERS

PROBE_INTERVAL_S = 2.0
PROBE_TIMEOUT_S = 2.0
SAMPLES = 5  # round trips kept per peer; the smallest is reported
FORGET_S = 30.0  # a peer not named again for this long is no longer probed

log = logging.getLogger("meshnet.rtt_probe")


def answered_by(body: bytes) -> str | None:
    """The node id a /healthz body names (pure), None when it names none."""
    try:
        node_id = orjson.loads(body).get("node_id")
    except (orjson.JSONDecodeError, AttributeError):
        return None
    return node_id if isinstance(node_id, str) else None


def smallest(samples: deque[float] | list[float]) -> float | None:
    """The round trip a peer reports (pure): its smallest recent sample, None with none."""
    return min(samples, default=None)


class RttProbe:
    """Peers (node id -> activation URL, as last named) and their recent round trips."""

    def __init__(self) -> None:
        self.peers: dict[str, tuple[str, float]] = {}  # node id -> (URL, when last named)
        self.samples: dict[str, deque[float]] = {}
        self.impostors: dict[str, str] = {}  # peer -> the node id its address answered as (logged once)

    def name(self, peers: Mapping[str, str]) -> None:
        """These peers are candidates now (node id -> activation URL)."""
        now = time.monotonic()
        for peer, url in peers.items():
            self.peers[peer] = (url, now)

    def rtt_ms(self) -> dict[str, float]:
        """Each probed peer's smallest recent round trip (ms), at most MAX_RTT_PEERS."""
        out = {}
        for peer in sorted(self.samples):
            rtt = smallest(self.samples[peer])
            if rtt is not None and len(out) < MAX_RTT_PEERS:
                out[peer] = round(min(rtt, MAX_RTT_MS), 3)
        return out

    async def probe_once(self, http: aiohttp.ClientSession) -> None:
        """One round trip to each candidate (at most MAX_RTT_PEERS, all at once)."""
        now = time.monotonic()
        for peer, (_, named) in list(self.peers.items()):
            if now - named > FORGET_S:
                del self.peers[peer]
                self.samples.pop(peer, None)
        targets = sorted(self.peers.items())[:MAX_RTT_PEERS]
        await asyncio.gather(*(self._probe(http, peer, url) for peer, (url, _) in targets))

    async def _probe(self, http: aiohttp.ClientSession, peer: str, url: str) -> None:
        started = time.perf_counter()
        try:
            timeout = aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)
            async with http.get(f"{url.rstrip('/')}/healthz", timeout=timeout) as resp:
                body = await resp.read()
                if resp.status != 200:
                    return  # (it answered: near, but not serving; its heartbeats say the rest)
            rtt = (time.perf_counter() - started) * 1e3
            other = answered_by(body)
            if other not in (None, peer):  # its address reaches another node: not it
                if self.impostors.get(peer) != other:
                    log.warning("peer %s's activation URL %s answers as node %s: it cannot be reached "
                                "there (a wrong --advertise?); priced as unreachable", peer, url, other)
                self.impostors[peer] = other
                rtt = None
            else:
                self.impostors.pop(peer, None)
        except (TimeoutError, aiohttp.ClientError, OSError):
            rtt = None
        if rtt is None:  # unreachable now: its earlier samples no longer say how near it is
            self.samples[peer] = deque([MAX_RTT_MS], maxlen=SAMPLES)
        else:
            self.samples.setdefault(peer, deque(maxlen=SAMPLES)).append(rtt)

    async def run(self) -> None:
        """Probe every PROBE_INTERVAL_S until cancelled."""
        connector = aiohttp.TCPConnector(limit_per_host=1, keepalive_timeout=3 * PROBE_INTERVAL_S)
        async with aiohttp.ClientSession(connector=connector) as http:
            while True:
                await self.probe_once(http)
                await asyncio.sleep(PROBE_INTERVAL_S)
