"""Shard Swarm fetcher: the pieces of one layer range, from several seeders in parallel.

- Each needed piece not yet in the store is fetched from a peer that has it (`per_peer`
  requests in flight per peer, each on a worker thread with a keep-alive connection of its
  own: artifacts/piece_link.py), hashed while it streams, written to a `.part` file and renamed
  into the store only when its sha256 matches (PieceStore.commit). A restart resumes: verified
  pieces are never fetched again.
- A piece that does not verify (wrong hash, short body) is refused, reported through
  `PeerSource.report_bad` naming the peer, and fetched from another peer.
- Per peer, the report counts only the bytes of pieces that verified (`by_peer`: what the
  node credits each seeder with) and the pieces that did not (`corrupt_by_peer`: no credit). A peer whose
  connection fails is left alone for `dead_peer_s` and its pieces go to the others.
- The endgame: a worker with nothing left to ask its peer for waits while other peers' pieces
  come, and takes over one whose sender is far slower than its own peer (`worth_taking_over`):
  the slow fetch is cut (not counted as a failure) and the piece continued after its bytes.
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
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

from artifacts.manifest import ManifestError, ManifestPiece, PieceSelection
from artifacts.piece_link import LocalWriteError, PieceLink, PieceStatusError, TooLongError
from artifacts.piece_store import PieceStore
from artifacts.seeder import piece_path

log = logging.getLogger("meshnet.artifacts.swarm")

DEFAULT_PER_PEER = 3
BAN_AFTER = 2  # bad pieces from one peer before this fetch stops asking it at all
MAX_THREADS = 16  # fetching threads at most, whatever the number of peers
PROGRESS_EVERY_S = 1.0  # progress while pieces are coming, not only when one is verified
TAKEOVER_AFTER_S = 1.0  # a piece in flight this long may be taken over by an idle, faster peer
TAKEOVER_PATIENCE = 4.0  # ... or this many times what the idle peer needs for its rest, if less
TAKEOVER_MARGIN = 2.0  # ... one measured this many times faster per piece than its sender now
TAKEOVER_MIN_GAIN_S = 0.5  # ... and that would finish its rest at least this much sooner
TAKE_BACK_AFTER_S = 5.0  # a piece goes back to the peer it was taken from only if nothing came this long
RATE_MIN_BYTES = 256 << 10  # a fetch this long measures its peer's rate (a shorter one measures the round trip)
IDLE_POLL_S = 0.1  # an idle worker looks again this often while other peers' pieces come


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
    bytes_start: int = 0  # held already when the fetch began: in bytes_done, not in the rate

    @property
    def rate_mb_s(self) -> float:
        return (self.bytes_done - self.bytes_start) / self.elapsed_s / 1e6 if self.elapsed_s > 0 else 0.0

    @property
    def eta_s(self) -> float | None:
        rate = self.rate_mb_s * 1e6
        return (self.bytes_total - self.bytes_done) / rate if rate > 0 else None


@dataclass(slots=True)
class FetchReport:
    """What a fetch did: bytes needed and fetched (every byte received, refused ones too), and
    per peer the bytes of pieces that verified (its seeding credit) and the pieces that did not."""

    bytes_needed: int  # the range's pieces (PieceSelection.nbytes)
    bytes_already: int  # in verified pieces before the fetch started (a resume)
    bytes_fetched: int = 0
    bytes_resumed: int = 0  # of partial pieces an earlier run left, kept (not fetched again)
    pieces_fetched: int = 0
    seconds: float = 0.0
    # per peer: bytes it sent of pieces that verified (a piece continued from another peer's
    # bytes credits each with its own share); those pieces; pieces it sent that did not verify
    by_peer: dict[str, int] = field(default_factory=dict)
    pieces_by_peer: dict[str, int] = field(default_factory=dict)
    corrupt_by_peer: dict[str, int] = field(default_factory=dict)
    bad: list[tuple[str, str]] = field(default_factory=list)  # (peer, piece_id) refused
    failed_peers: list[str] = field(default_factory=list)

    @property
    def mb_s(self) -> float:
        return self.bytes_fetched / self.seconds / 1e6 if self.seconds > 0 else 0.0


def worth_taking_over(remaining: int, received: int, age_s: float, own_rate: float | None) -> bool:
    """Whether an idle peer whose last piece came at `own_rate` bytes/s (None: not measured)
    should take over a piece whose holder received `received` bytes in `age_s` and has
    `remaining` to send (pure). Only after the piece has been coming TAKEOVER_AFTER_S, or
    TAKEOVER_PATIENCE times what the idle peer needs for the rest if less (a near seeder need
    not wait a second for a far one's first bytes); only a peer faster by TAKEOVER_MARGIN that
    would finish TAKEOVER_MIN_GAIN_S sooner. A holder that received nothing is the slowest."""
    if own_rate is None or own_rate <= 0 or remaining <= 0 or age_s <= 0:
        return False
    own_s = remaining / own_rate
    if age_s < min(TAKEOVER_AFTER_S, TAKEOVER_PATIENCE * own_s):
        return False
    their_rate = received / age_s
    if their_rate <= 0:
        return True
    if their_rate * TAKEOVER_MARGIN > own_rate:
        return False
    return remaining / their_rate - own_s >= TAKEOVER_MIN_GAIN_S


@dataclass(slots=True)
class _Flight:
    """A piece being fetched: from which peer, since when, on which link (set once its partial
    file is open), the bytes that partial held, and whether another peer takes it over."""

    peer_id: str
    started: float
    link: PieceLink | None = None
    resumed: int = 0
    taken: bool = False  # its link was cut on purpose: not a failure of its peer
    ended: asyncio.Event = field(default_factory=asyncio.Event)


class _BadPiece(Exception):
    """The peer sent bytes that do not verify (reported, and the peer is asked for it no more)."""


class _NotHeld(Exception):
    """The peer no longer holds the piece (a stale inventory: not its fault, not reported)."""


class LocalStoreError(SwarmError):
    """Writing a piece to this node's store failed (disk full, say): the fetch stops."""


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
        self._shown = 0  # the bytes_done last reported: progress never goes back
        self._dead: dict[str, float] = {}
        self._refused: set[tuple[str, str]] = set()  # (peer, piece_id) that sent bad bytes
        self._banned: set[str] = set()
        self._in_flight: dict[str, _Flight] = {}  # piece -> its fetch now
        self._reserved: dict[str, str] = {}  # piece -> the peer taking it over (its old fetch is stopping)
        self._lost: set[tuple[str, str]] = set()  # (peer, piece) taken over from that peer
        self._rates: dict[str, float] = {}  # peer -> bytes/s of its last whole fetch (one piece's stream)
        self._threads: ThreadPoolExecutor  # made by run(): where pieces are received, hashed, written
        self._inherited: dict[str, int] = {}  # piece -> bytes its partial file held when run() began
        self._sent: dict[str, dict[str, int]] = {}  # piece -> peer -> bytes of its partial file from that peer
        self.report: FetchReport | None = None  # run()'s, as it goes (what was verified so far if it fails)

    async def run(self) -> FetchReport:
        sel = self.selection
        todo = [p for p in sel.pieces if not self.store.has(p)]
        already = sel.nbytes - sum(p.size for p in todo)
        report = self.report = FetchReport(bytes_needed=sel.nbytes, bytes_already=already)
        t0 = time.monotonic()
        self._done_bytes, self._done_pieces = already, len(sel.pieces) - len(todo)
        self._start_bytes = already
        self._t0 = t0
        pending = {p.piece_id: p for p in todo}
        self._inherited = {p.piece_id: self.store.partial_bytes(p) for p in todo}  # cut pieces' bytes
        self._threads = ThreadPoolExecutor(max_workers=MAX_THREADS, thread_name_prefix="piece-fetch")
        ticker = asyncio.create_task(self._tick())
        try:
            await self._rounds(pending, report)
        finally:
            ticker.cancel()
            await asyncio.wait({ticker})
            self._threads.shutdown(wait=True)  # every fetch handed over has returned (see _fetch_one)
        report.seconds = time.monotonic() - t0
        self._notify([])
        return report

    async def _rounds(self, pending: dict[str, ManifestPiece], report: FetchReport) -> None:
        """Rounds of workers over the live peers until nothing is pending (or it stalls)."""
        last_progress = time.monotonic()
        while pending:
            peers = [p for p in await self._ask_peers() if not self._is_dead(p.node_id)]
            usable = [p for p in peers if any(self._can(p, pc) for pc in pending.values())]
            if not usable:
                if time.monotonic() - last_progress > self.stall_s:
                    raise SwarmError(self._stalled(pending, report), missing=sorted(pending))
                await asyncio.sleep(0.5)
                continue
            before = len(pending)
            workers = [self._worker(peer, pending, report) for peer in usable for _ in range(self.per_peer)]
            await asyncio.gather(*workers)
            if len(pending) < before:
                last_progress = time.monotonic()

    def _stalled(self, pending: dict[str, ManifestPiece], report: FetchReport) -> str:
        """Why the fetch gives up: the pieces no live peer holds, and for each the peers whose
        copy was refused (it did not verify), so that a rotten seeder is not taken for none."""
        bad: dict[str, set[str]] = {}
        for peer_id, piece_id in report.bad:
            bad.setdefault(piece_id, set()).add(peer_id)

        def name(p: ManifestPiece) -> str:
            where = p.role if p.layer is None else f"layer {p.layer}"
            if p.piece_id in bad:
                where += f"; the copy from {', '.join(sorted(bad[p.piece_id]))} did not verify"
            return f"{p.piece_id[:16]}… ({where})"

        sel = self.selection
        named = ", ".join(name(p) for p in list(pending.values())[:8]) + (" …" if len(pending) > 8 else "")
        return (f"no live peer holds {len(pending)} missing piece(s) of layers [{sel.start},{sel.end}) "
                f"(asked for {self.stall_s:.0f} s): {named}")

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
            if piece.piece_id not in self._in_flight and piece.piece_id not in self._reserved and self._can(peer, piece):
                return piece
        return None

    async def _worker(self, peer: Peer, pending: dict[str, ManifestPiece], report: FetchReport) -> None:
        link = PieceLink(peer.url)
        try:
            await self._work(link, peer, pending, report)
        finally:
            link.close()

    async def _work(self, link: PieceLink, peer: Peer, pending: dict[str, ManifestPiece],
                    report: FetchReport) -> None:
        while not self._is_dead(peer.node_id):
            piece = self._next(peer, pending) or await self._take_over(peer, pending)
            if piece is None:
                if not self._others_fetching(peer, pending):
                    return
                await asyncio.sleep(IDLE_POLL_S)  # the endgame: one of them may be worth taking over
                continue
            flight = self._in_flight[piece.piece_id] = _Flight(peer.node_id, time.monotonic())
            try:
                got = await self._fetch_one(link, peer, piece, report)
            except _NotHeld:
                self._refused.add((peer.node_id, piece.piece_id))  # ask the others for it
                continue
            except _BadPiece as exc:
                await self._refuse(peer, piece, str(exc), report)
                continue
            except (OSError, PieceStatusError) as exc:  # unreachable, cut, timed out, an HTTP error
                if flight.taken:  # cut on purpose: a faster peer continues the piece
                    continue
                self._dead[peer.node_id] = time.monotonic()
                if peer.node_id not in report.failed_peers:
                    report.failed_peers.append(peer.node_id)
                log.warning("peer %s failed (%s: %s); its pieces go to the others", peer.node_id,
                            type(exc).__name__, exc)
                return
            finally:
                del self._in_flight[piece.piece_id]
                flight.ended.set()
            if got:
                pending.pop(piece.piece_id, None)
                self._done_bytes += piece.size
                self._done_pieces += 1
                report.pieces_fetched += 1
                self._notify([peer.node_id])

    async def _refuse(self, peer: Peer, piece: ManifestPiece, reason: str, report: FetchReport) -> None:
        """`peer` sent a copy of `piece` that does not verify: count it, ban the peer after
        BAN_AFTER, and report it."""
        self._refused.add((peer.node_id, piece.piece_id))
        report.bad.append((peer.node_id, piece.piece_id))
        report.corrupt_by_peer[peer.node_id] = report.corrupt_by_peer.get(peer.node_id, 0) + 1
        if sum(1 for p, _ in report.bad if p == peer.node_id) >= BAN_AFTER:
            self._banned.add(peer.node_id)
        log.warning("piece %s from %s refused: %s", piece.piece_id[:16], peer.node_id, reason)
        try:
            await self.source.report_bad(peer, piece, reason)
        except Exception as rexc:
            log.warning("bad-piece report not sent: %s", rexc)

    def _others_fetching(self, peer: Peer, pending: dict[str, ManifestPiece]) -> bool:
        """Another peer is fetching a piece `peer` could send too."""
        return any(f.peer_id != peer.node_id and pid in pending and self._can(peer, pending[pid])
                   for pid, f in self._in_flight.items())

    async def _take_over(self, peer: Peer, pending: dict[str, ManifestPiece]) -> ManifestPiece | None:
        """(`peer` is idle.) A piece another peer sends so slowly that `peer` would finish its
        rest well before (worth_taking_over): its fetch is cut, and once it has stopped writing
        the piece is `peer`'s, continued after the bytes its partial file holds. None if none."""
        now = time.monotonic()
        for pid, f in list(self._in_flight.items()):
            piece = pending.get(pid)
            if (piece is None or f.peer_id == peer.node_id or f.taken or f.link is None
                    or not self._can(peer, piece)):
                continue
            received, age = f.link.received, now - f.started
            if (peer.node_id, pid) in self._lost and (received or age < TAKE_BACK_AFTER_S):
                continue  # two peers on one crowded link would trade it forever; a silent holder is left
            if not worth_taking_over(piece.size - f.resumed - received, received, age, self._rate_now(peer.node_id)):
                continue
            f.taken = True
            self._lost.add((f.peer_id, pid))
            self._reserved[pid] = peer.node_id  # no other worker takes it meanwhile
            f.link.abort()
            try:
                await f.ended.wait()
            finally:
                del self._reserved[pid]
            log.info("piece %s: %s sent %d of %d bytes in %.1f s; %s continues it", pid[:16], f.peer_id,
                     f.resumed + received, piece.size, age, peer.node_id)
            return piece if pid in pending else None
        return None

    def _rate_now(self, peer_id: str) -> float | None:
        """`peer_id`'s rate per piece: that of its last whole fetch, or less if one of its pieces
        in flight now comes slower (a seeder that stalled since is no faster than its stall)."""
        rate = self._rates.get(peer_id)
        now = time.monotonic()
        for f in self._in_flight.values():
            if rate is not None and f.peer_id == peer_id and f.link is not None and now - f.started >= TAKEOVER_AFTER_S:
                rate = min(rate, f.link.received / (now - f.started))
        return rate

    async def _fetch_one(self, link: PieceLink, peer: Peer, piece: ManifestPiece, report: FetchReport) -> bool:
        """Fetch one piece into its partial file on a worker thread, verify, commit. False if
        another worker beat us to it.

        A partial file left by a cut download (this process's, or one killed before it) is
        continued with a Range for the rest, whichever peer sent its first bytes. If the
        whole then does not verify, nobody can tell whose bytes were wrong: the partial is
        dropped and the piece fetched whole from this peer, which is blamed only if that
        fails too. Bytes of a peer that failed mid-piece stay for the next one."""
        for attempt in (0, 1):
            fd, tmp, resumed = self._open_partial(piece, whole=attempt == 1)
            flight = self._in_flight[piece.piece_id]
            flight.link, flight.resumed = link, resumed
            hasher = hashlib.sha256()
            keep = True  # what came stays for the next attempt (a cut, a stop), unless known bad
            try:
                size = await self._on_thread(link, peer, piece, report, piece_path(
                    self.store.manifest.artifact_id, piece.piece_id), fd, piece.size, hasher, resumed)
                if self.store.has(piece):  # the same bytes came in under another index meanwhile
                    keep = False
                    return False
                os.close(fd)
                fd = -1
                try:
                    self.store.commit(tmp, piece, hasher.hexdigest(), resumed + size)  # removes tmp if bad
                    keep = False  # it is the piece now
                except OSError as exc:
                    raise LocalStoreError(self._local(f"committing piece {piece.piece_id[:16]}… failed: {exc}"),
                                          missing=[piece.piece_id]) from exc
                except ManifestError as exc:
                    if resumed:
                        log.info("piece %s: resumed at %d bytes, did not verify; fetched whole again",
                                 piece.piece_id[:16], resumed)
                        continue
                    keep = False
                    raise _BadPiece(str(exc)) from None
                # bytes a cut download of an earlier run left; this run's own are in bytes_fetched
                report.bytes_resumed += min(resumed, self._inherited.pop(piece.piece_id, 0))
                self._credit(piece, report)
                return True
            except PieceStatusError as exc:
                if exc.status == 416 and resumed:  # the seeder refused the rest's range: start over
                    continue
                if exc.status == 404:
                    raise _NotHeld(str(exc)) from None
                raise
            except TooLongError as exc:
                keep = False
                raise _BadPiece(str(exc)) from None
            except LocalWriteError as exc:
                raise LocalStoreError(self._local(str(exc)), missing=[piece.piece_id]) from exc
            finally:
                if fd >= 0:
                    os.close(fd)
                if not keep:
                    self.store.drop_partial(piece)
                    self._forget_partial(piece)
        raise AssertionError("unreachable")  # the second attempt returns or raises

    def _local(self, what: str) -> str:
        """A failure of this node's own store, saying which directory (and its free space)."""
        try:
            free = f"{shutil.disk_usage(self.store.root).free / 1e6:.1f} MB free"
        except OSError:
            free = "free space unknown"
        return f"{what} (piece store {self.store.root}, {free}; --store puts it elsewhere)"

    def _open_partial(self, piece: ManifestPiece, *, whole: bool) -> tuple[int, str, int]:
        """The piece's partial file: (fd, path, bytes to resume from); emptied when `whole`."""
        try:
            fd, tmp, have = self.store.open_partial(piece)
            if whole:
                os.ftruncate(fd, 0)
        except OSError as exc:  # this node's disk, never the peer's fault: the fetch stops
            raise LocalStoreError(self._local(f"opening the partial file of piece {piece.piece_id[:16]}… failed: {exc}"),
                                  missing=[piece.piece_id]) from exc
        if whole:
            self._forget_partial(piece)
        return fd, tmp, 0 if whole else have

    def _forget_partial(self, piece: ManifestPiece) -> None:
        """No byte of `piece`'s partial file is an earlier run's or any peer's any more."""
        self._inherited[piece.piece_id] = 0
        self._sent.pop(piece.piece_id, None)

    def _credit(self, piece: ManifestPiece, report: FetchReport) -> None:
        """`piece` verified: credit each peer this run received its bytes from with its share."""
        for node_id, nbytes in self._sent.pop(piece.piece_id, {}).items():
            report.by_peer[node_id] = report.by_peer.get(node_id, 0) + nbytes
            report.pieces_by_peer[node_id] = report.pieces_by_peer.get(node_id, 0) + 1

    async def _on_thread(self, link: PieceLink, peer: Peer, piece: ManifestPiece, report: FetchReport,
                         *args: object) -> int:
        """_fetch_rest(link, *args) on a fetching thread, the bytes `link` received counted however it ends
        (in `piece`'s share from `peer`, credited only if the piece verifies).
        A cancelled fetch is aborted and awaited: nothing writes to the piece's fd after this."""
        t0 = time.monotonic()
        job = asyncio.get_running_loop().run_in_executor(self._threads, _fetch_rest, link, *args)
        try:
            size = await asyncio.shield(job)
            if link.received >= RATE_MIN_BYTES:
                self._rates[peer.node_id] = link.received / max(time.monotonic() - t0, 1e-6)
            return size
        except asyncio.CancelledError:
            link.abort()  # the thread's recv returns at once
            with contextlib.suppress(Exception):
                await job
            raise
        finally:
            report.bytes_fetched += link.received
            if link.received:
                sent = self._sent.setdefault(piece.piece_id, {})
                sent[peer.node_id] = sent.get(peer.node_id, 0) + link.received

    async def _tick(self) -> None:
        """Progress every PROGRESS_EVERY_S between pieces too: on a slow link one piece takes
        many seconds, and its bytes count as they come."""
        while True:
            await asyncio.sleep(PROGRESS_EVERY_S)
            self._notify([])

    def _notify(self, peers: list[str]) -> None:
        if self.progress is None:
            return
        coming = sum(f.link.received for f in self._in_flight.values() if f.link)  # pieces not yet verified
        self._shown = max(self._shown, min(self._done_bytes + coming, self.selection.nbytes))
        if self._done_pieces == len(self.selection.pieces):
            self._shown = self.selection.nbytes
        self.progress(FetchProgress(self._shown, self.selection.nbytes, self._done_pieces,
                                    len(self.selection.pieces), time.monotonic() - self._t0, peers,
                                    self._start_bytes))


def _fetch_rest(link: PieceLink, path: str, fd: int, size: int, hasher: hashlib._Hash, have: int) -> int:
    """(On a fetching thread.) Hash the `have` bytes a partial file holds, then fetch the rest
    of the piece after them; the bytes fetched."""
    link.received = 0
    view = memoryview(bytearray(min(have, 1 << 20) or 1))
    off = 0
    while off < have:
        try:
            n = os.preadv(fd, [view[:min(len(view), have - off)]], off)
        except OSError as exc:
            raise LocalWriteError(f"reading the partial file failed: {exc}") from exc
        if n <= 0:
            raise LocalWriteError(f"the partial file shrank under us at {off} of {have} bytes")
        hasher.update(view[:n])
        off += n
    if have >= size:  # all there (cut between the last write and the commit): nothing to ask for
        return 0
    return link.fetch(path, fd, size, hasher, start=have)
