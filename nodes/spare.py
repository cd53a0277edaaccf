"""A spare node: it serves nothing until the tracker orders it to load a layer range.

`await_order` announces the spare (`mesh.node.<id>.spare`, every second: a tracker that starts later hears it within one)
and answers each rebalance order with a typed RebalanceReply: accepted, or refused with why
(`judge_order`, a pure function: wrong model, not enough memory or disk). The caller then
fetches the range's pieces, loads the shard and serves.
"""

from __future__ import annotations

import logging
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from artifacts.manifest import ArtifactManifest, pieces_for_range
from artifacts.shard_file import shard_path_of
from bus import subjects
from bus.client import Bus
from schemas.artifacts import RebalanceCode, RebalanceReply, SpareAnnouncement
from schemas.rebalance import RebalanceDirective

log = logging.getLogger("meshnet.node.spare")

SPARE_INTERVAL_S = 1.0


def available_memory() -> int:
    """MemAvailable of this machine (bytes), or 0 when unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def free_disk(path: Path) -> int:
    p = path
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


class RangeDoesNotFit(RuntimeError):
    """This node cannot hold the range it was asked to serve (`code`: insufficient_memory, ...)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{message} ({code})")
        self.code = code


@dataclass(frozen=True, slots=True)
class DiskRoom:
    """Free disk where a range's files go: `store` for pieces; `shard` where its shard file is
    written when that is another filesystem (None: the store's); `shard_held`: that file is
    there already (cut on an earlier start), so it needs no room."""

    store: int
    shard: int | None = None
    shard_held: bool = False


def disk_room(m: ArtifactManifest, store_dir: Path, start: int, end: int) -> DiskRoom:
    """This machine's DiskRoom for layers [start, end) of `m` kept in `store_dir`: the whole
    model is written out into the store itself (PieceSource.whole_file), a shard into the
    shard cache (MESHNET_CACHE), which may lie on another disk."""
    if start == 0 and end == m.n_layer:
        whole = store_dir / m.file_name
        return DiskRoom(free_disk(store_dir), None, whole.is_file() and whole.stat().st_size == m.file_size)
    shard = shard_path_of(m.model_revision, start, end)
    if shard.exists():
        return DiskRoom(free_disk(store_dir), None, True)
    same = _device(store_dir) == _device(shard.parent)
    return DiskRoom(free_disk(store_dir), None if same else free_disk(shard.parent))


def _device(path: Path) -> int:
    p = path
    while not p.exists():
        p = p.parent
    return p.stat().st_dev


def judge_range(m: ArtifactManifest, start: int, end: int, *, memory_bytes: int, disk_bytes: int | DiskRoom,
                held: set[str]) -> tuple[RebalanceCode, str]:
    """Whether this node can serve layers [start, end) of `m` (pure): inside the model, the
    range's weights within its memory (0: unknown, not checked), the pieces it lacks plus
    the shard file written from them within its free disk (`disk_bytes`: free bytes of the
    one disk both go to, or a DiskRoom: the shard file counted on its own disk, or not at all
    when it is there already)."""
    if end > m.n_layer:
        return "wrong_model", f"layers [{start},{end}) are not inside [0,{m.n_layer}) of {m.model}"
    sel = pieces_for_range(m, start, end)
    weights = sel.nbytes - m.header_piece().size
    if memory_bytes and weights > memory_bytes:
        return "insufficient_memory", (f"layers [{start},{end}) need {weights / 1e6:.1f} MB of weights, "
                                       f"this node may use {memory_bytes / 1e6:.1f} MB")
    room = disk_bytes if isinstance(disk_bytes, DiskRoom) else DiskRoom(disk_bytes)
    missing = sum(p.size for p in sel.pieces if p.piece_id not in held)
    shard = 0 if room.shard_held else sel.nbytes  # the shard file written from the pieces
    need_disk = missing + (shard if room.shard is None else 0)
    if need_disk > room.store:
        return "insufficient_disk", f"needs {need_disk / 1e6:.1f} MB of disk, {room.store / 1e6:.1f} MB free"
    if room.shard is not None and shard > room.shard:
        return "insufficient_disk", (f"the shard file needs {shard / 1e6:.1f} MB of disk in the shard cache "
                                     f"(MESHNET_CACHE), {room.shard / 1e6:.1f} MB free there")
    return "accepted", f"loading layers [{start},{end})"


def judge_order(d: RebalanceDirective, m: ArtifactManifest, *, memory_bytes: int, disk_bytes: int | DiskRoom,
                held: set[str]) -> tuple[RebalanceCode, str]:
    """Whether this spare can meet the order (pure): the same model, then judge_range."""
    if d.model_revision not in (None, m.model_revision) or (d.artifact_id not in (None, m.artifact_id)):
        return "wrong_model", f"this spare holds artifact {m.artifact_id} ({m.model}), not revision {d.model_revision}"
    return judge_range(m, d.layer_start, d.layer_end, memory_bytes=memory_bytes, disk_bytes=disk_bytes, held=held)


async def await_order(bus: Bus, *, node_id: str, manifest: ArtifactManifest, store_dir: Path,
                      held: set[str], memory_bytes: int) -> tuple[int, int]:
    """Announce this spare until an order it can meet arrives; return that order's range."""
    m = manifest

    def announcement() -> SpareAnnouncement:
        return SpareAnnouncement(node_id=node_id, artifact_id=m.artifact_id, model=m.model,
                                 model_revision=m.model_revision, cache_abi=m.cache.cache_abi,
                                 n_layer=m.n_layer, memory_bytes=memory_bytes, disk_bytes=free_disk(store_dir))

    async with bus.subscribe(subjects.rebalance(node_id), RebalanceDirective) as orders:
        print(f"meshnet node {node_id}: spare for {m.model} ({m.artifact_id[:12]}), waiting for a rebalance order",
              flush=True)
        while True:
            await bus.publish(subjects.node_spare(node_id), announcement())
            try:
                d = await orders.next(timeout=SPARE_INTERVAL_S)
            except TimeoutError:
                continue
            room = disk_room(m, store_dir, d.layer_start, d.layer_end) if d.layer_end <= m.n_layer else free_disk(store_dir)
            code, message = judge_order(d, m, memory_bytes=memory_bytes, disk_bytes=room, held=held)
            await bus.publish(subjects.rebalance_reply(node_id), RebalanceReply(
                node_id=node_id, model_revision=m.model_revision, layer_start=d.layer_start,
                layer_end=d.layer_end, code=code, message=message))
            if code == "accepted":
                log.info("rebalance order accepted: %s (%s)", message, d.reason)
                print(f"meshnet node {node_id}: rebalance order: {message} ({d.reason})", flush=True)
                return d.layer_start, d.layer_end
            log.warning("rebalance order refused (%s): %s", code, message)


async def order_failed(bus: Bus, node_id: str, m: ArtifactManifest, start: int, end: int, why: str) -> None:
    """An accepted order this spare could not carry out (its pieces could not be fetched): a
    `failed` reply, so the tracker asks another node at once, and the spare waits again."""
    log.warning("rebalance order for layers [%d,%d) failed: %s", start, end, why)
    print(f"meshnet node {node_id}: could not load layers [{start},{end}): {why}; waiting for another order",
          file=sys.stderr, flush=True)
    await bus.publish(subjects.rebalance_reply(node_id), RebalanceReply(
        node_id=node_id, model_revision=m.model_revision, layer_start=start, layer_end=end, code="failed",
        message=why[:300]))


def memory_budget(flag: int | None) -> int:
    """The memory a spare may spend on a shard: --max-memory, else what the machine has free."""
    return flag if flag else available_memory()
