"""Fetching pieces on worker threads (artifacts/piece_link.py) and continuing cut pieces
(artifacts/swarm.py), against a real seeder (artifacts/seeder.py) on loopback HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from aiohttp import web

from artifacts.manifest import ArtifactManifest, ManifestPiece, build_manifest, pieces_for_range
from artifacts.piece_link import PieceLink, PieceLinkError, PieceStatusError, TooLongError
from artifacts.piece_store import PieceStore
from artifacts.seeder import SeedRoutes, WholeFileHolder, piece_path
from artifacts.swarm import LocalStoreError, Peer, SwarmFetcher
from tests.fixtures.http_app import serve_app


@pytest.fixture(scope="module")
def manifest(model_path: Path) -> ArtifactManifest:
    return build_manifest(model_path)


@pytest_asyncio.fixture
async def seeder(manifest: ArtifactManifest, model_path: Path) -> AsyncIterator[tuple[str, SeedRoutes]]:
    routes = SeedRoutes()
    routes.add(WholeFileHolder(model_path, manifest))
    app = web.Application()
    routes.register(app)
    runner, url = await serve_app(app)
    try:
        yield url, routes
    finally:
        await runner.cleanup()


class Recorder:
    """A PeerSource of fixed peers that records bad-piece reports."""

    def __init__(self, peers: list[Peer]) -> None:
        self._peers = peers
        self.reports: list[tuple[str, str]] = []

    async def peers(self) -> list[Peer]:
        return self._peers

    async def report_bad(self, peer: Peer, piece: ManifestPiece, reason: str) -> None:
        self.reports.append((peer.node_id, piece.piece_id))


def _open_under(root: Path) -> list[str]:
    """Files under root this process holds open."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith(str(root)):
                out.append(target)
    return out


def _piece_bytes(model_path: Path, piece: ManifestPiece) -> bytes:
    with open(model_path, "rb") as f:
        f.seek(piece.offset)
        return f.read(piece.size)


async def test_pieces_come_whole_or_from_an_offset_over_one_kept_connection(
        seeder: tuple[str, SeedRoutes], manifest: ArtifactManifest, model_path: Path, tmp_path: Path) -> None:
    url, _ = seeder
    link = PieceLink(url)
    a, b = manifest.pieces[1], manifest.pieces[2]
    path = tmp_path / "piece"
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:
        h = hashlib.sha256()
        n = await asyncio.to_thread(link.fetch, piece_path(manifest.artifact_id, a.piece_id), fd, a.size, h)
        assert (n, h.hexdigest()) == (a.size, a.piece_id)
        sock = link._sock
        os.ftruncate(fd, 0)
        cut = b.size // 3  # a partial piece: its first third is there, the rest asked with a Range
        os.pwrite(fd, _piece_bytes(model_path, b)[:cut], 0)
        h = hashlib.sha256(_piece_bytes(model_path, b)[:cut])
        n = await asyncio.to_thread(link.fetch, piece_path(manifest.artifact_id, b.piece_id), fd, b.size, h,
                                    start=cut)
        assert (n, h.hexdigest(), link._sock) == (b.size - cut, b.piece_id, sock)  # the same connection
        assert path.read_bytes() == _piece_bytes(model_path, b)
        # a piece the seeder does not have: a typed status, and the link works on afterwards
        with pytest.raises(PieceStatusError) as err:
            await asyncio.to_thread(link.fetch, piece_path(manifest.artifact_id, "0" * 64), fd, 10, hashlib.sha256())
        assert err.value.status == 404 and b"unknown_piece" in err.value.body
        h = hashlib.sha256()
        await asyncio.to_thread(link.fetch, piece_path(manifest.artifact_id, a.piece_id), fd, a.size, h)
        assert h.hexdigest() == a.piece_id
    finally:
        os.close(fd)
        link.close()


async def test_a_cut_body_and_an_oversized_one_are_told_apart(tmp_path: Path) -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        resp.content_length = 1000 if request.path.endswith("cut") else 50
        await resp.prepare(request)
        await resp.write(b"x" * 10)
        if request.path.endswith("cut") and request.transport is not None:
            request.transport.close()  # the connection dies mid-body
        else:
            await resp.write(b"x" * 40)
        return resp

    app = web.Application()
    app.router.add_get("/{name}", handler)
    runner, url = await serve_app(app)
    link = PieceLink(url)
    fd = os.open(tmp_path / "p", os.O_RDWR | os.O_CREAT)
    try:
        with pytest.raises(PieceLinkError, match="after 10 of 1000 bytes"):
            await asyncio.to_thread(link.fetch, "/cut", fd, 1000, hashlib.sha256())
        assert link.received == 10
        with pytest.raises(TooLongError):
            await asyncio.to_thread(link.fetch, "/long", fd, 20, hashlib.sha256())
        with pytest.raises(PieceLinkError, match="cannot reach"):
            await asyncio.to_thread(PieceLink("http://127.0.0.1:9").fetch, "/x", fd, 1, hashlib.sha256())
    finally:
        os.close(fd)
        link.close()
        await runner.cleanup()


@pytest.mark.parametrize("head", [b"HTTP/1.1 \xb200 OK\r\nContent-Length: 5\r\n\r\n",
                                  b"HTTP/1.1 200 OK\r\nContent-Length: \xb2\r\n\r\n",
                                  b"HTTP/1.1 200 OK\r\nContent-Length: " + b"9" * 5000 + b"\r\n\r\n"])
async def test_a_seeder_answering_digits_int_refuses_is_a_failed_peer(tmp_path: Path, head: bytes) -> None:
    """'\\xb2' is '²' in latin-1, which passes str.isdigit, and int() refuses 5,000 digits: a
    status or Content-Length like that raised ValueError, which no worker catches, so one
    hostile seeder failed the whole fetch. Now a PieceLinkError (a failed peer)."""
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(head + b"xxxxx")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    link = PieceLink(f"http://127.0.0.1:{port}")
    fd = os.open(tmp_path / "p", os.O_RDWR | os.O_CREAT)
    try:
        with pytest.raises(PieceLinkError):
            await asyncio.to_thread(link.fetch, "/x", fd, 5, hashlib.sha256())
    finally:
        os.close(fd)
        link.close()
        server.close()


async def test_a_cut_piece_is_continued_and_a_partial_that_does_not_add_up_blames_nobody(
        seeder: tuple[str, SeedRoutes], manifest: ArtifactManifest, model_path: Path, tmp_path: Path) -> None:
    url, routes = seeder
    sel = pieces_for_range(manifest, 20, 22)
    big = max(sel.pieces, key=lambda p: p.size)
    other = next(p for p in sel.pieces if p.piece_id != big.piece_id)
    store = PieceStore.create(tmp_path / "store", manifest)
    half = big.size // 2
    store.partial_path(big.piece_id).write_bytes(_piece_bytes(model_path, big)[:half])  # a cut download's
    wrong = bytearray(_piece_bytes(model_path, other)[: other.size // 2])
    wrong[0] ^= 0xFF
    store.partial_path(other.piece_id).write_bytes(bytes(wrong))  # bytes that are not the piece's
    source = Recorder([Peer("seed", url, frozenset(range(len(manifest.pieces))))])
    report = await SwarmFetcher(PieceStore.create(tmp_path / "store", manifest), sel, source).run()
    assert report.bytes_resumed == half
    # the good half is not fetched again; the bad partial's rest came, did not add up, and its
    # piece came whole again
    assert report.bytes_fetched == sel.nbytes - half + (other.size - len(wrong))
    assert routes.stats[manifest.artifact_id].bytes_served == report.bytes_fetched
    assert source.reports == [] and report.bad == []
    # the seeder's credit: bytes it sent of pieces that verified (not an earlier run's half, not
    # the rest of the partial that did not add up)
    assert report.by_peer == {"seed": sel.nbytes - half} and report.corrupt_by_peer == {}
    assert not _open_under(tmp_path)
    assert PieceStore.open(tmp_path / "store").verify().ranges[0][0] <= 20
    assert not list((tmp_path / "store" / "pieces").glob(".*.part"))


async def test_a_cancelled_fetch_keeps_what_came_and_the_next_one_continues_it(
        manifest: ArtifactManifest, model_path: Path, tmp_path: Path) -> None:
    routes = SeedRoutes(chunk_delay_s=0.05)  # about 20 chunks a second: the fetch lasts
    routes.add(WholeFileHolder(model_path, manifest))
    app = web.Application()
    routes.register(app)
    runner, url = await serve_app(app)
    try:
        sel = pieces_for_range(manifest, 20, 21)
        peers = [Peer("slow", url, frozenset(range(len(manifest.pieces))))]
        store = PieceStore.create(tmp_path / "store", manifest)
        task = asyncio.create_task(SwarmFetcher(store, sel, Recorder(peers), per_peer=1).run())
        partials = tmp_path / "store" / "pieces"
        async with asyncio.timeout(60):
            while not any(p.stat().st_size > 0 for p in partials.glob(".*.part")):  # noqa: ASYNC110
                await asyncio.sleep(0.02)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        kept = sum(p.stat().st_size for p in partials.glob(".*.part"))
        assert kept > 0
        routes.chunk_delay_s = 0.0
        report = await SwarmFetcher(PieceStore.create(tmp_path / "store", manifest), sel, Recorder(peers)).run()
        assert report.bytes_resumed >= kept and report.bytes_fetched + report.bytes_resumed == sel.nbytes
        assert PieceStore.open(tmp_path / "store").held() >= {p.piece_id for p in sel.pieces}
        assert not _open_under(tmp_path)  # no piece or partial file left open
    finally:
        await runner.cleanup()


async def test_a_full_disk_stops_the_fetch_and_blames_no_peer(
        seeder: tuple[str, SeedRoutes], manifest: ArtifactManifest, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    import artifacts.piece_link as piece_link

    def full(*_args: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(piece_link.os, "pwrite", full)
    url, _ = seeder
    source = Recorder([Peer("seed", url, frozenset(range(len(manifest.pieces))))])
    fetcher = SwarmFetcher(PieceStore.create(tmp_path / "store", manifest), pieces_for_range(manifest, 20, 21),
                           source, stall_s=1.0)
    with pytest.raises(LocalStoreError, match="No space left") as err:
        await fetcher.run()
    assert f"piece store {tmp_path / 'store'}, " in str(err.value) and "MB free" in str(err.value)  # which disk
    assert source.reports == [] and not fetcher._dead  # the seeder is not taken for a failed peer


async def test_progress_rates_count_only_the_bytes_this_fetch_moves(
        seeder: tuple[str, SeedRoutes], manifest: ArtifactManifest, model_path: Path, tmp_path: Path) -> None:
    """A restart that holds most of its range: the held bytes are in the total and the percent,
    not in MB/s (it showed 1929817.9 MB/s with every piece held)."""
    from artifacts.manifest import progress_text
    from artifacts.swarm import FetchProgress

    sel = pieces_for_range(manifest, 10, 20)
    store = PieceStore.create(tmp_path / "store", manifest)
    for p in sel.pieces[:-1]:
        store.add_bytes(p, _piece_bytes(model_path, p))
    already = sel.nbytes - sel.pieces[-1].size
    seen: list[FetchProgress] = []
    url, _ = seeder
    source = Recorder([Peer("seed", url, frozenset(range(len(manifest.pieces))))])
    await SwarmFetcher(store, sel, source, progress=seen.append).run()
    assert seen and all(p.bytes_start == already for p in seen)
    last = seen[-1]
    assert last.rate_mb_s * 1e6 * last.elapsed_s == pytest.approx(sel.nbytes - already)
    assert " 0.0 MB/s " in progress_text("x", 5_000_000, 5_000_000, 0.001, 5_000_000)
    assert " 1.0 MB/s " in progress_text("x", 6_000_000, 9_000_000, 1.0, 5_000_000)


def _rotten_seeder(manifest: ArtifactManifest, model_path: Path, copy: Path, piece: ManifestPiece) -> SeedRoutes:
    """Seed routes of a copy of the model that rots one byte of `piece` after its check."""
    copy.write_bytes(model_path.read_bytes())
    routes = SeedRoutes()
    routes.add(WholeFileHolder(copy, manifest))  # checked against the manifest here
    with open(copy, "r+b") as f:  # then rots
        f.seek(piece.offset + 100)
        byte = f.read(1)
        f.seek(piece.offset + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    return routes


async def test_a_fetch_that_gives_up_names_the_peer_whose_copy_did_not_verify(
        manifest: ArtifactManifest, model_path: Path, tmp_path: Path) -> None:
    """The only seeder of a piece rots it (its file changed after it started): the fetch stops
    after the stall, and says that peer's copy was refused, not only that nobody holds it."""
    piece = next(p for p in pieces_for_range(manifest, 12, 13).pieces if p.layer == 12)
    routes = _rotten_seeder(manifest, model_path, tmp_path / "rotting.gguf", piece)
    app = web.Application()
    routes.register(app)
    runner, url = await serve_app(app)
    try:
        from artifacts.swarm import SwarmError

        source = Recorder([Peer("rotten", url, frozenset(range(len(manifest.pieces))))])
        fetcher = SwarmFetcher(PieceStore.create(tmp_path / "store", manifest), pieces_for_range(manifest, 12, 13),
                               source, stall_s=0.5)
        with pytest.raises(SwarmError) as err:
            await fetcher.run()
        assert f"{piece.piece_id[:16]}… (layer 12; the copy from rotten did not verify)" in str(err.value)
        assert source.reports == [("rotten", piece.piece_id)]
    finally:
        await runner.cleanup()


async def _slow_seeder(manifest: ArtifactManifest, model_path: Path, chunk_delay_s: float) -> tuple[web.AppRunner, str, SeedRoutes]:
    routes = SeedRoutes(chunk_delay_s=chunk_delay_s)  # a 1 MiB chunk, then a wait: a slow link
    routes.add(WholeFileHolder(model_path, manifest))
    app = web.Application()
    routes.register(app)
    runner, url = await serve_app(app)
    return runner, url, routes


async def test_progress_moves_while_a_slow_piece_is_coming(
        manifest: ArtifactManifest, model_path: Path, tmp_path: Path) -> None:
    """On a capped link one piece takes many seconds: the progress line counted only verified
    pieces, so it stood still (and the log printed nothing) until a whole piece was in."""
    from artifacts.swarm import FetchProgress

    runner, url, routes = await _slow_seeder(manifest, model_path, 1.2)  # a piece of 2 chunks: >= 2.4 s
    try:
        sel = pieces_for_range(manifest, 20, 21)
        seen: list[FetchProgress] = []
        source = Recorder([Peer("slow", url, frozenset(range(len(manifest.pieces))))])
        await SwarmFetcher(PieceStore.create(tmp_path / "store", manifest), sel, source, per_peer=1,
                           progress=seen.append).run()
    finally:
        routes.chunk_delay_s = 0.0
        await runner.cleanup()
    assert any(p.pieces_done == 0 and 0 < p.bytes_done < sel.pieces[0].size for p in seen)  # mid-piece
    done = [p.bytes_done for p in seen]
    assert done == sorted(done) and done[-1] == sel.nbytes  # never backwards, and all of it at the end


async def test_an_idle_fast_seeder_takes_over_a_piece_a_slow_one_is_still_sending(
        seeder: tuple[str, SeedRoutes], manifest: ArtifactManifest, model_path: Path, tmp_path: Path) -> None:
    """A far or capped seeder given a piece early held the whole fetch up at its end while a
    fast seeder sat idle (5x a fast seeder alone, through relays). Now the idle fast one cuts
    the slow fetch and continues the piece after the bytes that came, its seeder not failed."""
    fast_url, _ = seeder
    runner, slow_url, routes = await _slow_seeder(manifest, model_path, 3.0)
    try:
        sel = pieces_for_range(manifest, 20, 22)
        everything = frozenset(range(len(manifest.pieces)))
        source = Recorder([Peer("slow", slow_url, everything), Peer("fast", fast_url, everything)])
        store = PieceStore.create(tmp_path / "store", manifest)
        report = await SwarmFetcher(store, sel, source, per_peer=1).run()  # slow is asked first
    finally:
        routes.chunk_delay_s = 0.0
        await runner.cleanup()
    first = sel.pieces[0]
    assert report.pieces_by_peer["fast"] == len(sel.pieces)  # it finished every piece, the slow one's too
    assert report.by_peer.get("slow", 0) < first.size  # credited with its share of that piece, if any
    assert report.failed_peers == [] and report.bytes_fetched == sel.nbytes  # nothing fetched twice
    assert PieceStore.open(tmp_path / "store").held() >= {p.piece_id for p in sel.pieces}
    assert not _open_under(tmp_path)


def test_a_piece_is_taken_over_only_by_a_clearly_faster_peer() -> None:
    from artifacts.swarm import worth_taking_over

    assert worth_taking_over(2_000_000, 100_000, 1.0, 10_000_000.0)  # 20 s against 0.2 s
    assert worth_taking_over(2_000_000, 0, 1.0, 1_000_000.0)  # nothing came: a stalled sender
    assert not worth_taking_over(2_000_000, 0, 0.5, 1_000_000.0)  # too soon: 2 s of its own to go
    assert worth_taking_over(2_000_000, 0, 0.05, 200_000_000.0)  # a near seeder, 10 ms for it all
    assert not worth_taking_over(2_000_000, 100_000, 1.0, None)  # the idle peer was never measured
    assert not worth_taking_over(2_000_000, 1_000_000, 1.0, 1_500_000.0)  # not twice as fast
    assert not worth_taking_over(40_000, 100_000, 1.0, 10_000_000.0)  # 0.4 s left: not worth a new request
