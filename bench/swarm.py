"""Benchmark the Shard Swarm against one plain HTTP GET of the same bytes, in the same run.

    python bench/swarm.py [--json] [--layers 15:30] [--runs 3] [--rtt-ms 200 --rate-mbit 20]

Starts nats-server, a tracker and two `meshnet artifact seed` processes of the bundled GGUF on
loopback. Per run, in alternation: a plain GET of `bytes_needed` bytes from one seeder into a
file with aiohttp (no hashing; `single_source_mb_s`, the baseline of the targets), the same
GET through the fetcher's own reader on a thread (no hashing, one file;
`single_source_link_mb_s`: what hashing and a file per piece cost), then the swarm fetcher (the code `meshnet node --manifest` runs) fetching
the range's pieces into a fresh store from 1 seeder, then from 2. Then it verifies one store
(sha256 of every piece) and measures time to serving: a `meshnet node --manifest --layers`
process from its start to the first token routed through it (head: a node on the whole file).
Medians over the runs; ratios against the plain GET.

With `--rtt-ms` or `--rate-mbit`, every seeder is reached through a `python -m bench.relay`
process: that round trip, and that cap on the seeder's uplink (shared by all its connections).
The plain GETs and swarm fetches above then cross the relays, and one more fetch runs from a
near seeder (a relay with no delay or cap) and a far one together (`swarm_mb_s_near_far`, against
the near one alone: `swarm_mb_s_near`), with the share of bytes the far one sent (`far_share`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from artifacts.bundled import resolve_model  # noqa: E402
from artifacts.manifest import ManifestPiece, build_manifest, pieces_for_range  # noqa: E402
from artifacts.piece_link import PieceLink  # noqa: E402
from artifacts.piece_store import PieceStore  # noqa: E402
from artifacts.seeder import file_path  # noqa: E402
from artifacts.swarm import FetchReport, Peer, SwarmFetcher  # noqa: E402
from bench.route import open_route, spawn_nodes, start_tracker, stop_processes  # noqa: E402
from bus import runloop, subjects  # noqa: E402
from bus.client import Bus  # noqa: E402
from bus.server import NatsServer  # noqa: E402
from gateway.route_client import RouteClient  # noqa: E402
from schemas.artifacts import PeersReply, PeersRequest, decode_bits  # noqa: E402

SEED_READY = re.compile(r"seeding .* at (http://\S+)")
RELAY_READY = re.compile(r"relaying [\d.]+:(\d+) ->")
READY = re.compile(r"serving .* at (http://\S+)")


class FixedPeers:
    """A PeerSource of given seeders (the bench picks 1 or 2 of the tracker's inventory)."""

    def __init__(self, peers: list[Peer]) -> None:
        self._peers = peers

    async def peers(self) -> list[Peer]:
        return self._peers

    async def report_bad(self, peer: Peer, piece: ManifestPiece, reason: str) -> None:
        raise RuntimeError(f"bad piece {piece.piece_id} from {peer.node_id}: {reason}")


async def spawn_seeder(nats: NatsServer, model: Path, manifest: Path) -> tuple[asyncio.subprocess.Process, str]:
    node_id = f"seed-{uuid.uuid4().hex[:6]}"
    user, password = nats.credentials("node")
    cmd = [sys.executable, "-m", "meshnet.cli", "artifact", "seed", str(model), "--manifest", str(manifest),
           "--node-id", node_id, "--nats", nats.url, "--nats-user", user, "--nats-password", password,
           "--log-level", "WARNING"]
    proc = await asyncio.create_subprocess_exec(*cmd, cwd=ROOT, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.DEVNULL)
    assert proc.stdout is not None
    while True:
        line = (await proc.stdout.readline()).decode()
        if not line:
            raise RuntimeError("seeder exited before it was ready")
        if SEED_READY.search(line):
            return proc, node_id


async def spawn_relay(url: str, rtt_ms: float, rate_mbit: float | None) -> tuple[asyncio.subprocess.Process, str]:
    """A `bench.relay` process in front of the seeder at `url`: (process, the relayed URL)."""
    cmd = [sys.executable, "-m", "bench.relay", "--listen", "0", "--target", url.removeprefix("http://"),
           "--delay-ms", str(rtt_ms / 2), *(["--rate-mbit", str(rate_mbit), "--shared-rate"] if rate_mbit else [])]
    proc = await asyncio.create_subprocess_exec(*cmd, cwd=ROOT, stdout=asyncio.subprocess.PIPE)
    assert proc.stdout is not None
    m = RELAY_READY.search((await proc.stdout.readline()).decode())
    if m is None:
        raise RuntimeError("the relay exited before it was ready")
    return proc, f"http://127.0.0.1:{m.group(1)}"


async def relayed(peers: list[Peer], rtt_ms: float, rate_mbit: float | None,
                  procs: list[asyncio.subprocess.Process]) -> list[Peer]:
    """The same peers, each through a relay of its own (added to `procs`)."""
    out = []
    for p in peers:
        proc, url = await spawn_relay(p.url, rtt_ms, rate_mbit)
        procs.append(proc)
        out.append(Peer(p.node_id, url, p.have))
    return out


async def plain_get(http: aiohttp.ClientSession, url: str, aid: str, nbytes: int, dst: Path) -> float:
    """One ranged GET of nbytes into a file (no hashing); seconds."""
    t0 = time.perf_counter()
    with open(dst, "wb") as f:  # noqa: ASYNC230 - the baseline is a plain download
        async with http.get(url + file_path(aid), headers={"Range": f"bytes=0-{nbytes - 1}"}) as resp:
            resp.raise_for_status()
            async for chunk in resp.content.iter_chunked(1 << 20):
                f.write(chunk)
    return time.perf_counter() - t0


class _NoHash:
    def update(self, _data: object) -> None:
        pass


async def link_get(url: str, aid: str, nbytes: int, dst: Path) -> float:
    """The same ranged GET through the fetcher's own reader (artifacts/piece_link.py) on a
    thread, without hashing or a file per piece; seconds."""
    link = PieceLink(url)
    fd = os.open(dst, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
    try:
        t0 = time.perf_counter()
        await asyncio.to_thread(link.fetch, file_path(aid), fd, nbytes, _NoHash(), ranged=True)
        return time.perf_counter() - t0
    finally:
        os.close(fd)
        link.close()


async def swarm_fetch(store_dir: Path, manifest, start: int, end: int, peers: list[Peer]) -> tuple[float, int]:
    """The swarm fetcher into a fresh store; (seconds, bytes fetched)."""
    report = await swarm_report(store_dir, manifest, start, end, peers)
    return report.seconds, report.bytes_fetched


async def swarm_report(store_dir: Path, manifest, start: int, end: int, peers: list[Peer]) -> FetchReport:
    shutil.rmtree(store_dir, ignore_errors=True)
    store = PieceStore.create(store_dir, manifest)
    return await SwarmFetcher(store, pieces_for_range(manifest, start, end), FixedPeers(peers)).run()


async def near_far(tmp: Path, manifest, start: int, end: int, peers: list[Peer], args: argparse.Namespace,
                   procs: list[asyncio.subprocess.Process]) -> dict:
    """A near seeder alone, then with a far one (--rtt-ms, --rate-mbit): MB/s, the far one's share."""
    near = (await relayed(peers[:1], 0.0, None, procs))[0]
    far = (await relayed(peers[1:2], args.rtt_ms, args.rate_mbit, procs))[0]
    alone, both, share = [], [], []
    for _ in range(args.runs):
        r = await swarm_report(tmp / "store-near", manifest, start, end, [near])
        alone.append(r.bytes_fetched / r.seconds / 1e6)
        r = await swarm_report(tmp / "store-near-far", manifest, start, end, [far, near])  # far asked first
        both.append(r.bytes_fetched / r.seconds / 1e6)
        share.append(r.by_peer.get(far.node_id, 0) / r.bytes_needed)
    med = statistics.median
    return {"swarm_mb_s_near": round(med(alone), 1), "swarm_mb_s_near_far": round(med(both), 1),
            "far_share": round(med(share), 3), "ratio_near_far_near": round(med(both) / med(alone), 3)}


async def time_to_serving(nats: NatsServer, bus: Bus, model: Path, manifest_path: Path, tmp: Path,
                          start: int, end: int, head_id: str) -> float:
    """From `meshnet node --manifest` start to the first token routed through it."""
    node_id = f"bench-pieces-{uuid.uuid4().hex[:4]}"
    user, password = nats.credentials("node")
    cmd = [sys.executable, "-m", "nodes.main", "--manifest", str(manifest_path), "--layers", f"{start}:{end}",
           "--store", str(tmp / node_id), "--node-id", node_id, "--nats", nats.url, "--nats-user", user,
           "--nats-password", password, "--threads", "1", "--ctx", "1024", "--log-level", "WARNING"]
    t0 = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(*cmd, cwd=ROOT, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.DEVNULL,
                                                env={**os.environ, "MESHNET_CACHE": str(tmp / f"{node_id}-cache")})
    try:
        assert proc.stdout is not None
        while not READY.search((await proc.stdout.readline()).decode() or "serving  at http://x"):
            pass
        from artifacts.revision import model_revision

        session = await open_route(bus, model_revision(model), [head_id, node_id])
        async with aiohttp.ClientSession() as http, RouteClient(session, http, bus=bus) as rc:
            await rc.prefill([1, 2, 3, 4, 5, 6, 7, 8])
        return time.perf_counter() - t0
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        await proc.wait()


async def run(args: argparse.Namespace) -> dict:
    model = resolve_model(args.model)
    start, end = args.layers
    tmp = Path(tempfile.mkdtemp(prefix="meshnet-swarm-bench-"))
    os.environ["MESHNET_CACHE"] = str(tmp / "cache")
    manifest = build_manifest(model)
    manifest_path = tmp / "manifest.json"
    manifest.save(manifest_path)
    sel = pieces_for_range(manifest, start, end)
    procs: list[asyncio.subprocess.Process] = []
    try:
        async with NatsServer.start(store_dir=tmp / "js") as nats:
            procs.append(await start_tracker(nats))
            for _ in range(2):
                procs.append((await spawn_seeder(nats, model, manifest_path))[0])
            user, password = nats.credentials("gateway")
            bus = await Bus.connect(nats.url, role="gateway", user=user, password=password, name="bench")
            nuser, npass = nats.credentials("node")  # asking for peers is a node's call
            nbus = await Bus.connect(nats.url, role="node", user=nuser, password=npass, name="bench-fetcher",
                                     node_id="bench-fetcher")
            try:
                peers: list[Peer] = []
                for _ in range(300):  # the tracker's inventory lists both seeders
                    with contextlib.suppress(Exception):
                        reply = await nbus.request(subjects.ARTIFACT_PEERS, PeersRequest(artifact_id=manifest.artifact_id),
                                                  PeersReply, timeout=2.0)
                        peers = [Peer(p.node_id, p.seed_url, frozenset(decode_bits(p.have, len(manifest.pieces))))
                                 for p in reply.peers]
                    if len(peers) >= 2:
                        break
                    await asyncio.sleep(0.1)
                assert len(peers) >= 2, "the tracker lists fewer than 2 seeders"
                wan = args.rtt_ms > 0 or args.rate_mbit is not None
                mixed = await near_far(tmp, manifest, start, end, peers, args, procs) if wan else {}
                if wan:
                    peers = await relayed(peers, args.rtt_ms, args.rate_mbit, procs)
                single, linked, one, two, fetched = [], [], [], [], []
                async with aiohttp.ClientSession() as http:
                    for _ in range(args.runs):
                        single.append(sel.nbytes / await plain_get(http, peers[0].url, manifest.artifact_id,
                                                                   sel.nbytes, tmp / "plain.bin") / 1e6)
                        linked.append(sel.nbytes / await link_get(peers[0].url, manifest.artifact_id, sel.nbytes,
                                                                  tmp / "plain.bin") / 1e6)
                        s1, b1 = await swarm_fetch(tmp / "store1", manifest, start, end, peers[:1])
                        one.append(b1 / s1 / 1e6)
                        s2, b2 = await swarm_fetch(tmp / "store2", manifest, start, end, peers[:2])
                        two.append(b2 / s2 / 1e6)
                        fetched += [b1, b2]
                store = PieceStore.open(tmp / "store2")
                t0 = time.perf_counter()
                report = store.verify()
                verify_s = time.perf_counter() - t0
                assert report.ranges and report.ranges[0][0] <= start and report.ranges[0][1] >= end
                head_proc, [(head_id, _)] = await spawn_nodes(nats, model, [(0, start)], argparse.Namespace(
                    threads=1, batch_threads=None, window=8, compression="none", wire_dtype="f32",
                    node_arg=[], node_env=[]))
                procs.append(head_proc)
                serving = [await time_to_serving(nats, bus, model, manifest_path, tmp, start, end, head_id)
                           for _ in range(max(1, args.runs // 2))]
            finally:
                await nbus.close()
                await bus.close()
    finally:
        await stop_processes(procs, 10)
        shutil.rmtree(tmp, ignore_errors=True)
    med = statistics.median
    out = {
        "model": manifest.model, "layers": [start, end], "runs": args.runs,
        "rtt_ms": args.rtt_ms, "rate_mbit": args.rate_mbit,
        "bytes_needed": sel.nbytes, "bytes_fetched": max(fetched), "file_bytes": manifest.file_size,
        "single_source_mb_s": round(med(single), 1), "single_source_link_mb_s": round(med(linked), 1),
        "swarm_mb_s_1": round(med(one), 1),
        "swarm_mb_s_2": round(med(two), 1), "verify_mb_s": round(report.verified_bytes / verify_s / 1e6, 1),
        "time_to_serving_s": round(med(serving), 2),
    }
    out["ratio_fetched_needed"] = round(out["bytes_fetched"] / out["bytes_needed"], 4)
    out["ratio_swarm1_single"] = round(out["swarm_mb_s_1"] / out["single_source_mb_s"], 3)
    out["ratio_swarm2_single"] = round(out["swarm_mb_s_2"] / out["single_source_mb_s"], 3)
    out["ratio_swarm1_link"] = round(out["swarm_mb_s_1"] / out["single_source_link_mb_s"], 3)
    return out | mixed


def main() -> int:
    from bus.cli_args import number
    from nodes.main import parse_layers

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--layers", type=parse_layers, default=(15, 30))
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--rtt-ms", type=number(0), default=0.0, help="round trip to every seeder, through relays")
    p.add_argument("--rate-mbit", type=number(0, above=True), default=None,
                   help="each seeder's uplink cap, through relays (shared by its connections)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    out = runloop.run(run(args))
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k:>22}: {v}")
        print(f"targets: bytes_fetched <= 1.01 x bytes_needed ({out['ratio_fetched_needed']}), "
              f"swarm_mb_s_1 >= 0.9 x single_source_mb_s ({out['ratio_swarm1_single']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
