"""Shard Swarm fetcher: the pieces of one layer range, from several seeders in parallel.

- Each needed piece not yet in the store is fetched from a peer that has it (`per_peer`
  requests in flight per peer), hashed while it streams, written to a `.part` file and renamed
  into the store only when its sha256 matches (PieceStore.commit). A restart resumes: verified
  pieces are never fetched again.
- A piece that does not verify (wrong hash, short body) is refused, reported through
  `PeerSource.report_bad` naming the peer, and fetched from another peer. A peer whose
  connection fails is left alone for `dead_peer_s` and its pieces go to the others.
- Peers come from `PeerSource.peers()` (the tracker's inventory): asked at start and again
  whenever no live peer holds a missing piece, until `stall_s` passes without progress.
This module does no bus I/O: the node wires the PeerSource to the tracker (nodes/artifact_plane.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import aiohttp

from artifacts.manifest import ManifestError, ManifestPiece, PieceSelection
from artifacts.piece_store import PieceStore
from artifacts.seeder import NODE_HEADER, piece_path

log = logging.getLogger("meshnet.artifacts.swarm")

DEFAULT_PER_PEER = 3
ABSORB_WINDOW = 8  # chunks of one piece waiting for the absorber thread at most (bounds memory)
BAN_AFTER = 2  # bad pieces from one peer before this fetch stops asking it at all
READ_BUFFER = 4 << 20  # bytes a response may buffer before reading pauses (aiohttp: 64 KiB)


class SwarmError(RuntimeError):
    """The pieces could not all be fetched: which are missing, and why."""

    def __init__(self, message: str, *, missing: list[str]) -> None:
        super().__init__(message)
        self.missing = missing


@dataclass(frozen=True, slots=True)
class Peer:
    """A seeder as the inventory lists it: piece indexes it holds."""

    node_id: str
    url: str
    have: frozenset[int]


class PeerSource(Protocol):
    async def peers(self) -> list[Peer]:
        """Current seeders of the artifact (not this node)."""
        ...

    async def report_bad(self, peer: Peer, piece: ManifestPiece, reason: str) -> None:
        """Tell whoever keeps the inventory that `peer` sent a bad `piece`."""
        ...


@dataclass(slots=True)
class FetchProgress:
    bytes_done: int
    bytes_total: int
    pieces_done: int
    pieces_total: int
    elapsed_s: float
    peers: list[str]

    @property
    def rate_mb_s(self) -> float:
        return self.bytes_done / self.elapsed_s / 1e6 if self.elapsed_s > 0 else 0.0

    @property
    def eta_s(self) -> float | None:
        rate = self.bytes_done / self.elapsed_s if self.elapsed_s > 0 else 0.0
        return (self.bytes_total - self.bytes_done) / rate if rate > 0 else None


@dataclass(slots=True)
class FetchReport:
    """What a fetch did: bytes needed and fetched (every byte received, refused ones too)."""

    bytes_needed: int  # the range's pieces (PieceSelection.nbytes)
    bytes_already: int  # held before the fetch started (a resume)
    bytes_fetched: int = 0
    pieces_fetched: int = 0
    seconds: float = 0.0
    by_peer: dict[str, int] = field(default_factory=dict)
    bad: list[tuple[str, str]] = field(default_factory=list)  # (peer, piece_id) refused
    failed_peers: list[str] = field(default_factory=list)

    @property
    def mb_s(self) -> float:
        return self.bytes_fetched / self.seconds / 1e6 if self.seconds > 0 else 0.0


class _BadPiece(Exception):
    """The peer sent bytes that do not verify (reported, and the peer is asked for it no more)."""


class _NotHeld(Exception):
    """The peer no longer holds the piece (a stale inventory: not its fault, not reported)."""


class LocalStoreError(SwarmError):
    """Writing a piece to this node's store failed (disk full, say): the fetch stops."""


async def _local(fut: Future[None]) -> None:
    """Wait for an absorber chunk; a failure there is this node's, never the peer's."""
    try:
        await asyncio.wrap_future(fut)
    except OSError as exc:
        raise LocalStoreError(f"writing a piece to the store failed: {exc}", missing=[]) from exc


class SwarmFetcher:
    """Fetch the missing pieces of `selection` into `store`."""

    def __init__(self, store: PieceStore, selection: PieceSelection, source: PeerSource, *,
                 node_id: str = "", per_peer: int = DEFAULT_PER_PEER, dead_peer_s: float = 10.0,
                 stall_s: float = 60.0, progress: Callable[[FetchProgress], None] | None = None) -> None:
        self.store = store
        self.selection = selection
        self.source = source
        self.node_id = node_id
        self.per_peer = max(1, per_peer)
        self.dead_peer_s = dead_peer_s
        self.stall_s = stall_s
        self.progress = progress
        self._dead: dict[str, float] = {}
        self._refused: set[tuple[str, str]] = set()  # (peer, piece_id) that sent bad bytes
        self._banned: set[str] = set()
        self._in_flight: set[str] = set()
        self._absorber: ThreadPoolExecutor  # made by run(): hashes and writes pieces' chunks in order

    async def run(self) -> FetchReport:
        sel = self.selection
        todo = [p for p in sel.pieces if not self.store.has(p)]
        already = sel.nbytes - sum(p.size for p in todo)
        report = FetchReport(bytes_needed=sel.nbytes, bytes_already=already)
        t0 = time.monotonic()
        self._done_bytes, self._done_pieces = already, len(sel.pieces) - len(todo)
        self._t0 = t0
        pending = {p.piece_id: p for p in todo}
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=5.0, sock_read=15.0)
        headers = {NODE_HEADER: self.node_id} if self.node_id else None
        self._absorber = ThreadPoolExecutor(max_workers=1, thread_name_prefix="piece-absorb")
        try:
            async with aiohttp.ClientSession(timeout=timeout, headers=headers, read_bufsize=READ_BUFFER) as http:
                await self._rounds(http, pending, report)
        finally:
            self._absorber.shutdown(wait=True)  # every chunk handed over is written (or its fd gone)
        report.seconds = time.monotonic() - t0
        self._notify([])
        return report

    async def _rounds(self, http: aiohttp.ClientSession, pending: dict[str, ManifestPiece],
                      report: FetchReport) -> None:
        """Rounds of workers over the live peers until nothing is pending (or it stalls)."""
        sel = self.selection
        last_progress = time.monotonic()
        while pending:
            peers = [p for p in await self._ask_peers() if not self._is_dead(p.node_id)]
            usable = [p for p in peers if any(self._can(p, pc) for pc in pending.values())]
            if not usable:
                if time.monotonic() - last_progress > self.stall_s:
                    named = ", ".join(f"{p.piece_id[:16]}… ({p.role}{'' if p.layer is None else f' {p.layer}'})"
                                      for p in list(pending.values())[:8])
                    raise SwarmError(
                        f"no live peer holds {len(pending)} missing piece(s) of layers "
                        f"[{sel.start},{sel.end}) (asked for {self.stall_s:.0f} s): {named}"
                        + (" …" if len(pending) > 8 else ""), missing=sorted(pending))
                await asyncio.sleep(0.5)
                continue
            before = len(pending)
            workers = [self._worker(http, peer, pending, report) for peer in usable for _ in range(self.per_peer)]
            await asyncio.gather(*workers)
            if len(pending) < before:
                last_progress = time.monotonic()

    async def _ask_peers(self) -> list[Peer]:
        try:
            return [p for p in await self.source.peers() if p.node_id != self.node_id]
        except Exception as exc:  # the tracker may be restarting: ask again on the next round
            log.warning("peer list unavailable: %s", exc)
            return []

    def _is_dead(self, node_id: str) -> bool:
        if node_id in self._banned:
            return True
        t = self._dead.get(node_id)
        return t is not None and time.monotonic() - t < self.dead_peer_s

    def _can(self, peer: Peer, piece: ManifestPiece) -> bool:
        return piece.index in peer.have and (peer.node_id, piece.piece_id) not in self._refused

    def _next(self, peer: Peer, pending: dict[str, ManifestPiece]) -> ManifestPiece | None:
        for piece in pending.values():  # file order: a head's embedding first, layers in order
            if piece.piece_id not in self._in_flight and self._can(peer, piece):
                return piece
        return None

    async def _worker(self, http: aiohttp.ClientSession, peer: Peer, pending: dict[str, ManifestPiece],
                      report: FetchReport) -> None:
        while not self._is_dead(peer.node_id):
            piece = self._next(peer, pending)
            if piece is None:
                return
            self._in_flight.add(piece.piece_id)
            try:
                got = await self._fetch_one(http, peer, piece, report)
            except _NotHeld:
                self._refused.add((peer.node_id, piece.piece_id))  # ask the others for it
                continue
            except _BadPiece as exc:
                self._refused.add((peer.node_id, piece.piece_id))
                report.bad.append((peer.node_id, piece.piece_id))
                if sum(1 for p, _ in report.bad if p == peer.node_id) >= BAN_AFTER:
                    self._banned.add(peer.node_id)
                log.warning("piece %s from %s refused: %s", piece.piece_id[:16], peer.node_id, exc)
                try:
                    await self.source.report_bad(peer, piece, str(exc))
                except Exception as rexc:
                    log.warning("bad-piece report not sent: %s", rexc)
                continue
            except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                self._dead[peer.node_id] = time.monotonic()
                if peer.node_id not in report.failed_peers:
                    report.failed_peers.append(peer.node_id)
                log.warning("peer %s failed (%s: %s); its pieces go to the others", peer.node_id,
                            type(exc).__name__, exc)
                return
            finally:
                self._in_flight.discard(piece.piece_id)
            if got:
                pending.pop(piece.piece_id, None)
                self._done_bytes += piece.size
                self._done_pieces += 1
                report.pieces_fetched += 1
                self._notify([peer.node_id])

    async def _fetch_one(self, http: aiohttp.ClientSession, peer: Peer, piece: ManifestPiece,
                         report: FetchReport) -> bool:
        """Stream one piece into a .part file, verify, commit. False if another worker beat us."""
        url = peer.url.rstrip("/") + piece_path(self.store.manifest.artifact_id, piece.piece_id)
        fd, tmp = self.store.open_partial(piece)
        hasher = hashlib.sha256()
        size = 0
        queued: deque[Future[None]] = deque()  # chunks handed to the absorber thread, oldest first
        committed = False
        try:
            async with http.get(url) as resp:
                if resp.status != 200:
                    body = (await resp.read())[:200]
                    if resp.status == 404:
                        raise _NotHeld(f"HTTP 404: {body!r}")
                    raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status,
                                                      message=body.decode(errors="replace"))
                async for chunk in resp.content.iter_any():  # what arrived, without re-chunking copies
                    size += len(chunk)
                    report.bytes_fetched += len(chunk)
                    report.by_peer[peer.node_id] = report.by_peer.get(peer.node_id, 0) + len(chunk)
                    if size > piece.size:
                        raise _BadPiece(f"more than its {piece.size} bytes")
                    if len(queued) >= ABSORB_WINDOW:
                        await _local(queued.popleft())  # a few chunks wait at most: memory stays bounded
                    # hashed and written on the absorber thread while the loop receives the next
                    # chunks; hashlib and os.write release the GIL
                    queued.append(self._absorber.submit(_absorb, fd, hasher, chunk))
            while queued:
                await _local(queued.popleft())
            if self.store.has(piece):  # the same bytes came in under another index meanwhile
                return False
            os.close(fd)
            fd = -1
            try:
                self.store.commit(tmp, piece, hasher.hexdigest(), size)  # removes tmp when it does not verify
                committed = True
            except ManifestError as exc:
                raise _BadPiece(str(exc)) from None
            return True
        finally:
            if queued:  # nothing may write to fd once it is closed
                await asyncio.gather(*(asyncio.wrap_future(f) for f in queued), return_exceptions=True)
            if fd >= 0:
                os.close(fd)
            if not committed:
                with contextlib.suppress(FileNotFoundError):  # commit removes a tmp that did not verify
                    os.unlink(tmp)

    def _notify(self, peers: list[str]) -> None:
        if self.progress is not None:
            self.progress(FetchProgress(self._done_bytes, self.selection.nbytes, self._done_pieces,
                                        len(self.selection.pieces), time.monotonic() - self._t0, peers))


def _absorb(fd: int, hasher: hashlib._Hash, chunk: bytes) -> None:
    hasher.update(chunk)
    view = memoryview(chunk)
    while view:
        n = os.write(fd, view)
        view = view[n:]
