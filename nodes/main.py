"""`meshnet node`: load a shard, serve activation frames over HTTP, live on the bus."""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import os
import signal
import socket
import sys
import uuid

from aiohttp import web

from artifacts.bundled import resolve_model
from bus import runloop
from bus.client import Bus
from bus.config import BusSettings, add_bus_arguments
from nodes.server.app import create_app
from nodes.server.core_lock import CORE_LOCK_MODES, CoreLock, wants_core_lock
from nodes.server.frame_plane import FrameHandlers
from nodes.server.runner import PLACEMENTS, EngineRunner
from nodes.server.runtime import DEFAULT_LEASE_S, NodeOptions, NodeRuntime
from nodes.server.scheduler import MIXED_PREFILL_ROWS, PREFILL_SLICE_S
from nodes.shard_checks import DEFAULT_KV_MEMORY
from schemas.frames import DEFAULT_WINDOW
from wire.server import ConnectionBounds, FrameServer

log = logging.getLogger("meshnet.node")

TEST_DELAY_ENV = "MESHNET_TEST_DELAY_MS"  # test-only: slow every frame on this node


def parse_layers(text: str) -> tuple[int, int]:
    """Parse `A:B` into the half-open layer range (A, B)."""
    try:
        a, b = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--layers wants A:B, got {text!r}") from None
    if not 0 <= a < b:
        raise argparse.ArgumentTypeError(f"--layers {text!r} is not a non-empty range")
    return a, b


_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_bytes(text: str) -> int:
    """Parse a byte count such as `1073741824`, `512M`, `2G` or `1.5GiB` (binary units)."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = t[-1:] if t[-1:] in _UNITS and t[-1:] != "" else ""
    try:
        value = float(t[: len(t) - len(unit)]) * _UNITS[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a byte count: {text!r} (try 512M or 2G)") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"byte count must be positive: {text!r}")
    return int(value)


def build_parser() -> argparse.ArgumentParser:
    """The `meshnet node` command line."""
    p = argparse.ArgumentParser(prog="meshnet node", description=__doc__)
    p.add_argument("--model", default=None, help="GGUF path or the bundled model name (default: bundled)")
    p.add_argument("--layers", type=parse_layers, required=True, help="layer range A:B (half-open)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="activation port (0 = a free port)")
    p.add_argument("--advertise", default=None, metavar="URL",
                   help="activation URL announced to the tracker (default: http://<host>:<port>; "
                        "for --host 0.0.0.0, this machine's hostname)")
    p.add_argument("--node-id", default=None, help="node id (default: node-<random>)")
    p.add_argument("--backend", default="llama", choices=["llama", "torch"])
    p.add_argument("--threads", type=int, default=None, help="engine threads for decode steps")
    p.add_argument("--batch-threads", type=int, default=None, help="engine threads for prefill chunks")
    p.add_argument("--engine-placement", default="inline", choices=PLACEMENTS,
                   help="run model calls on the event loop's thread (inline: no thread hand-off per "
                        "frame) or on a dedicated thread (the loop answers during long prefill chunks)")
    p.add_argument("--inline-slice-ms", type=float, default=PREFILL_SLICE_S * 1e3,
                   help="longest one batch of prefill rows may take (it holds the event loop inline); "
                        "longer prompts run in slices (0 = only the 512-row batch bound)")
    p.add_argument("--mixed-prefill-rows", type=int, default=MIXED_PREFILL_ROWS,
                   help="prefill rows in a batch that also carries other sessions' decode steps")
    p.add_argument("--core-lock", default="auto", choices=CORE_LOCK_MODES,
                   help="take turns with the other nodes on this machine for each model call (auto: when "
                        "this node's engine uses every core, so co-located engines never oversubscribe them)")
    p.add_argument("--ctx", type=int, default=None, help="context size per session")
    p.add_argument("--window", type=int, default=DEFAULT_WINDOW, help="credit window (frames)")
    p.add_argument("--wire-dtype", default="f32", choices=["f32", "f16", "bf16"],
                   help="dtype of hidden rows sent to the next hop")
    p.add_argument("--compression", default="none", choices=["none", "zstd"],
                   help="compress bodies to the next hop (zstd level 1) if it accepts")
    p.add_argument("--kv-memory", type=parse_bytes, default=DEFAULT_KV_MEMORY,
                   help="bytes of Hot KV State this shard may hold, e.g. 512M or 2G (default 1G); session "
                        "slots = this / (KV bytes per token x --ctx)")
    p.add_argument("--max-sessions", type=int, default=None,
                   help="at most this many concurrent Route Sessions (default: as many as --kv-memory holds)")
    p.add_argument("--lease", type=float, default=DEFAULT_LEASE_S, help="idle session lease (s)")
    p.add_argument("--head-timeout", type=float, default=10.0,
                   help="seconds a request head may take to arrive, from its first byte (then 408)")
    p.add_argument("--body-timeout", type=float, default=30.0,
                   help="seconds a declared request body may take to arrive (then 408; the frame never runs)")
    p.add_argument("--idle-timeout", type=float, default=300.0,
                   help="seconds a keep-alive connection may sit without a request")
    p.add_argument("--max-connections", type=int, default=512,
                   help="frame-port connections at once (more get 503)")
    p.add_argument("--reap-interval", type=float, default=5.0, help="how often idle sessions are checked (s)")
    p.add_argument("--no-bus", action="store_true", help="do not connect to NATS (debugging only)")
    p.add_argument("--log-level", default="INFO")
    add_bus_arguments(p)
    return p


def _engine_opts(args: argparse.Namespace) -> dict[str, int]:
    opts = {"n_threads": args.threads, "n_threads_batch": args.batch_threads, "n_ctx": args.ctx,
            "kv_memory": args.kv_memory, "max_sessions": args.max_sessions}
    return {k: v for k, v in opts.items() if v is not None}


def activation_url(advertise: str | None, host: str, port: int) -> str:
    """The URL the previous hop uses to reach this node's activation server."""
    if advertise:
        return advertise.rstrip("/")
    if host in {"0.0.0.0", "::", ""}:
        host = socket.getfqdn()
    return f"http://{host}:{port}"


def _listen(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)  # connections wait in the backlog until the app is up
    sock.setblocking(False)
    return sock


async def serve(args: argparse.Namespace) -> int:
    """Run the node until SIGINT/SIGTERM; return the exit code."""
    from nodes.engine_factory import load_engine

    start, end = args.layers
    model_path = resolve_model(args.model)
    log.info("loading %s layers [%d,%d) with the %s backend", model_path.name, start, end, args.backend)
    engine_runner = await EngineRunner.load(
        functools.partial(load_engine, args.backend, model_path, start, end, **_engine_opts(args)),
        args.engine_placement)
    if wants_core_lock(args.core_lock, args.threads or os.cpu_count() or 1, os.cpu_count() or 1):
        engine_runner.core_lock = CoreLock()
    sock = _listen(args.host, args.port)
    url = activation_url(args.advertise, args.host, sock.getsockname()[1])
    node_id = args.node_id or f"node-{uuid.uuid4().hex[:8]}"
    bus = None
    if not args.no_bus:
        s = BusSettings.from_args("node", args)
        bus = await Bus.connect(s.url, role="node", user=s.user, password=s.password, name=node_id,
                                node_id=node_id)  # its subjects and inbox carry its id
    opts = NodeOptions(
        node_id=node_id, window=args.window, wire_dtype=args.wire_dtype, compression=args.compression,
        max_sessions=args.max_sessions, mixed_prefill_rows=args.mixed_prefill_rows,
        prefill_slice_s=args.inline_slice_ms / 1e3 if args.inline_slice_ms > 0 else None, lease_s=args.lease, reap_interval_s=args.reap_interval,
        test_delay_s=float(os.environ.get(TEST_DELAY_ENV, "0")) / 1e3,
    )
    runtime = NodeRuntime(engine_runner, opts, url=url, bus=bus)
    runner = web.AppRunner(create_app(runtime), access_log=None, handle_signals=False,
                           keepalive_timeout=DEFAULT_LEASE_S)
    frames: FrameServer | None = None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await runner.setup()
        frames = FrameServer(FrameHandlers(runtime), runner.server, ConnectionBounds(  # the frame plane; the rest goes to the app
            head_timeout_s=args.head_timeout, body_timeout_s=args.body_timeout,
            idle_timeout_s=args.idle_timeout, max_connections=args.max_connections))
        await frames.start(sock)
        cap = runtime.capability
        print(f"meshnet node {node_id} serving {cap.model_name} layers {cap.layers} at {url}", flush=True)
        await stop.wait()
        log.info("shutting down: closing sessions")
    finally:
        await runtime.table.close_all("node shutting down")  # answers frames still waiting
        runtime.scheduler.close()
        if frames is not None:
            await frames.close()
        await runner.cleanup()
        if bus is not None:
            await bus.close()
        await runtime.runner.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of `meshnet node`."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return runloop.run(serve(args))


if __name__ == "__main__":
    sys.exit(main())
