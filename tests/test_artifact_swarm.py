"""The Shard Swarm against real processes: nats-server, the tracker, seeders and nodes on the bundled GGUF.

A node given only a manifest fetches exactly its range's pieces from the seeders the tracker's
inventory names, verifies each, survives bad and vanishing seeders, resumes after a kill, and
serves a shard byte-identical to the one cut from the whole file (so its outputs are too).
"""

from __future__ import annotations

import asyncio
import filecmp
import itertools
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from artifacts.manifest import ArtifactManifest, build_manifest, pieces_for_range
from artifacts.piece_store import PieceStore
from artifacts.shard_file import FORMAT_VERSION, materialize_shard
from bus import subjects
from bus.server import NatsServer
from gateway.route_client import RouteClient
from schemas.artifacts import ArtifactProgress
from tests.fixtures.mesh import Mesh, NodeProc, running_test_mesh
from tests.test_route_exact import PROMPT, reference_greedy
from tracker.service import TrackerConfig

SEED_READY = re.compile(r"seeding .* at (http://\S+)")
WAIT_S = 120.0
N_TOKENS = 24
SLOW_SEED = {"MESHNET_TEST_SEED_DELAY_MS": "60"}  # ~16 MB/s per stream
SLOWER_SEED = {"MESHNET_TEST_SEED_DELAY_MS": "250"}  # ~4 MB/s per stream: a fetch lasts seconds


@pytest.fixture(scope="module")
def manifest_file(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("manifest") / "smollm2.manifest.json"
    build_manifest(model_path).save(path)
    return path


@pytest.fixture(scope="module")
def prompt_and_greedy(model_path: Path) -> tuple[list[int], list[int]]:
    from llama_cpp import Llama

    tok = Llama(model_path=str(model_path), vocab_only=True, verbose=False)
    prompt = tok.tokenize(PROMPT.encode(), add_bos=False, special=True)
    return prompt, reference_greedy(model_path, prompt, N_TOKENS)


@pytest_asyncio.fixture
async def swarm(nats_server: NatsServer, model_path: Path) -> AsyncIterator[Mesh]:
    config = TrackerConfig(rebalance_interval=0.5, rebalance_cooldown=60.0, ledger=True)
    async with running_test_mesh(nats_server, model_path, config) as m:
        yield m


async def until(pred, interval: float = 0.05) -> None:  # type: ignore[no-untyped-def]
    """Poll `pred` (sync or async) until it holds, within WAIT_S."""
    async with asyncio.timeout(WAIT_S):
        for _ in itertools.count():
            got = pred()
            if asyncio.iscoroutine(got):
                got = await got
            if got:
                return
            await asyncio.sleep(interval)


class Progress:
    """Every ArtifactProgress on the bus, by node."""

    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh
        self.seen: list[ArtifactProgress] = []
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Progress:
        ready = asyncio.Event()

        async def follow() -> None:
            async with self.mesh.bus.subscribe(f"{subjects.PREFIX}.artifact.*.progress.*", ArtifactProgress) as sub:
                ready.set()
                async for msg in sub:
                    self.seen.append(msg)

        self._task = asyncio.create_task(follow())
        await ready.wait()
        await self.mesh.bus.flush()
        return self

    async def __aexit__(self, *_exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)

    def of(self, node_id: str, state: str | None = None) -> list[ArtifactProgress]:
        return [p for p in self.seen if p.node_id == node_id and (state is None or p.state == state)]

    async def done(self, node_id: str) -> ArtifactProgress:
        def finished() -> bool:
            assert not self.of(node_id, "failed"), self.of(node_id, "failed")
            return bool(self.of(node_id, "done"))

        await until(finished)
        return self.of(node_id, "done")[-1]


async def seeder(mesh: Mesh, node_id: str, source: Path, manifest: Path | None = None,
                 env: dict[str, str] | None = None) -> NodeProc:
    """A `meshnet artifact seed` process (no engine)."""
    args = [str(source), *(["--manifest", str(manifest)] if manifest else [])]
    return await mesh.spawn(None, node_id=node_id, model=False, node_args=False, ready=SEED_READY, env=env,
                            command=("-m", "meshnet.cli", "artifact", "seed", *args))


async def seeded_by(mesh: Mesh, artifact_id: str, node_ids: set[str]) -> None:
    """Wait until the tracker's inventory lists these seeders."""
    await until(lambda: node_ids <= {p.node_id for p in mesh.tracker.inventory.peers(artifact_id).peers})


async def piece_node(mesh: Mesh, tmp: Path, node_id: str, manifest: Path, layers: tuple[int, int] | None,
                     *, wait: bool = True, extra: list[str] | None = None) -> NodeProc:
    """`meshnet node --manifest M --layers A:B` with its own store and shard cache (so nothing
    cut from the whole file by another test can stand in for the shard it writes from pieces)."""
    args = ["--manifest", str(manifest), "--store", str(tmp / f"{node_id}-store"), *(extra or [])]
    env = {"MESHNET_CACHE": str(tmp / f"{node_id}-cache")}
    if not wait:
        return await mesh.spawn(layers, node_id=node_id, model=False, args=args, env=env,
                                ready=re.compile(r"(fetching|spare for)"))
    return await mesh.spawn(layers, node_id=node_id, model=False, args=args, env=env)


async def greedy_through(mesh: Mesh, nodes: list[NodeProc], prompt: list[int], n: int) -> list[int]:
    session = await mesh.route(nodes, prompt_tokens=len(prompt))
    async with RouteClient(session, mesh.http, bus=mesh.bus) as rc:
        first = await rc.prefill(prompt)
        tokens = [first.token_id]
        tokens += [r.token_id async for r in rc.decode_run(first.token_id, n - 1)]
    return tokens


async def seed_audit(mesh: Mesh, artifact_id: str, fetcher: str) -> dict[str, tuple[int, int]]:
    """Per seeder, (verified bytes, corrupt pieces) that `fetcher` received from it, from the
    `seed` receipts it stored in JetStream (the only ones a seeder is credited by)."""
    out: dict[str, tuple[int, int]] = {}
    for e in await mesh.tracker.bus.audit_messages():
        if e.get("kind") == "seed" and e.get("artifact_id") == artifact_id and e.get("node_id") == fetcher:
            nbytes, corrupt = out.get(e["seeder"], (0, 0))
            out[e["seeder"]] = (nbytes + e["bytes_served"], corrupt + e["corrupt_pieces"])
    return out


async def seed_credit(mesh: Mesh, seeders: set[str]) -> dict[str, tuple[int, int]]:
    """Per seeder, (seed_bytes, seed_corrupt_pieces) in the tracker's Work Ledger, once it has all."""
    out: dict[str, tuple[int, int]] = {}

    def credited() -> bool:
        state = mesh.tracker.ledger.state if mesh.tracker.ledger else None
        if state is None or not seeders <= state.nodes.keys():
            return False
        out.update({n: (state.nodes[n].seed_bytes, state.nodes[n].seed_corrupt_pieces) for n in seeders})
        return True

    await until(credited, 0.1)
    return out


async def test_a_range_fetched_from_two_seeders_is_the_shard_cut_from_the_file(
        swarm: Mesh, manifest_file: Path, model_path: Path, tmp_path: Path, prompt_and_greedy) -> None:
    m = ArtifactManifest.load(manifest_file)
    need = pieces_for_range(m, 15, 30)
    await seeder(swarm, "seed-a", model_path, manifest_file)
    await seeder(swarm, "seed-b", model_path)  # builds (and caches) its own manifest: the same artifact
    await seeded_by(swarm, m.artifact_id, {"seed-a", "seed-b"})
    url = swarm.nodes[0].url + f"/v1/artifacts/{m.artifact_id}"
    piece = need.pieces[3]
    async with swarm.http.get(f"{url}/pieces/{piece.piece_id}", headers={"Range": "bytes=10-19"}) as resp:
        assert resp.status == 206 and resp.headers["Content-Range"] == f"bytes 10-19/{piece.size}"
        with open(model_path, "rb") as f:  # noqa: ASYNC230 - one small read in a test
            f.seek(piece.offset + 10)
            assert await resp.read() == f.read(10)
    async with swarm.http.get(f"{url}/pieces/{piece.piece_id}", headers={"Range": "bytes=0-1,5-6"}) as resp:
        assert resp.status == 416 and (await resp.json())["error"]["code"] == "bad_range"
    async with swarm.http.get(f"{url}/pieces/{'0' * 64}") as resp:
        assert resp.status == 404 and (await resp.json())["error"]["code"] == "unknown_piece"
    async with Progress(swarm) as progress:
        tail = await piece_node(swarm, tmp_path, "pieces-tail", manifest_file, (15, 30))
        done = await progress.done("pieces-tail")
    # only the range's pieces plus the shared ones: exactly the manifest's count, nothing refetched
    assert done.bytes_total == need.nbytes and done.bytes_already == 0
    assert done.bytes_fetched == need.nbytes < 0.7 * m.file_size and not done.refused
    assert set(done.peers) == {"seed-a", "seed-b"}  # both seeders served pieces
    # seeding is accounted apart, from the fetcher's receipts: each seeder's verified bytes
    served = await seed_audit(swarm, m.artifact_id, "pieces-tail")
    assert set(served) == {"seed-a", "seed-b"} and sum(b for b, _ in served.values()) == need.nbytes
    assert await seed_credit(swarm, {"seed-a", "seed-b"}) == served
    shard = tmp_path / "pieces-tail-cache" / "shards" / f"{m.model_revision}-15-30-v{FORMAT_VERSION}.gguf"
    assert filecmp.cmp(shard, materialize_shard(model_path, 15, 30), shallow=False)  # bit-identical
    assert PieceStore.open(tmp_path / "pieces-tail-store").verify().ranges == ((15, 30),)
    # and it serves: head from the whole file, tail from pieces, the single-process greedy answer
    prompt, greedy = prompt_and_greedy
    head = await swarm.spawn((0, 15), node_id="file-head")
    assert await greedy_through(swarm, [head, tail], prompt, N_TOKENS) == greedy


async def test_a_corrupt_piece_is_refused_fetched_from_the_other_seeder_and_its_seeder_reported(
        swarm: Mesh, manifest_file: Path, model_path: Path, tmp_path: Path) -> None:
    m = ArtifactManifest.load(manifest_file)
    need = pieces_for_range(m, 15, 30)
    bad_piece = need.pieces[-1]  # the last in file order: the honest seeder reaches it last
    rotten = PieceStore.create(tmp_path / "rotten", m)
    with open(model_path, "rb") as f:  # noqa: ASYNC230 - one small read in a test
        f.seek(bad_piece.offset)
        data = bytearray(f.read(bad_piece.size))
    rotten.add_bytes(bad_piece, bytes(data))
    data[len(data) // 2] ^= 0x55  # bit rot after it was verified
    rotten.path(bad_piece.piece_id).write_bytes(bytes(data))
    await seeder(swarm, "seed-rotten", tmp_path / "rotten")
    await seeder(swarm, "seed-good", model_path, manifest_file, env=SLOW_SEED)
    await seeded_by(swarm, m.artifact_id, {"seed-rotten", "seed-good"})
    async with Progress(swarm) as progress:
        await piece_node(swarm, tmp_path, "pieces-c", manifest_file, (15, 30))
        done = await progress.done("pieces-c")
    assert done.refused == [f"seed-rotten:{bad_piece.piece_id}"]
    assert done.bytes_fetched == need.nbytes + bad_piece.size  # the refused copy, then the good one
    assert swarm.tracker.inventory.bad_count(m.artifact_id, "seed-rotten") == 1  # reported, by piece
    assert [p.node_id for p in swarm.tracker.inventory.peers(m.artifact_id).peers][-1] == "seed-rotten"
    assert PieceStore.open(tmp_path / "pieces-c-store").verify().ranges == ((15, 30),)
    # credit from what verified at the fetcher only: nothing for the corrupt piece, counted against
    # its seeder; the honest one gets every byte of the range
    expect = {"seed-rotten": (0, 1), "seed-good": (need.nbytes, 0)}
    assert await seed_audit(swarm, m.artifact_id, "pieces-c") == expect
    assert await seed_credit(swarm, {"seed-rotten", "seed-good"}) == expect


async def test_a_seeder_killed_mid_download_and_a_fetcher_killed_and_restarted(
        swarm: Mesh, manifest_file: Path, model_path: Path, tmp_path: Path) -> None:
    m = ArtifactManifest.load(manifest_file)
    need = pieces_for_range(m, 15, 30)
    doomed = await seeder(swarm, "seed-doomed", model_path, manifest_file, env=SLOWER_SEED)
    await seeder(swarm, "seed-steady", model_path, manifest_file, env=SLOWER_SEED)
    await seeded_by(swarm, m.artifact_id, {"seed-doomed", "seed-steady"})
    store_dir = tmp_path / "pieces-k-store"
    async with Progress(swarm) as progress:
        # 1) the fetcher is killed once some pieces are in, and started again: it resumes
        first = await piece_node(swarm, tmp_path, "pieces-k", manifest_file, (15, 30), wait=False)
        await until(lambda: any(p.pieces_done >= 4 for p in progress.of("pieces-k")))
        first.kill()
        await first.proc.wait()
        held = PieceStore.open(store_dir).held_bytes()
        assert 0 < held < need.nbytes
        progress.seen.clear()
        again = await piece_node(swarm, tmp_path, "pieces-k", manifest_file, (15, 30), wait=False)
        # 2) a seeder is killed while it is sending: the rest comes from the other one
        await until(lambda: any(p.pieces_done > 0 and p.state == "fetching" for p in progress.of("pieces-k")), 0.02)
        doomed.kill()
        done = await progress.done("pieces-k")
        assert again.proc.returncode is None
    assert done.bytes_already >= held  # verified pieces are never fetched again
    # nor are the bytes of pieces cut by either kill: they are continued with a Range, from any seeder
    assert done.bytes_resumed > 0
    assert done.bytes_fetched + done.bytes_already + done.bytes_resumed == need.nbytes
    assert "seed-doomed" in done.failed_peers and "seed-steady" in done.peers
    assert PieceStore.open(store_dir).verify().ranges == ((15, 30),)


async def test_a_gap_is_covered_by_a_spare_after_another_spare_refuses_the_order(
        swarm: Mesh, manifest_file: Path, model_path: Path, tmp_path: Path, prompt_and_greedy) -> None:
    m = ArtifactManifest.load(manifest_file)
    prompt, greedy = prompt_and_greedy
    head = await swarm.spawn((0, 15), node_id="gap-head", args=["--seed"])  # seeds the whole file
    await seeded_by(swarm, m.artifact_id, {"gap-head"})
    [cov] = swarm.tracker.coverage()
    assert cov.gaps == ((15, 30),)
    # spare-a may use 1 MB: it refuses; the tracker then orders spare-b
    await piece_node(swarm, tmp_path, "spare-a", manifest_file, None, wait=False,
                     extra=["--spare", "--max-memory", "1M"])
    spare = await piece_node(swarm, tmp_path, "spare-b", manifest_file, None, extra=["--spare"])
    await until(lambda: swarm.tracker.coverage()[0].status == "covered", 0.1)
    [cov] = swarm.tracker.coverage()
    assert cov.shards == ((0, 15, 1), (15, 30, 1))
    assert swarm.tracker.registry.get("spare-b").capability.layers.start == 15
    assert any("refused" in line and "insufficient_memory" in line for line in swarm.nodes[1].log)
    spare.layers = (15, 30)
    assert await greedy_through(swarm, [head, spare], prompt, N_TOKENS) == greedy


async def test_a_spare_joins_a_thin_range_while_chats_run_on_the_other_nodes(
        nats_server: NatsServer, model_path: Path, manifest_file: Path, tmp_path: Path, prompt_and_greedy) -> None:
    prompt, greedy = prompt_and_greedy
    config = TrackerConfig(rebalance_interval=0.5, rebalance_cooldown=60.0, target_replicas=2)
    async with running_test_mesh(nats_server, model_path, config) as mesh:
        head = await mesh.spawn((0, 15), node_id="thin-head", args=["--seed"])
        await mesh.spawn((0, 15), node_id="thin-head-2")
        tail = await mesh.spawn((15, 30), node_id="thin-tail")
        await until(lambda: [c.under_provisioned for c in mesh.tracker.coverage()] == [((15, 30),)])
        covered_at: list[float] = []

        async def watch() -> None:
            await until(lambda: mesh.tracker.coverage()[0].status == "covered", 0.02)
            covered_at.append(time.monotonic())

        watcher = asyncio.create_task(watch())
        spare_started = asyncio.create_task(
            piece_node(mesh, tmp_path, "thin-spare", manifest_file, None, wait=False, extra=["--spare"]))
        spans: list[tuple[float, float]] = []
        while not covered_at or spans[-1][1] < covered_at[0]:  # chats on head + tail, one after another
            t0 = time.monotonic()
            assert await greedy_through(mesh, [head, tail], prompt, N_TOKENS) == greedy  # never interrupted
            spans.append((t0, time.monotonic()))
            assert len(spans) < 200
        await watcher
        spare = await spare_started
        assert any(a < covered_at[0] < b for a, b in spans)  # a chat ran while the spare joined
        assert mesh.tracker.coverage()[0].shards == ((0, 15, 2), (15, 30, 2))
        await until(lambda: mesh.tracker.registry.get("thin-spare") is not None)
        spare.layers = (15, 30)
        assert await greedy_through(mesh, [head, spare], prompt, N_TOKENS) == greedy
