"""Artifact Manifests on the bundled GGUF: pieces, ranges, verification, shards written from pieces."""

from __future__ import annotations

import asyncio
import filecmp
import json
import subprocess
import sys
from pathlib import Path

import pytest

from artifacts.gguf_header import read_header
from artifacts.manifest import ArtifactManifest, ManifestError, build_manifest, pieces_for_range
from artifacts.piece_store import PieceStore, servable_ranges
from artifacts.shard_file import materialize_shard, shard_source_tensors
from artifacts.source import GGUFFile
from bus.server import NatsServer

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def manifest(model_path: Path) -> ArtifactManifest:
    return build_manifest(model_path)


def _store(tmp_path: Path, m: ArtifactManifest, model_path: Path, pieces) -> PieceStore:
    store = PieceStore.create(tmp_path / "store", m)
    data = model_path.read_bytes()
    for p in pieces:
        store.add_bytes(p, data[p.offset:p.offset + p.size])
    return store


def test_manifest_tiles_the_file_with_layer_pure_pieces(manifest: ArtifactManifest, model_path: Path) -> None:
    m = manifest
    import hashlib

    assert m.file_sha256 == hashlib.sha256(model_path.read_bytes()).hexdigest()
    assert m.artifact_id == m.file_sha256[:32] and m.model_revision == GGUFFile(model_path).revision
    assert (m.model, m.architecture, m.n_layer, m.quantization) == ("smollm2-135m-instruct", "llama", 30, "Q4_1")
    assert m.license == "apache-2.0" and m.context_length == 8192
    assert m.cache.cache_abi == "llama.cpp/kv-f16/llama" and m.cache.kv_bytes_per_token_per_layer == 2 * 3 * 64 * 2
    assert sum(p.size for p in m.pieces) == m.file_size == model_path.stat().st_size
    for p in m.pieces:  # one group per piece: a layer's tensors are whole pieces of their own
        layers = {m.tensor_to_layer_map[t] for t in p.tensors}
        assert layers == ({p.layer} if p.role == "layer" else ({None} if p.tensors else set()))
    assert set(m.shared_pieces) == {"header", "embedding", "shared"}  # tied embeddings: no output head
    assert len(m.shared_pieces["embedding"]) == 4  # 30 MB in 8 MiB pieces
    data = model_path.read_bytes()
    for p in m.pieces[:3]:
        assert hashlib.sha256(data[p.offset:p.offset + p.size]).hexdigest() == p.piece_id


def test_pieces_for_a_range_are_exactly_what_the_shard_writer_reads(manifest: ArtifactManifest, model_path: Path) -> None:
    h = GGUFFile(model_path).header
    for a, b in ((0, 10), (10, 20), (15, 30), (0, 30)):
        sel = pieces_for_range(manifest, a, b)
        covered = {t for p in sel.pieces for t in p.tensors}
        assert set(shard_source_tensors(h, a, b)) <= covered
        assert {manifest.tensor_to_layer_map[t] for t in covered} - {None} == set(range(a, b))
    mid = pieces_for_range(manifest, 10, 20).by_role()
    assert "embedding" not in mid  # a middle shard never fetches the vocabulary
    assert pieces_for_range(manifest, 0, 30).nbytes == manifest.file_size
    with pytest.raises(ManifestError, match=r"\[15, 31\) is not inside \[0, 30\)"):
        pieces_for_range(manifest, 15, 31)


def test_a_shard_written_from_pieces_is_the_shard_cut_from_the_file(
        manifest: ArtifactManifest, model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = _store(tmp_path, manifest, model_path, pieces_for_range(manifest, 15, 30).pieces)
    monkeypatch.setenv("MESHNET_CACHE", str(tmp_path / "cache-a"))
    from_pieces = materialize_shard(store.source(), 15, 30)
    monkeypatch.setenv("MESHNET_CACHE", str(tmp_path / "cache-b"))
    from_file = materialize_shard(model_path, 15, 30)
    assert from_pieces != from_file and filecmp.cmp(from_pieces, from_file, shallow=False)
    with pytest.raises(ManifestError, match=r"\(layer 0\) is not in"):
        materialize_shard(store.source(), 0, 10)  # pieces it does not hold: named


def test_a_store_with_every_piece_gives_back_the_original_file(manifest: ArtifactManifest, model_path: Path,
                                                               tmp_path: Path) -> None:
    store = _store(tmp_path, manifest, model_path, manifest.pieces)
    whole = store.source().whole_file()
    assert whole is not None and filecmp.cmp(whole, model_path, shallow=False)


def test_verify_reports_exactly_the_ranges_a_store_can_still_serve(manifest: ArtifactManifest, model_path: Path,
                                                                  tmp_path: Path) -> None:
    m = manifest
    store = _store(tmp_path, m, model_path, pieces_for_range(m, 15, 30).pieces)
    assert store.verify().ranges == ((15, 30),)
    [layer20] = m.layer_to_pieces[20]
    store.path(layer20).unlink()
    report = store.verify()
    assert report.missing.count(layer20) == 1 and not report.corrupt
    assert report.ranges == ((15, 20), (21, 30))
    out = subprocess.run([sys.executable, "-m", "meshnet.cli", "artifact", "verify", str(store.root), "--json"],
                         cwd=ROOT, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout)["ranges"] == [[15, 20], [21, 30]]
    # a corrupt piece (one flipped byte) is found and named, and its layer drops out
    [layer25] = m.layer_to_pieces[25]
    raw = bytearray(store.path(layer25).read_bytes())
    raw[100] ^= 0xFF
    store.path(layer25).write_bytes(bytes(raw))
    report = store.verify()
    assert report.corrupt == (layer25,) and report.ranges == ((15, 20), (21, 25), (26, 30))
    text = subprocess.run([sys.executable, "-m", "meshnet.cli", "artifact", "verify", str(store.root)],
                          cwd=ROOT, capture_output=True, text=True)
    assert text.returncode == 1 and f"corrupt  {layer25}" in text.stdout and "[15,20), [21,25), [26,30)" in text.stdout


def test_servable_ranges_need_the_embedding_on_a_head_and_the_tail_pieces_on_a_tail(manifest: ArtifactManifest) -> None:
    m = manifest
    everything = {p.piece_id for p in m.pieces}
    assert servable_ranges(m, everything) == [(0, 30)]
    no_embedding = everything - set(m.shared_pieces["embedding"])
    assert servable_ranges(m, no_embedding) == [(1, 29)]  # neither head nor (tied) tail
    assert servable_ranges(m, everything - set(m.shared_pieces["header"])) == []


def test_a_manifest_that_does_not_validate_is_a_typed_error_naming_the_field(manifest: ArtifactManifest,
                                                                              tmp_path: Path) -> None:
    data = json.loads(manifest.model_dump_json())
    data["pieces"][3]["offset"] += 1
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(ManifestError, match=f"piece {data['pieces'][3]['piece_id']} starts at"):
        ArtifactManifest.load(bad)
    data = json.loads(manifest.model_dump_json())
    data["pieces"][0]["piece_id"] = "xyz"
    bad.write_text(json.dumps(data))
    with pytest.raises(ManifestError, match=r"pieces\.0\.piece_id"):
        ArtifactManifest.load(bad)
    with pytest.raises(ManifestError, match="no such manifest"):
        ArtifactManifest.load(tmp_path / "missing.json")


def test_a_manifest_that_claims_huge_counts_is_refused_before_anything_is_allocated(
        manifest: ArtifactManifest, tmp_path: Path, model_path: Path) -> None:
    """n_layer 10^9 once made `meshnet artifact` build a billion-entry list (17 GB, OOM-killed):
    counts are bounded by the schema, and a claim that the header disagrees with is refused."""
    data = json.loads(manifest.model_dump_json())
    bad = tmp_path / "huge.json"
    for field, value in (("n_layer", 1_000_000_000), ("n_embd", 1 << 40), ("expert_count", 1 << 40),
                         ("context_length", 1 << 40)):
        bad.write_text(json.dumps({**data, field: value}))
        with pytest.raises(ManifestError, match=field):
            ArtifactManifest.load(bad)
        got = subprocess.run([sys.executable, "-m", "meshnet.cli", "artifact", "pieces", str(bad), "--layers", "0:1"],
                             cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert got.returncode == 2 and field in got.stderr and "Traceback" not in got.stderr, got.stderr
    # within the bounds, but not what the header says: refused once the header piece is read
    lying = manifest.model_copy(update={"n_layer": 29})
    with pytest.raises(ManifestError, match="its GGUF header llama with 30"):
        lying.check_header(read_header(model_path))
    manifest.check_header(read_header(model_path))


def test_a_piece_whose_hash_differs_is_refused_and_named(manifest: ArtifactManifest, model_path: Path,
                                                         tmp_path: Path) -> None:
    store = PieceStore.create(tmp_path / "s", manifest)
    p = manifest.pieces[5]
    data = bytearray(model_path.read_bytes()[p.offset:p.offset + p.size])
    data[0] ^= 1
    with pytest.raises(ManifestError, match=p.piece_id[:16]) as err:
        store.add_bytes(p, bytes(data))
    assert err.value.piece_id == p.piece_id and not store.has(p) and not list(store.pieces_dir.iterdir())
    assert f"piece {p.piece_id[:16]}… (layer {p.layer}) does not verify" in str(err.value)


def test_cli_manifest_and_pieces(model_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "m.json"
    subprocess.run([sys.executable, "-m", "meshnet.cli", "artifact", "manifest", str(model_path), "-o", str(out)],
                   cwd=ROOT, check=True, capture_output=True)
    m = ArtifactManifest.load(out)
    got = subprocess.run([sys.executable, "-m", "meshnet.cli", "artifact", "pieces", str(out), "--layers", "15:30",
                          "--json"], cwd=ROOT, check=True, capture_output=True, text=True)
    listing = json.loads(got.stdout)
    assert listing["bytes"] == pieces_for_range(m, 15, 30).nbytes
    assert {p["piece_id"] for p in listing["pieces"]} == {p.piece_id for p in pieces_for_range(m, 15, 30).pieces}
    bad = subprocess.run([sys.executable, "-m", "meshnet.cli", "artifact", "pieces", str(out), "--layers", "20:40"],
                         cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 2 and "[20, 40) is not inside [0, 30)" in bad.stderr


@pytest.mark.parametrize("argv", [["manifest", "{bad}", "-o", "{tmp}/x.json"], ["layout", "{bad}", "--nodes", "2"],
                                  ["seed", "{bad}", "--no-bus"], ["manifest", "{tmp}/none.gguf"],
                                  ["manifest", "{model}", "--piece-size", "1"]])
def test_cli_bad_models_and_sizes_are_one_line_and_exit_2(argv: list[str], model_path: Path, tmp_path: Path) -> None:
    """Not a GGUF, no such file, an absurd piece size (it once ran 13 minutes): one line, exit 2."""
    bad = tmp_path / "notgguf.gguf"
    bad.write_bytes(bytes(range(256)) * 4000)
    args = [a.format(bad=bad, tmp=tmp_path, model=model_path) for a in argv]
    got = subprocess.run([sys.executable, "-m", "meshnet.cli", "artifact", *args], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert got.returncode == 2 and "Traceback" not in got.stderr, got.stderr[-2000:]
    assert any(w in got.stderr for w in ("not a GGUF", "not found", "piece size")), got.stderr


def test_a_spare_judges_an_order_by_model_memory_and_disk(manifest: ArtifactManifest) -> None:
    from nodes.spare import judge_order
    from schemas.rebalance import RebalanceDirective

    def order(a: int, b: int, rev: str | None = manifest.model_revision) -> RebalanceDirective:
        return RebalanceDirective(node_id="s", model="m", model_revision=rev, layer_start=a, layer_end=b, reason="gap")

    big = 1 << 40
    assert judge_order(order(15, 30), manifest, memory_bytes=big, disk_bytes=big, held=set())[0] == "accepted"
    code, why = judge_order(order(15, 30, "f" * 16), manifest, memory_bytes=big, disk_bytes=big, held=set())
    assert code == "wrong_model" and manifest.artifact_id in why
    code, why = judge_order(order(15, 30), manifest, memory_bytes=1 << 20, disk_bytes=big, held=set())
    assert code == "insufficient_memory" and "1.0 MB" in why
    need = pieces_for_range(manifest, 15, 30).nbytes
    assert judge_order(order(15, 30), manifest, memory_bytes=big, disk_bytes=need, held=set())[0] == "insufficient_disk"
    held = {p.piece_id for p in pieces_for_range(manifest, 15, 30).pieces}
    assert judge_order(order(15, 30), manifest, memory_bytes=big, disk_bytes=need, held=held)[0] == "accepted"


@pytest.mark.parametrize(("flags", "message"), [
    (["--spare"], "--spare needs --manifest"),
    (["--spare", "--manifest", "m.json", "--layers", "0:5"], "--spare takes no --layers"),
    ([], "--layers A:B is required"),
])
def test_node_flags_that_do_not_fit_together_are_refused(flags: list[str], message: str) -> None:
    got = subprocess.run([sys.executable, "-m", "nodes.main", *flags], cwd=ROOT, capture_output=True, text=True)
    assert got.returncode == 2 and message in got.stderr


def test_seeders_answer_one_byte_range_or_a_typed_416() -> None:
    from artifacts.seeder import parse_range

    assert parse_range(None, 100) is None
    assert parse_range("bytes=0-9", 100) == (0, 10)
    assert parse_range("bytes=90-", 100) == (90, 100)
    assert parse_range("bytes=-10", 100) == (90, 100)
    assert parse_range("bytes=95-200", 100) == (95, 100)
    for bad in ("bytes=100-", "bytes=5-2", "bytes=0-1,4-5", "items=0-1", "bytes=-0", "bytes=-"):
        with pytest.raises(ValueError):
            parse_range(bad, 100)


def test_a_seeder_refuses_a_file_that_is_not_the_manifests(manifest: ArtifactManifest, model_path: Path,
                                                          tmp_path: Path) -> None:
    from artifacts.seeder import WholeFileHolder

    assert WholeFileHolder(model_path, manifest).complete
    other = tmp_path / "same-size.gguf"
    data = bytearray(model_path.read_bytes())
    data[-1] ^= 1  # same size, other bytes
    other.write_bytes(bytes(data))
    with pytest.raises(ManifestError, match=f"is not artifact {manifest.artifact_id}"):
        WholeFileHolder(other, manifest)


async def _manifest_node(manifest: ArtifactManifest, nats_server: NatsServer, tmp_path: Path, node_id: str,
                         *flags: str) -> tuple[int | None, str]:
    """A `meshnet node --manifest` process with `flags`, run until it exits: (code, stderr)."""
    path = tmp_path / "m.json"
    manifest.save(path)
    user, password = nats_server.credentials("node")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "nodes.main", "--manifest", str(path), *flags,
        "--store", str(tmp_path / "store"), "--nats", nats_server.url, "--nats-user", user,
        "--nats-password", password, "--node-id", node_id, cwd=ROOT, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode, err.decode()


async def test_a_manifest_node_refuses_a_range_it_cannot_hold_before_fetching(
        manifest: ArtifactManifest, nats_server: NatsServer, tmp_path: Path) -> None:
    code, err = await _manifest_node(manifest, nats_server, tmp_path, "tight", "--layers", "15:30",
                                     "--max-memory", "1MB")
    assert code == 2, err
    assert "cannot serve layers [15,30)" in err and "insufficient_memory" in err
    assert PieceStore.open(tmp_path / "store").held() == set()  # nothing fetched


async def test_a_manifest_node_refuses_a_range_outside_the_model_before_making_its_store(
        manifest: ArtifactManifest, nats_server: NatsServer, tmp_path: Path) -> None:
    code, err = await _manifest_node(manifest, nats_server, tmp_path, "outside", "--layers", "25:40")
    assert code == 2 and "[25, 40) is not inside [0, 30)" in err, err
    assert not (tmp_path / "store").exists()  # nothing left behind


def test_the_disk_check_counts_the_shard_file_on_its_own_disk_and_not_once_it_is_cut(
        manifest: ArtifactManifest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from artifacts.shard_file import shard_path_of
    from nodes.spare import DiskRoom, disk_room, judge_range

    big = 1 << 40
    sel = pieces_for_range(manifest, 10, 20)
    held = {p.piece_id for p in sel.pieces}
    # a restart: every piece held and its shard cut already; the disk has less room than the shard
    assert judge_range(manifest, 10, 20, memory_bytes=big, disk_bytes=DiskRoom(1 << 20, None, True),
                       held=held)[0] == "accepted"
    assert judge_range(manifest, 10, 20, memory_bytes=big, disk_bytes=1 << 20, held=held)[0] == "insufficient_disk"
    # --store on one disk, the shard cache on another: each holds only its own files
    assert judge_range(manifest, 10, 20, memory_bytes=big, disk_bytes=DiskRoom(sel.nbytes, sel.nbytes),
                       held=set())[0] == "accepted"
    code, why = judge_range(manifest, 10, 20, memory_bytes=big, disk_bytes=DiskRoom(big, sel.nbytes - 1), held=set())
    assert code == "insufficient_disk" and "MESHNET_CACHE" in why
    assert judge_range(manifest, 10, 20, memory_bytes=big, disk_bytes=DiskRoom(sel.nbytes - 1, big),
                       held=set())[0] == "insufficient_disk"
    monkeypatch.setenv("MESHNET_CACHE", str(tmp_path / "cache"))
    store = tmp_path / "store"
    store.mkdir()
    assert disk_room(manifest, store, 10, 20).shard_held is False
    shard = shard_path_of(manifest.model_revision, 10, 20)
    shard.parent.mkdir(parents=True)
    shard.write_bytes(b"cut")
    assert disk_room(manifest, store, 10, 20).shard_held is True
    assert disk_room(manifest, store, 0, manifest.n_layer).shard_held is False  # the whole file goes in the store


async def test_a_spare_waiting_for_its_order_stops_on_sigterm(
        manifest: ArtifactManifest, nats_server: NatsServer, tmp_path: Path) -> None:
    """SIGTERM (or Ctrl-C) ends a spare that waits for an order, or a node whose pieces are
    still coming, at once: the signal was only looked at once the shard had loaded."""
    import signal

    path = tmp_path / "m.json"
    manifest.save(path)
    user, password = nats_server.credentials("node")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "nodes.main", "--manifest", str(path), "--spare", "--store", str(tmp_path / "store"),
        "--nats", nats_server.url, "--nats-user", user, "--nats-password", password, "--node-id", "idle-spare",
        cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 60)
        assert b"waiting for a rebalance order" in line, line
        proc.send_signal(signal.SIGTERM)
        _, err = await asyncio.wait_for(proc.communicate(), 10)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0 and "stopped before its shard was loaded" in err.decode(), err.decode()[-2000:]
    assert "Traceback" not in err.decode()


async def test_a_piece_store_that_cannot_be_made_is_one_line_not_a_traceback(
        manifest: ArtifactManifest, nats_server: NatsServer, tmp_path: Path) -> None:
    (tmp_path / "store").write_text("a file where the store would go")  # as a full or read-only disk: an OSError
    code, err = await _manifest_node(manifest, nats_server, tmp_path, "no-store", "--layers", "10:20")
    assert code == 3 and "Traceback" not in err, err[-2000:]
    assert f"cannot make the piece store {tmp_path / 'store'}" in err and "--store puts it elsewhere" in err, err


async def test_a_spare_whose_order_cannot_be_fetched_says_failed_and_waits_again(
        manifest: ArtifactManifest, nats_server: NatsServer, bus_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """No seeder holds the ordered range's pieces: the spare replies `failed` (the tracker then
    asks another node) and waits for another order, instead of exiting and being a spare no more."""
    import signal

    from bus import subjects
    from schemas.artifacts import RebalanceReply
    from schemas.rebalance import RebalanceDirective

    tracker = await bus_factory("tracker")
    path = tmp_path / "m.json"
    manifest.save(path)
    user, password = nats_server.credentials("node")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "nodes.main", "--manifest", str(path), "--spare", "--store", str(tmp_path / "store"),
        "--fetch-stall", "1", "--nats", nats_server.url, "--nats-user", user, "--nats-password", password,
        "--node-id", "sp-fail", cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        assert proc.stdout is not None
        assert b"waiting for a rebalance order" in await asyncio.wait_for(proc.stdout.readline(), 60)
        async with tracker.subscribe(subjects.rebalance_reply("sp-fail"), RebalanceReply) as replies:
            await tracker.publish(subjects.rebalance("sp-fail"), RebalanceDirective(
                node_id="sp-fail", model=manifest.model, model_revision=manifest.model_revision, n_layer=30,
                layer_start=10, layer_end=20, reason="gap", artifact_id=manifest.artifact_id))
            codes = [(await replies.next(timeout=30)).code for _ in range(2)]
        assert codes == ["accepted", "failed"]
        lines = [await asyncio.wait_for(proc.stdout.readline(), 30) for _ in range(2)]
        assert b"rebalance order: loading layers [10,20)" in lines[0] and b"waiting for a rebalance order" in lines[1]
        assert proc.returncode is None  # still a spare
        proc.send_signal(signal.SIGTERM)
        _, err = await asyncio.wait_for(proc.communicate(), 10)
        assert "could not load layers [10,20)" in err.decode() and "Traceback" not in err.decode()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
