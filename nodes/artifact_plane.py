"""A node's part in the artifact plane, on the bus: what it seeds, what it fetches, what it served.

- `TrackerPeers`: the Shard Swarm's PeerSource, asking the tracker's inventory
  (`mesh.tracker.artifact.peers`) and reporting bad pieces (`mesh.artifact.<id>.bad.<node>`).
- `fetch_range`: fetch a layer range's pieces with a terminal progress line and
  `mesh.artifact.<id>.progress.<node>` telemetry, then credit each seeder with a `seed` audit
  event: the bytes of its pieces that verified here, and its pieces that did not.
- `SeedPresence`: announces each held artifact (`mesh.artifact.<id>.have.<node>`) every few
  seconds and soon after it changes. A seeder reports nothing about what it served: only its
  fetchers' receipts credit it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import sys
import time
from collections.abc import AsyncIterator, Callable

from artifacts.manifest import ManifestPiece, PieceSelection, pieces_for_range, progress_text
from artifacts.piece_store import PieceStore
from artifacts.seeder import PieceHolder, SeedRoutes
from artifacts.swarm import FetchProgress, FetchReport, Peer, SwarmFetcher
from bus import subjects
from bus.client import Bus
from bus.tasks import cancel_and_wait
from schemas.artifacts import (
    ArtifactHave,
    ArtifactProgress,
    BadPieceReport,
    PeersReply,
    PeersRequest,
    decode_bits,
    encode_bits,
)
from schemas.audit import SeedWork

log = logging.getLogger("meshnet.node.artifacts")

HAVE_INTERVAL_S = 5.0


class TrackerPeers:
    """Peers of one artifact from the tracker's inventory."""

    def __init__(self, bus: Bus, artifact_id: str, node_id: str, n_pieces: int) -> None:
        self.bus = bus
        self.artifact_id = artifact_id
        self.node_id = node_id
        self.n_pieces = n_pieces

    async def peers(self) -> list[Peer]:
        reply = await self.bus.request(subjects.ARTIFACT_PEERS,
                                       PeersRequest(artifact_id=self.artifact_id, node_id=self.node_id),
                                       PeersReply, timeout=5.0)
        peers = []
        for p in reply.peers:  # one seeder's bad bitfield never hides the others
            try:
                peers.append(Peer(p.node_id, p.seed_url, frozenset(decode_bits(p.have, self.n_pieces))))
            except ValueError as exc:
                log.warning("seeder %s announced an unreadable bitfield: %s", p.node_id, exc)
        return peers

    async def report_bad(self, peer: Peer, piece: ManifestPiece, reason: str) -> None:
        await self.bus.publish(subjects.artifact("bad", self.artifact_id, self.node_id), BadPieceReport(
            node_id=self.node_id, artifact_id=self.artifact_id, peer_node_id=peer.node_id,
            piece_id=piece.piece_id, reason=reason[:300]))


async def fetch_range(bus: Bus, store: PieceStore, start: int, end: int, *, node_id: str,
                      per_peer: int = 3, stall_s: float = 60.0, terminal: bool = True) -> FetchReport:
    """Fetch every missing piece of [start, end) into `store`, showing progress."""
    m = store.manifest
    selection = pieces_for_range(m, start, end)
    subject = subjects.artifact("progress", m.artifact_id, node_id)
    label = f"fetching {m.model} layers [{start},{end})"
    tty = terminal and sys.stderr.isatty()
    last = [0.0, 0.0]  # last bus message, last printed line
    if terminal:
        _print_missing(label, store, selection)
    pending: set[asyncio.Task[None]] = set()

    progress_msg = functools.partial(_progress, node_id, m.artifact_id, start, end)

    def on_progress(p: FetchProgress) -> None:
        now = time.monotonic()
        done = p.pieces_done >= p.pieces_total
        if now - last[0] < 0.5 and not done:
            return
        last[0] = now
        if tty:  # one line, redrawn
            sys.stderr.write("\r" + progress_text(label, p.bytes_done, p.bytes_total, p.elapsed_s, p.bytes_start))
            sys.stderr.flush()
        elif terminal and (now - last[1] >= 2.0 or done):  # a log: a line every 2 s
            last[1] = now
            print(progress_text(label, p.bytes_done, p.bytes_total, p.elapsed_s, p.bytes_start), file=sys.stderr, flush=True)
        if done:
            return  # the "done" message carries the fetch's totals (below)
        task = asyncio.get_running_loop().create_task(bus.publish(subject, progress_msg(p, "fetching")))
        pending.add(task)
        task.add_done_callback(pending.discard)

    fetcher = SwarmFetcher(store, selection, TrackerPeers(bus, m.artifact_id, node_id, len(m.pieces)),
                           node_id=node_id, per_peer=per_peer, stall_s=stall_s, progress=on_progress)
    try:
        report = await fetcher.run()
        await credit_seeders(bus, m.artifact_id, node_id, report)
        final = FetchProgress(selection.nbytes, selection.nbytes, len(selection.pieces), len(selection.pieces),
                              report.seconds, sorted(report.by_peer))
        await bus.publish(subject, _with_totals(progress_msg(final, "done"), report))
    except Exception as exc:
        if fetcher.report is not None:  # what verified before it failed is owed too
            await credit_seeders(bus, m.artifact_id, node_id, fetcher.report)
        empty = FetchProgress(0, selection.nbytes, 0, len(selection.pieces), 0.0, [])
        await bus.publish(subject, progress_msg(empty, "failed", str(exc)[:300]))
        raise
    finally:
        if tty:
            sys.stderr.write("\n")
        if pending:
            await asyncio.wait(pending, timeout=2.0)
    log.info("fetched %d piece(s), %.1f MB in %.2f s (%.1f MB/s) for layers [%d,%d) (%.1f MB of cut pieces "
             "continued); %d refused, peers %s", report.pieces_fetched, report.bytes_fetched / 1e6, report.seconds,
             report.mb_s, start, end, report.bytes_resumed / 1e6, len(report.bad), report.by_peer)
    return report


def _progress(node_id: str, artifact_id: str, start: int, end: int, p: FetchProgress, state: str,
              message: str = "") -> ArtifactProgress:
    """A progress message of the fetch of layers [start, end)."""
    return ArtifactProgress(node_id=node_id, artifact_id=artifact_id, layer_start=start, layer_end=end,
                            state=state, bytes_done=p.bytes_done, bytes_total=p.bytes_total,  # type: ignore[arg-type]
                            pieces_done=p.pieces_done, pieces_total=p.pieces_total,
                            rate_mb_s=round(p.rate_mb_s, 2), eta_s=p.eta_s and round(p.eta_s, 1),
                            peers=p.peers, message=message)


def _print_missing(label: str, store: PieceStore, selection: PieceSelection) -> None:
    """The fetch's first line on the terminal: what is missing, and where it goes."""
    missing = [p for p in selection.pieces if not store.has(p)]
    print(f"{label}: {len(missing)} of {len(selection.pieces)} pieces missing "
          f"({sum(p.size for p in missing) / 1e6:.1f} of {selection.nbytes / 1e6:.1f} MB), "
          f"from the swarm into {store.root}", file=sys.stderr, flush=True)


def _with_totals(msg: ArtifactProgress, report: FetchReport) -> ArtifactProgress:
    """The fetch's "done" message: its totals from the report."""
    return msg.model_copy(update={
        "bytes_fetched": report.bytes_fetched, "bytes_already": report.bytes_already,
        "bytes_resumed": report.bytes_resumed,
        "refused": [f"{peer}:{pid}" for peer, pid in report.bad], "failed_peers": report.failed_peers,
        "rate_mb_s": round(report.mb_s, 2)})


async def credit_seeders(bus: Bus, artifact_id: str, node_id: str, report: FetchReport) -> None:
    """One `seed` audit event per seeder of this fetch: the bytes and pieces it sent that
    verified, and its pieces that did not (the ledger credits seeding from these only)."""
    for peer in sorted(report.by_peer.keys() | report.corrupt_by_peer.keys()):
        event = SeedWork(source=node_id, node_id=node_id, seeder=peer, artifact_id=artifact_id,
                         pieces=report.pieces_by_peer.get(peer, 0), bytes_served=report.by_peer.get(peer, 0),
                         corrupt_pieces=report.corrupt_by_peer.get(peer, 0))
        try:
            await bus.publish_audit(event)
        except Exception as exc:
            log.warning("seed receipt for %s not published: %s", peer, exc)


class SeedPresence:
    """Announces what this process seeds."""

    def __init__(self, bus: Bus, routes: SeedRoutes, *, node_id: str, seed_url: str,
                 interval_s: float = HAVE_INTERVAL_S) -> None:
        self.bus = bus
        self.routes = routes
        self.node_id = node_id
        self.seed_url = seed_url
        self.interval_s = interval_s
        self._changed = asyncio.Event()

    def have(self, holder: PieceHolder) -> ArtifactHave:
        m = holder.manifest
        held = holder.held()
        idx = [p.index for p in m.pieces if p.piece_id in held]
        return ArtifactHave(node_id=self.node_id, artifact_id=m.artifact_id, seed_url=self.seed_url,
                            n_pieces=len(m.pieces), have=encode_bits(idx, len(m.pieces)),
                            complete=holder.complete, held_bytes=sum(m.pieces[i].size for i in idx))

    async def announce(self) -> None:
        for holder in list(self.routes.holders.values()):
            await self.bus.publish(subjects.artifact("have", holder.manifest.artifact_id, self.node_id),
                                   self.have(holder))

    def changed(self) -> None:
        """A piece arrived or a holder was added: announce soon."""
        self._changed.set()

    async def run(self) -> None:
        while True:
            try:
                await self.announce()
            except Exception as exc:
                log.warning("artifact announce failed: %s", exc)
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), self.interval_s)
                await asyncio.sleep(0.2)  # gather a burst of changes into one announcement
            except TimeoutError:
                pass

    def tasks(self) -> Callable[[object], AsyncIterator[None]]:
        """A cleanup context for the node's app: the announce loop."""

        async def ctx(_app: object) -> AsyncIterator[None]:
            loops = [asyncio.create_task(self.run(), name="artifact-have")]
            try:
                yield
            finally:
                await cancel_and_wait(loops)

        return ctx
