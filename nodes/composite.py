"""A composite node: one `meshnet node` process serving several shards (the design documents'
composite node).

Several ranges on one machine (`meshnet up`, or a user with the memory for them) share its
cores. In one process they also share one engine thread: the event loop's with the inline
placement, or one worker with the thread placement. So their model calls take turns by
construction, each with every core, and nothing arbitrates between processes. Each shard
keeps what a node has on its own: its node id and bus identity, its activation port, its
session table and hop scheduler; their Seam Links still cross the loopback (docs/shard-runtime.md).

`--layers A:B --layers B:C` asks for one; `--node-id`, `--port` and `--advertise` then name each
shard (or none does; one `--port P` puts shard i on P + i, and 0 or none a free port each; one
`--advertise http://HOST` without a port announces each shard on HOST at its own port).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from nodes.server.engine_turns import EngineTurns


@dataclass
class NodeProcess:
    """What a node process's shards share: the stop event (any shard ending ends them all), a
    composite node's engine turns and shared engine thread, and the count of shards still loading.
    A composite node listens only once every shard has loaded, so its ports answer at once (a
    shard loading inline holds the event loop, and a port opened before it would not answer)."""

    shards: int
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    turns: EngineTurns | None = None
    shared: ThreadPoolExecutor | None = None
    _loading: int = field(init=False)
    _loaded: asyncio.Event = field(init=False, default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self._loading = self.shards

    async def all_loaded(self) -> bool:
        """Mark one shard loaded and wait for the rest; False when the process stops first."""
        self._loading -= 1
        if self._loading <= 0:
            self._loaded.set()
        waits = [asyncio.ensure_future(self._loaded.wait()), asyncio.ensure_future(self.stop.wait())]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        return self._loaded.is_set() and not self.stop.is_set()


def composite_problem(args: argparse.Namespace) -> str | None:
    """What stops these flags from making a composite node (None: fine, or one shard only)."""
    ranges = args.layers or []
    ids = args.node_id or []
    ports = args.port or []
    if len(ranges) <= 1:
        return None  # one shard: the last --node-id and --port win, as with any flag
    if ids and len(ids) != len(ranges):
        return f"{len(ranges)} --layers ranges take {len(ranges)} --node-id values (or none), got {len(ids)}"
    if len(ports) not in (0, 1, len(ranges)):
        return f"{len(ranges)} --layers ranges take {len(ranges)} --port values (or one), got {len(ports)}"
    if len(set(ids)) != len(ids):
        return "each shard of a composite node needs its own --node-id"
    if len(advertised := args.advertise or []) not in (0, 1, len(ranges)):
        return f"{len(ranges)} --layers ranges take {len(ranges)} --advertise URLs (or one without a port), " \
               f"got {len(advertised)}"
    if len(advertised) == 1 and urlsplit(advertised[0]).port is not None:
        return (f"--advertise {advertised[0]} names one port, and a composite node's shards listen on their own: "
                "give one --advertise per --layers, or one http://HOST without a port")
    if args.manifest and not args.model:
        return "a composite node reads its shards from --model (a piece store serves one range per process)"
    return None


def shard_namespaces(args: argparse.Namespace) -> list[argparse.Namespace]:
    """One namespace per shard the process serves, each with one range, id and port (pure); a
    --draft-model goes to the shard that starts at layer 0."""
    ranges = args.layers or [None]
    ids = args.node_id or []
    ports = args.port or [0]
    advertised = args.advertise or [None]
    shards = []
    for i, layers in enumerate(ranges):
        shard = copy.copy(args)
        shard.layers = layers
        if len(ranges) == 1:
            shard.node_id, shard.port, shard.advertise = (ids[-1] if ids else None), ports[-1], advertised[-1]
        else:
            shard.node_id = ids[i] if ids else None
            shard.port = ports[i] if len(ports) > 1 else ports[0] + i if ports[0] else 0
            shard.advertise = advertised[i] if len(advertised) > 1 else advertised[0]
        if len(ranges) > 1 and (layers is None or layers[0] != 0):
            shard.draft_model = None
        shards.append(shard)
    return shards
