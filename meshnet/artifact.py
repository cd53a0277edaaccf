"""`meshnet artifact`: Artifact Manifests, the pieces a layer range needs, verification, seeding.

    meshnet artifact manifest MODEL.gguf [-o manifest.json] [--piece-size 8M]
    meshnet artifact pieces MANIFEST --layers 15:30 [--json]
    meshnet artifact layout [MODEL.gguf] --nodes 2 [--json]
    meshnet artifact verify DIR [--json]
    meshnet artifact seed MODEL.gguf|DIR [--manifest M] [--port P]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import signal
import sys
import uuid
from pathlib import Path

from artifacts.gguf_header import GGUFFormatError
from artifacts.manifest import (
    DEFAULT_PIECE_BYTES,
    ArtifactManifest,
    ManifestError,
    ProgressLine,
    build_manifest,
    cached_manifest,
    pieces_for_range,
)
from artifacts.piece_store import PieceStore


def _layers(text: str) -> tuple[int, int]:
    from nodes.main import parse_layers

    return parse_layers(text)


MIN_PIECE_BYTES = 64 << 10  # smaller pieces only multiply hashes, requests and bookkeeping
MAX_PIECE_BYTES = 1 << 30


def _bytes(text: str) -> int:
    from nodes.main import parse_bytes

    return parse_bytes(text)


def _piece_bytes(text: str) -> int:
    n = _bytes(text)
    if not MIN_PIECE_BYTES <= n <= MAX_PIECE_BYTES:
        raise argparse.ArgumentTypeError(f"a piece size from 64K to 1G, not {text}")
    return n


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="meshnet artifact", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("manifest", help="hash a GGUF into pieces and write its Artifact Manifest")
    m.add_argument("model", help="GGUF path, or the bundled model name")
    m.add_argument("-o", "--output", default=None, help="where to write it (default: stdout)")
    m.add_argument("--piece-size", type=_piece_bytes, default=DEFAULT_PIECE_BYTES, help="largest piece (default 8M)")
    pc = sub.add_parser("pieces", help="the pieces (and bytes) a node serving a layer range must fetch")
    pc.add_argument("manifest")
    pc.add_argument("--layers", type=_layers, required=True, help="A:B")
    pc.add_argument("--json", action="store_true")
    lo = sub.add_parser("layout", help="the --layers of N nodes that cost about the same per token "
                                       "(the tail also runs the output head)")
    lo.add_argument("model", nargs="?", default=None, help="GGUF path (default: the bundled model)")
    lo.add_argument("--nodes", type=int, required=True, help="how many Shards")
    lo.add_argument("--json", action="store_true")
    v = sub.add_parser("verify", help="check every piece in a store; say which layer ranges it can serve")
    v.add_argument("dir", help="a piece store directory (with manifest.json)")
    v.add_argument("--json", action="store_true")
    s = sub.add_parser("seed", help="seed-only process (no engine): serve pieces of a GGUF or a piece store")
    s.add_argument("source", help="GGUF path (or the bundled model name) or a piece store directory")
    s.add_argument("--manifest", default=None, help="the manifest of the GGUF (default: build it, cached)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=0)
    s.add_argument("--advertise", default=None, metavar="URL")
    s.add_argument("--node-id", default=None, help="seeder id (default: seed-<random>)")
    s.add_argument("--no-bus", action="store_true", help="serve HTTP only (no announcements)")
    s.add_argument("--log-level", default="INFO")
    from bus.config import add_bus_arguments

    add_bus_arguments(s)
    return p


def cmd_manifest(args: argparse.Namespace) -> int:
    from artifacts.bundled import resolve_model

    path = resolve_model(args.model)
    progress = ProgressLine(f"hashing {path.name}") if sys.stderr.isatty() else None
    m = build_manifest(path, piece_bytes=args.piece_size, progress=progress)
    text = m.model_dump_json(indent=1)
    if args.output:
        Path(args.output).write_text(text)
        print(f"wrote {args.output}: artifact {m.artifact_id}, {len(m.pieces)} pieces, "
              f"{m.file_size / 1e6:.1f} MB, {m.n_layer} layers", file=sys.stderr)
    else:
        print(text)
    return 0


def cmd_pieces(args: argparse.Namespace) -> int:
    m = ArtifactManifest.load(args.manifest)
    sel = pieces_for_range(m, *args.layers)
    if args.json:
        print(json.dumps({"artifact_id": m.artifact_id, "layers": list(args.layers), "bytes": sel.nbytes,
                          "bytes_by_role": sel.by_role(),
                          "pieces": [p.model_dump() for p in sel.pieces]}, indent=1))
        return 0
    a, b = args.layers
    print(f"{m.model} layers [{a},{b}) of {m.n_layer}: {len(sel.pieces)} pieces, {sel.nbytes} bytes "
          f"({sel.nbytes / 1e6:.1f} MB of {m.file_size / 1e6:.1f} MB)")
    for role, n in sel.by_role().items():
        print(f"  {role:<10} {n:>12} bytes")
    for p in sel.pieces:
        where = f"layer {p.layer}" if p.layer is not None else p.role
        print(f"  {p.piece_id}  {p.offset:>12}  {p.size:>10}  {where}")
    return 0


def cmd_layout(args: argparse.Namespace) -> int:
    from artifacts.architectures import split_reason
    from artifacts.bundled import resolve_model
    from artifacts.gguf_header import read_header
    from artifacts.layout import layer_costs, shard_layout

    header = read_header(resolve_model(args.model))
    try:
        ranges = shard_layout(header, args.nodes)
    except ValueError as exc:
        print(f"meshnet artifact layout: {exc}", file=sys.stderr)
        return 2
    # ranges a node would refuse to load are no layout (one range is the whole model)
    reason = split_reason(str(header.get("general.architecture", "unknown"))) if len(ranges) > 1 else ""
    if reason:
        print(f"meshnet artifact layout: {reason}", file=sys.stderr)
        return 2
    costs, head = layer_costs(header)
    weights = [sum(costs[a:b]) + (head if b == len(costs) else 0) for a, b in ranges]
    if args.json:
        print(json.dumps({"layers": [list(r) for r in ranges], "weights_per_token": weights,
                          "output_head_weights": head}, indent=1))
        return 0
    for (a, b), w in zip(ranges, weights, strict=True):
        tail = " + the output head" if b == len(costs) else ""
        print(f"--layers {a}:{b}  {b - a:>3} layers{tail}: {w / 1e6:.1f}M weights per token")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    store = PieceStore.open(args.dir)
    progress = ProgressLine("verifying") if sys.stderr.isatty() and not args.json else None
    r = store.verify(progress)
    m = store.manifest
    if args.json:
        print(json.dumps({"artifact_id": r.artifact_id, "complete": r.complete, "verified": len(r.verified),
                          "missing": list(r.missing), "corrupt": list(r.corrupt),
                          "verified_bytes": r.verified_bytes, "ranges": [list(x) for x in r.ranges]}, indent=1))
    else:
        total = len({p.piece_id for p in m.pieces})
        print(f"{args.dir}: {m.model} ({m.artifact_id}): {len(r.verified)}/{total} pieces verified "
              f"({r.verified_bytes / 1e6:.1f} MB)")
        for pid in r.missing:
            print(f"  missing  {_describe(m, pid)}")
        for pid in r.corrupt:
            print(f"  corrupt  {_describe(m, pid)}")
        ranges = ", ".join(f"[{a},{b})" for a, b in r.ranges) or "none"
        print(f"  can serve layer ranges: {ranges}")
    return 0 if not r.corrupt else 1


def _describe(m: ArtifactManifest, pid: str) -> str:
    p = m.piece(pid)
    return f"{pid}  {p.size} bytes  " + (f"layer {p.layer}" if p.layer is not None else p.role)


async def _seed(args: argparse.Namespace) -> int:
    from aiohttp import web

    from artifacts.bundled import resolve_model
    from artifacts.seeder import SeedRoutes, StoreHolder, WholeFileHolder, seed_delay_s
    from bus.client import connect_node
    from bus.config import BusSettings
    from bus.errors import BusConnectError
    from nodes.artifact_plane import SeedPresence
    from nodes.main import activation_url

    routes = SeedRoutes(chunk_delay_s=seed_delay_s())
    src = Path(args.source)
    if src.is_dir():  # noqa: ASYNC240 - once, before serving
        routes.add(StoreHolder(PieceStore.open(src)))
    else:
        path = resolve_model(args.source)
        progress = ProgressLine(f"hashing {path.name}") if sys.stderr.isatty() else None
        manifest = ArtifactManifest.load(args.manifest) if args.manifest else cached_manifest(path, progress=progress)
        routes.add(WholeFileHolder(path, manifest))
    node_id = args.node_id or f"seed-{uuid.uuid4().hex[:8]}"
    app = web.Application()
    routes.register(app)
    bus = None
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    url = activation_url(args.advertise, args.host, port)
    presence = None
    if not args.no_bus:
        s = BusSettings.from_args("node", args)
        try:
            bus = await connect_node(s.url, user=s.user, password=s.password, node_id=node_id)
        except BusConnectError as exc:  # a wrong login, or another node's
            await runner.cleanup()
            print(f"meshnet artifact seed: {exc}", file=sys.stderr)
            return 2
        presence = SeedPresence(bus, routes, node_id=node_id, seed_url=url)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    for aid, h in routes.holders.items():
        print(f"meshnet artifact seed {node_id}: seeding {h.manifest.model} ({aid}), "
              f"{len(h.held())} pieces, at {url}", flush=True)
    try:
        # the announce and seed-audit loops, as a node runs them (their owner: this block)
        async with contextlib.AsyncExitStack() as stack:
            if presence is not None:
                await stack.enter_async_context(contextlib.asynccontextmanager(presence.tasks())(None))
            await stop.wait()
    finally:
        await runner.cleanup()
        if bus is not None:
            await bus.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.cmd == "manifest":
            return cmd_manifest(args)
        if args.cmd == "pieces":
            return cmd_pieces(args)
        if args.cmd == "verify":
            return cmd_verify(args)
        if args.cmd == "layout":
            return cmd_layout(args)
        logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        # asyncio's own loop, not uvloop: only it has loop.sendfile, so pieces go from the page
        # cache to the socket without a copy (a seed-only process carries no frames)
        return asyncio.run(_seed(args))
    except (ManifestError, GGUFFormatError, OSError) as exc:  # a wrong path, not a GGUF, a cut one
        print(f"meshnet artifact {args.cmd}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
