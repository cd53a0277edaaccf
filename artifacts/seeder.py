"""Seeding: serve an artifact's verified pieces over HTTP (the node's own port, or a seed-only process).

Routes (registered on an aiohttp app by `SeedRoutes.register`):
- `GET /v1/artifacts`: what this process seeds;
- `GET /v1/artifacts/<artifact_id>/manifest`: the manifest;
- `GET /v1/artifacts/<artifact_id>/pieces/<piece_id>`: a piece, with single `Range` support (206);
- `GET /v1/artifacts/<artifact_id>/file`: the whole file (only a holder of all of it), with Range.
Errors are typed JSON (`{"error": {"code", "message"}}`): unknown_artifact, unknown_piece,
not_held, bad_range. A seeder counts what it served for its own view (`SeedStats`) and reports
nothing: its fetchers credit it with what verified (nodes/artifact_plane.py `credit_seeders`).
"""

from __future__ import annotations

import asyncio
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import orjson
from aiohttp import web

from artifacts.manifest import ArtifactManifest, ManifestError, ManifestPiece
from artifacts.piece_store import PieceStore
from artifacts.revision import model_revision

ARTIFACTS_PATH = "/v1/artifacts"
CHUNK = 1 << 20
TEST_DELAY_ENV = "MESHNET_TEST_SEED_DELAY_MS"  # test-only: sleep this long after each 1 MiB served


def seed_delay_s() -> float:
    return float(os.environ.get(TEST_DELAY_ENV, "0") or 0) / 1e3
_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")


def piece_path(artifact_id: str, piece_id: str) -> str:
    return f"{ARTIFACTS_PATH}/{artifact_id}/pieces/{piece_id}"


def file_path(artifact_id: str) -> str:
    return f"{ARTIFACTS_PATH}/{artifact_id}/file"


class PieceHolder(Protocol):
    """Where a seeder reads an artifact's bytes from."""

    manifest: ArtifactManifest

    def held(self) -> set[str]: ...

    def has(self, piece: ManifestPiece) -> bool: ...

    @property
    def complete(self) -> bool: ...

    def open(self, piece: ManifestPiece) -> tuple[int, int]:
        """(fd, file offset of the piece's first byte); the caller closes fd."""
        ...


class WholeFileHolder:
    """A whole GGUF on disk: every piece is a byte range of it."""

    def __init__(self, path: str | Path, manifest: ArtifactManifest) -> None:
        self.path = Path(path)
        self.manifest = manifest
        size = self.path.stat().st_size
        revision = model_revision(self.path)  # hashed once per file, then cached (artifacts/revision.py)
        if size != manifest.file_size or revision != manifest.model_revision:
            raise ManifestError(f"{self.path} is not artifact {manifest.artifact_id} ({size} bytes, revision "
                                f"{revision}; the manifest says {manifest.file_size} bytes, "
                                f"revision {manifest.model_revision})", path=str(self.path))
        self._all = {p.piece_id for p in manifest.pieces}

    def held(self) -> set[str]:
        return self._all

    def has(self, piece: ManifestPiece) -> bool:
        return piece.piece_id in self._all

    @property
    def complete(self) -> bool:
        return True

    def open(self, piece: ManifestPiece) -> tuple[int, int]:
        return os.open(self.path, os.O_RDONLY), piece.offset


class StoreHolder:
    """A Piece Store: the pieces it holds (verified on the way in)."""

    def __init__(self, store: PieceStore) -> None:
        self.store = store
        self.manifest = store.manifest

    def held(self) -> set[str]:
        return self.store.held()

    def has(self, piece: ManifestPiece) -> bool:
        return self.store.has(piece)

    @property
    def complete(self) -> bool:
        return self.held() == {p.piece_id for p in self.manifest.pieces}

    def open(self, piece: ManifestPiece) -> tuple[int, int]:
        return os.open(self.store.path(piece.piece_id), os.O_RDONLY), 0


def parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """A single `Range: bytes=a-b` as a half-open (start, stop) inside size; None for no header.
    Raises ValueError for a range it cannot satisfy (answered 416)."""
    if header is None:
        return None
    m = _RANGE.match(header.strip())
    if not m or (not m.group(1) and not m.group(2)):
        raise ValueError(f"unsupported Range {header!r} (one bytes=a-b range)")
    a, b = m.group(1), m.group(2)
    if not a:  # suffix: the last b bytes
        n = int(b)
        if n == 0:
            raise ValueError("empty suffix range")
        return max(0, size - n), size
    start = int(a)
    stop = min(size, int(b) + 1) if b else size
    if start >= size or stop <= start:
        raise ValueError(f"range {header!r} outside {size} bytes")
    return start, stop


def _error(status: int, code: str, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, body=orjson.dumps({"error": {"code": code, "message": message}}),
                        content_type="application/json", headers=headers)


@dataclass(slots=True)
class SeedStats:
    """Bytes served, per artifact (the seeder's own view: it credits nothing)."""

    bytes_served: int = 0
    pieces_served: int = 0


class SeedRoutes:
    """The artifact routes of one process, over the holders it seeds."""

    def __init__(self, *, chunk_delay_s: float = 0.0) -> None:
        self.holders: dict[str, PieceHolder] = {}
        self.chunk_delay_s = chunk_delay_s  # test-only throttle (MESHNET_TEST_SEED_DELAY_MS)
        self.stats: dict[str, SeedStats] = {}

    def add(self, holder: PieceHolder) -> None:
        self.holders[holder.manifest.artifact_id] = holder
        self.stats.setdefault(holder.manifest.artifact_id, SeedStats())

    def register(self, app: web.Application) -> None:
        app.router.add_get(ARTIFACTS_PATH, self.list_artifacts)
        app.router.add_get(ARTIFACTS_PATH + "/{aid}/manifest", self.get_manifest)
        app.router.add_get(ARTIFACTS_PATH + "/{aid}/pieces/{pid}", self.get_piece)
        app.router.add_get(ARTIFACTS_PATH + "/{aid}/file", self.get_file)

    def _holder(self, request: web.Request) -> PieceHolder | web.Response:
        aid = request.match_info["aid"]
        holder = self.holders.get(aid)
        if holder is None:
            return _error(404, "unknown_artifact", f"this node seeds no artifact {aid}")
        return holder

    async def list_artifacts(self, _request: web.Request) -> web.Response:
        out = [{"artifact_id": aid, "model": h.manifest.model, "pieces_held": len(h.held()),
                "pieces": len({p.piece_id for p in h.manifest.pieces}), "complete": h.complete,
                "bytes_served": self.stats[aid].bytes_served} for aid, h in self.holders.items()]
        return web.Response(body=orjson.dumps({"artifacts": out}), content_type="application/json")

    async def get_manifest(self, request: web.Request) -> web.Response:
        holder = self._holder(request)
        if isinstance(holder, web.Response):
            return holder
        return web.Response(body=holder.manifest.model_dump_json().encode(), content_type="application/json")

    async def get_piece(self, request: web.Request) -> web.StreamResponse:
        holder = self._holder(request)
        if isinstance(holder, web.Response):
            return holder
        pid = request.match_info["pid"]
        try:
            piece = holder.manifest.piece(pid)
        except ManifestError as exc:
            return _error(404, "unknown_piece", str(exc))
        if not holder.has(piece):
            return _error(404, "not_held", f"this node does not hold piece {pid}")
        try:
            fd, base = holder.open(piece)
        except OSError:  # removed between the check and the open
            return _error(404, "not_held", f"this node does not hold piece {pid}")
        return await self._send(request, holder.manifest.artifact_id, pid, fd, base, piece.size)

    async def get_file(self, request: web.Request) -> web.StreamResponse:
        holder = self._holder(request)
        if isinstance(holder, web.Response):
            return holder
        if not isinstance(holder, WholeFileHolder):  # a piece store, complete or not, serves pieces
            return _error(404, "not_held", "this node holds pieces, not the file (fetch pieces)")
        m = holder.manifest
        return await self._send(request, m.artifact_id, "file", os.open(holder.path, os.O_RDONLY), 0, m.file_size)

    async def _sendfile(self, request: web.Request, fd: int, offset: int, count: int) -> int | None:
        """Zero-copy from the page cache to the socket where the loop can (as aiohttp's
        FileResponse does); None when it cannot, before anything was sent."""
        if self.chunk_delay_s or request.transport is None:
            return None
        with os.fdopen(os.dup(fd), "rb") as fobj:
            try:
                return await asyncio.get_running_loop().sendfile(request.transport, fobj, offset, count)
            except NotImplementedError:
                return None

    async def _write_chunks(self, resp: web.StreamResponse, fd: int, offset: int, count: int,
                            sent: list[int]) -> None:
        """Copy [offset, offset + count) of fd to the response in CHUNKs, counting into sent[0]."""
        while sent[0] < count:
            chunk = os.pread(fd, min(CHUNK, count - sent[0]), offset + sent[0])
            if not chunk:
                break  # the file shrank under us: the fetcher sees a short body
            await resp.write(chunk)
            sent[0] += len(chunk)
            if self.chunk_delay_s:
                await asyncio.sleep(self.chunk_delay_s)

    async def _send(self, request: web.Request, aid: str, pid: str, fd: int, base: int, size: int) -> web.StreamResponse:
        try:
            try:
                rng = parse_range(request.headers.get("Range"), size)
            except ValueError as exc:
                return _error(416, "bad_range", str(exc), {"Content-Range": f"bytes */{size}"})
            start, stop = rng if rng is not None else (0, size)
            resp = web.StreamResponse(status=206 if rng is not None else 200)
            resp.content_type = "application/octet-stream"
            resp.content_length = stop - start
            resp.headers["Accept-Ranges"] = "bytes"
            if rng is not None:
                resp.headers["Content-Range"] = f"bytes {start}-{stop - 1}/{size}"
            await resp.prepare(request)
            sent = [0]  # bytes out so far, kept by _write_chunks as they go (a cut connection counts them)
            try:
                zero_copy = await self._sendfile(request, fd, base + start, stop - start)
                if zero_copy is None:  # uvloop has no loop.sendfile; a throttled test seeder wants chunks
                    await self._write_chunks(resp, fd, base + start, stop - start, sent)
                else:
                    sent[0] = zero_copy
                await resp.write_eof()
            finally:
                st = self.stats[aid]
                st.bytes_served += sent[0]
                st.pieces_served += 1
            return resp
        finally:
            os.close(fd)
