"""`meshnet node`: load a shard, serve activation frames over HTTP, live on the bus.

Where the shard comes from:
- `--model F.gguf --layers A:B`: cut from a whole local file (`--seed` also seeds that file's pieces);
- `--manifest M --layers A:B`: only the range's pieces, fetched from seeders (the Shard Swarm)
  into a piece store and verified; the node then seeds them;
- `--manifest M --spare`: no layers until the tracker orders a range (rebalance), then as above.

Several `--layers` make a composite node: one process serving each range as a shard of its own
(own node id, port and bus identity) on one engine thread (nodes/composite.py).

Environment: MESHNET_NODE_TOKEN, if set, is the bearer token (`Authorization: Bearer ...`) that
shows this node's per-session rows in `GET /v1/sessions`; without it anyone sees totals only.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import ipaddress
import logging
import os
import signal
import socket
import sys
import uuid
from collections.abc import Awaitable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlsplit

from aiohttp import web

from artifacts.bundled import ModelNotFoundError, resolve_model
from artifacts.gguf_header import GGUFFormatError
from artifacts.manifest import ArtifactManifest, ManifestError, cached_manifest
from artifacts.piece_store import PieceStore, default_store_dir
from artifacts.seeder import SeedRoutes, StoreHolder, WholeFileHolder, seed_delay_s
from artifacts.shard_file import ShardFileError, read_model_info
from artifacts.source import GGUFFile, ModelSource, open_source
from artifacts.swarm import SwarmError
from bus import runloop
from bus.cli_args import number, port
from bus.client import Bus, connect_node, until_stopped
from bus.config import BusSettings, add_bus_arguments
from bus.credentials import NODE_CREDENTIALS_ENV, node_credentials_from_env
from bus.errors import BusConnectError
from nodes.composite import NodeProcess, composite_problem, shard_namespaces
from nodes.drafters import Drafter, ModelDrafter, PromptLookup, vocabulary_mismatch, weightless
from nodes.engine import EngineError
from nodes.faults import FaultError, parse_fault, with_fault
from nodes.server.app import STATS_TOKEN_ENV, create_app
from nodes.server.engine_turns import EngineTurns
from nodes.server.frame_plane import FrameHandlers
from nodes.server.hop_evidence import DEFAULT_BUDGET_MB
from nodes.server.runner import PLACEMENTS, EngineRunner
from nodes.server.runtime import DEFAULT_LEASE_S, NodeOptions, NodeRuntime
from nodes.server.scheduler import MIXED_PREFILL_ROWS, PREFILL_SLICE_S
from nodes.server.table import KEEP_S
from nodes.shard_checks import DEFAULT_KV_MEMORY
from nodes.shared_prefix import DEFAULT_PREFIX_ROWS
from nodes.spare import RangeDoesNotFit
from schemas.capability import DEFAULT_CTX, KV_PROFILES, MAX_CTX, MIN_CTX, usual_kv_profile
from schemas.frames import DEFAULT_VERIFY_DEPTH, DEFAULT_WINDOW, SPEC_DEPTH
from wire.body_deadline import DEFAULT_BODY_MIN_RATE, DEFAULT_BODY_TIMEOUT
from wire.client import activation_address, authority
from wire.server import ConnectionBounds, FrameServer

log = logging.getLogger("meshnet.node")
T = TypeVar("T")

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
    p = argparse.ArgumentParser(prog="meshnet node", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="GGUF path or the bundled model name (default: bundled)")
    p.add_argument("--layers", type=parse_layers, action="append", default=None,
                   help="layer range A:B (half-open); required unless --spare. Repeat for a composite node: "
                        "one process serving each range as its own shard on one engine thread")
    art = p.add_argument_group("artifacts (the Shard Swarm)")
    art.add_argument("--manifest", default=None, metavar="M",
                     help="an Artifact Manifest (meshnet artifact manifest): fetch only the range's pieces "
                          "from seeders instead of reading a whole local file (with --model: seed that file)")
    art.add_argument("--store", default=None, metavar="DIR",
                     help="where the pieces are kept (default: <cache>/artifacts/<artifact_id>)")
    art.add_argument("--spare", action="store_true",
                     help="join with no layers (needs --manifest); load the range a rebalance order names")
    art.add_argument("--max-memory", type=parse_bytes, default=None,
                     help="refuse a range (or a spare's order) whose weights exceed this "
                          "(default: the machine's free memory)")
    art.add_argument("--seed", action="store_true",
                     help="seed the --model file's pieces to other nodes (always on for piece stores)")
    art.add_argument("--fetch-per-peer", type=number(1, integer=True), default=3, help="piece requests in flight per seeder")
    art.add_argument("--fetch-stall", type=number(0, above=True), default=60.0,
                     help="give up when no seeder holds a missing piece for this long (s)")
    _network_arguments(p)
    _engine_arguments(p)
    _session_arguments(p)
    p.add_argument("--no-bus", action="store_true", help="do not connect to NATS (debugging only)")
    p.add_argument("--fault", default=None, metavar="perturb=SIGMA",
                   help="TESTS ONLY (needs MESHNET_TESTING=1): add noise of SIGMA x row RMS to the hidden "
                        "rows this node sends on, to exercise replay validation and quarantine")
    p.add_argument("--log-level", default="INFO")
    add_bus_arguments(p)
    return p


def _network_arguments(p: argparse.ArgumentParser) -> None:
    """Where the node listens, what it announces, who it is."""
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=port, action="append", default=None,
                   help="activation port (default 0: a free port); a composite node takes one per --layers, "
                        "or one P: shard i then listens on P + i")
    p.add_argument("--advertise", default=None, metavar="URL", type=_advertised, action="append",
                   help="activation URL announced to the tracker (default: http://<host>:<port>; "
                        "for --host 0.0.0.0, this machine's hostname); a composite node takes one per "
                        "--layers, or one http://HOST without a port: each shard then announces HOST "
                        "with its own port")
    p.add_argument("--node-id", action="append", default=None,
                   help="node id (default: node-<random>); a composite node takes one per --layers")


def _engine_arguments(p: argparse.ArgumentParser) -> None:
    """The backend, its threads and KV profile, and how the hop scheduler batches."""
    p.add_argument("--backend", default="llama", choices=["llama", "torch"])
    p.add_argument("--kv-profile", default=None, choices=KV_PROFILES,
                   help="llama.cpp KV cache and attention: exact (flash attention on, q8_0 K, so a call of "
                        "several rows gives each row a single step's bits: the gateway speculates, and a restart "
                        "replays in one batch, both exactly) or default (llama.cpp's own: f16 K and V, flash "
                        "attention off; no speculation). Default: exact on the llama backend wherever the "
                        "model's head dimension is a multiple of 32 (a q8_0 block); docs/shard-runtime.md")
    p.add_argument("--threads", type=number(1, integer=True), default=None, help="engine threads for decode steps")
    p.add_argument("--batch-threads", type=number(1, integer=True), default=None, help="engine threads for prefill chunks")
    p.add_argument("--engine-placement", default="inline", choices=PLACEMENTS,
                   help="run model calls on the event loop's thread (inline: no thread hand-off per "
                        "frame) or on a dedicated thread (the loop answers during long prefill chunks)")
    p.add_argument("--inline-slice-ms", type=number(0), default=PREFILL_SLICE_S * 1e3,
                   help="longest one batch of prefill rows may take (it holds the event loop inline); "
                        "longer prompts run in slices (0 = only the 512-row batch bound)")
    p.add_argument("--mixed-prefill-rows", type=number(0, integer=True), default=MIXED_PREFILL_ROWS,
                   help="prefill rows in a batch that also carries other sessions' decode steps")
    p.add_argument("--shared-prefix-rows", type=number(0, integer=True), default=DEFAULT_PREFIX_ROWS, metavar="N",
                   help="leading rows of each session another session with the same rows may reuse "
                        "instead of computing them (llama.cpp backend; 0 turns it off; default "
                        f"{DEFAULT_PREFIX_ROWS}; off the tail it keeps those rows' outputs: N x hidden x 4 "
                        "bytes per session)")


def _session_arguments(p: argparse.ArgumentParser) -> None:
    """Sessions, the frame wire and the frame port's bounds."""
    p.add_argument("--ctx", type=number(MIN_CTX, MAX_CTX, integer=True), default=None,
                   help=f"context size per session, in tokens (default {DEFAULT_CTX})")
    p.add_argument("--draft-model", type=Path, default=None, metavar="PATH.gguf",
                   help="a head's drafter for speculative decoding: a small GGUF of the same vocabulary, "
                        "run whole with llama.cpp, greedy (default: prompt lookup, no model); a GGUF "
                        "whose tokens differ is refused")
    p.add_argument("--verify-depth", type=int, default=DEFAULT_VERIFY_DEPTH, choices=range(1, SPEC_DEPTH + 1),
                   metavar=f"1..{SPEC_DEPTH}",
                   help="a head's most verify steps of one speculative Decode Run in flight: it sends the next "
                        "before the last is answered while the drafts are kept whole and it decodes nothing "
                        f"else (1: one at a time; default {DEFAULT_VERIFY_DEPTH})")
    p.add_argument("--window", type=number(1, integer=True), default=DEFAULT_WINDOW, help="credit window (frames)")
    p.add_argument("--wire-dtype", default="f32", choices=["f32", "f16", "bf16"],
                   help="dtype of hidden rows sent to the next hop")
    p.add_argument("--compression", default="none", choices=["none", "zstd"],
                   help="compress bodies to the next hop (zstd level 1) if it accepts")
    p.add_argument("--kv-memory", type=parse_bytes, default=DEFAULT_KV_MEMORY,
                   help="bytes of Hot KV State this shard may hold, e.g. 512M or 2G (default 1G); session "
                        "slots = this / (KV bytes per token x --ctx)")
    p.add_argument("--max-sessions", type=number(1, integer=True), default=None,
                   help="at most this many concurrent Route Sessions (default: as many as --kv-memory holds)")
    p.add_argument("--lease", type=number(0, above=True), default=DEFAULT_LEASE_S, help="idle session lease (s)")
    p.add_argument("--first-request-timeout", type=number(0, above=True), default=2.0,
                   help="seconds a new connection may stay silent before its first request (then closed)")
    p.add_argument("--head-timeout", type=number(0, above=True), default=10.0,
                   help="seconds a request head may take to arrive, from its first byte (then 408)")
    p.add_argument("--body-timeout", type=number(0, above=True), default=DEFAULT_BODY_TIMEOUT,
                   help="seconds a declared request body may go without a byte, and its grace before "
                        "--body-min-rate counts (then 408; the frame never runs)")
    p.add_argument("--body-min-rate", type=number(0, above=True), default=DEFAULT_BODY_MIN_RATE, metavar="BYTES_PER_S",
                   help="a request body slower than this on average, once --body-timeout passed, is cut (408); "
                        "a slow link's body that keeps up with it is never cut (default %(default)g)")
    p.add_argument("--idle-timeout", type=number(0, above=True), default=300.0,
                   help="seconds a keep-alive connection may sit without a request")
    p.add_argument("--max-connections", type=number(1, integer=True), default=512,
                   help="frame-port connections at once (more get 503)")
    p.add_argument("--max-connections-per-peer", type=number(1, integer=True), default=256,
                   help="frame-port connections at once from one address (more get 503)")
    p.add_argument("--reap-interval", type=number(0, above=True), default=5.0, help="how often idle sessions are checked (s)")
    p.add_argument("--restart-keep-s", type=number(0), default=KEEP_S, metavar="SECONDS",
                   help="how long a session whose route lost another hop keeps its KV cache here, for a "
                        "restart to continue on this node (a Kept Hop; docs/shard-runtime.md); then, or "
                        "when a new session needs the slot, it is freed. 0: free at once (default %(default)g)")
    p.add_argument("--evidence-mb", type=number(0, integer=True), default=DEFAULT_BUDGET_MB, metavar="MB",
                   help="memory for Hop Evidence: the rows each recent session received and sent here, which "
                        "the validator recomputes to tell whose computation was wrong (docs/validation.md); "
                        "the oldest sessions' go first. 0 keeps none: a failure this node took part in then "
                        "counts against it when every other hop proves itself right (default %(default)d)")


def _engine_opts(args: argparse.Namespace) -> dict[str, int | str]:
    opts = {"n_threads": args.threads, "n_threads_batch": args.batch_threads, "n_ctx": args.ctx,
            "kv_memory": args.kv_memory, "max_sessions": args.max_sessions,
            "prefix_rows": args.shared_prefix_rows,
            "kv_profile": args.kv_profile if args.kv_profile != "default" else None}
    return {k: v for k, v in opts.items() if v is not None}


def _advertised(text: str) -> str:
    """--advertise: an activation URL the other hops can use (http://host:port, or http://host for
    the port the node listens on)."""
    try:
        activation_address(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def activation_url(advertise: str | None, host: str, port: int) -> str:
    """The URL the previous hop uses to reach this node's activation server: --advertise as given,
    with the listening port added when it names none."""
    if advertise:
        url = advertise.rstrip("/")
        return url if urlsplit(url).port is not None else f"{url}:{port}"
    if host in {"0.0.0.0", "::", ""}:
        host = socket.getfqdn()
        if host.split(".")[0] == "localhost":  # /etc/hosts maps the name to loopback: the plain name then
            host = socket.gethostname()
    return f"http://{authority(host, port)}"


def loopback_only(url: str, host: str) -> str | None:
    """The warning for an activation URL that resolves only to loopback on this machine while the
    node listens beyond it (--host 0.0.0.0, or an address other machines use): the other hops
    would reach themselves there, not this node. None when it is fine (or cannot be resolved)."""
    if _is_loopback(host):
        return None  # a node for this machine alone
    name, port = activation_address(url)
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(name, port, type=socket.SOCK_STREAM)}
    except (OSError, UnicodeError):
        return None
    if not addresses or not all(_is_loopback(a) for a in addresses):
        return None
    return (f"this node announces {url}, and {name} resolves to {', '.join(sorted(addresses))} on this machine: "
            f"other machines cannot reach it there; pass --advertise http://<an address they reach>:{port}")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False


def _listen(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)  # connections wait in the backlog until the app is up
    sock.setblocking(False)
    return sock


def kv_profile(args: argparse.Namespace, head_dim: int) -> str:
    """--kv-profile, or its default: exact where llama.cpp runs and the model's head dimension
    allows a q8_0 K (schemas/capability.py); the torch reference has one profile."""
    if args.kv_profile:
        return args.kv_profile
    return usual_kv_profile(head_dim) if args.backend == "llama" else "default"


def check_args(args: argparse.Namespace) -> str | None:
    """What is wrong with this combination of flags (None when it is fine)."""
    if args.spare and not args.manifest:
        return "--spare needs --manifest (the artifact it will fetch a range of)"
    if args.spare and args.layers:
        return "--spare takes no --layers: the tracker's rebalance order names them"
    if not args.spare and args.layers is None:
        return "--layers A:B is required (or --spare with --manifest)"
    if args.manifest and args.no_bus and not args.model:
        return "--manifest without --model fetches pieces from seeders, which needs the bus (drop --no-bus)"
    if args.manifest and args.backend != "llama" and not args.model:
        return "pieces run on the llama backend only (the torch reference reads a whole file)"
    if args.kv_profile not in (None, "default") and args.backend != "llama":
        return f"--kv-profile {args.kv_profile} is a llama.cpp configuration (drop it or use --backend llama)"
    if args.fault is not None:
        try:
            parse_fault(args.fault)
        except FaultError as exc:
            return str(exc)
    return composite_problem(args)


async def _shard_source(args: argparse.Namespace, bus: Bus | None, node_id: str,
                        seeds: SeedRoutes) -> tuple[Path | ModelSource, tuple[int, int], PieceStore | None]:
    """Where the shard comes from, its layer range, and the piece store (if any). A piece
    store's missing pieces are fetched first (a spare waits for its order before that)."""
    from nodes.artifact_plane import fetch_range

    if args.model or not args.manifest:
        path = resolve_model(args.model)
        GGUFFile(path).check_complete()  # before a manifest is hashed or llama.cpp meets the missing bytes
        if args.manifest or args.seed:
            manifest = ArtifactManifest.load(args.manifest) if args.manifest else cached_manifest(path)
            seeds.add(WholeFileHolder(path, manifest))
        return path, args.layers, None
    manifest = ArtifactManifest.load(args.manifest)
    if not args.spare:
        manifest.check_range(*args.layers)  # a range the model does not have: said before a store is made
    store_dir = Path(args.store or default_store_dir(manifest.artifact_id))
    try:
        store = PieceStore.create(store_dir, manifest)
    except OSError as exc:  # this machine's disk (full, read-only, a file in the way): one line, exit 3
        from artifacts.swarm import LocalStoreError
        from nodes.spare import free_disk

        try:
            free = f"{free_disk(store_dir) / 1e6:.1f} MB free"
        except OSError:
            free = "free space unknown"
        raise LocalStoreError(f"cannot make the piece store {store_dir}: {exc.strerror or exc} ({free}; "
                              "--store puts it elsewhere)", missing=[]) from exc
    seeds.add(StoreHolder(store))  # it seeds what it holds, from the start
    assert bus is not None
    if args.spare:
        from artifacts.swarm import LocalStoreError, SwarmError
        from nodes.spare import await_order, memory_budget, order_failed

        while True:  # a spare whose order's pieces cannot be had says so and waits for another
            layers = await await_order(bus, node_id=node_id, manifest=manifest, store_dir=store.root,
                                       held=store.held(), memory_bytes=memory_budget(args.max_memory))
            try:
                await fetch_range(bus, store, *layers, node_id=node_id, per_peer=args.fetch_per_peer,
                                  stall_s=args.fetch_stall, terminal=True)
            except SwarmError as exc:
                if isinstance(exc, LocalStoreError):
                    raise  # its own disk: no other order would fare better
                await order_failed(bus, node_id, manifest, *layers, str(exc))
                continue
            return store.source(), layers, store
    else:
        from nodes.spare import disk_room, judge_range, memory_budget

        layers = args.layers
        code, message = judge_range(manifest, *layers, memory_bytes=memory_budget(args.max_memory),
                                    disk_bytes=disk_room(manifest, store.root, *layers), held=store.held())
        if code != "accepted":  # refused before fetching anything
            raise RangeDoesNotFit(code, f"cannot serve layers [{layers[0]},{layers[1]}): {message}")
    await fetch_range(bus, store, *layers, node_id=node_id, per_peer=args.fetch_per_peer,
                      stall_s=args.fetch_stall, terminal=True)
    return store.source(), layers, store


async def _engine_runner(args: argparse.Namespace, source: Path | ModelSource, start: int, end: int,
                         shared: ThreadPoolExecutor | None) -> EngineRunner:
    """Load the shard's engine (with a test fault when asked for) on the thread that will call
    it (`shared`: a composite node's one engine thread)."""
    from nodes.engine_factory import load_engine

    fault = parse_fault(args.fault) if args.fault else None
    load = functools.partial(load_engine, args.backend, source, start, end, **_engine_opts(args))
    engine_runner = await EngineRunner.load(lambda: with_fault(load(), fault), args.engine_placement, shared)
    if fault is not None:
        log.warning("TEST FAULT: this node perturbs its output rows (sigma %g x RMS)", fault.sigma)
    return engine_runner


class DraftModelError(Exception):
    """A --draft-model that cannot draft for this model."""


def _drafter(args: argparse.Namespace, source: Path | ModelSource, start: int) -> Drafter:
    """The head's drafter: --draft-model's, checked to share the target's vocabulary; else
    prompt lookup (also on every hop after the head, which never drafts)."""
    if args.draft_model is None:
        return PromptLookup()
    if start != 0:
        log.warning("--draft-model is for a route's head (layer 0): this node drafts nothing")
        return PromptLookup()
    if args.kv_profile != "exact":  # a route speculates only when every hop runs it (gateway.generation.speculates)
        raise DraftModelError(f"drafts are verified only on routes of --kv-profile exact hops; this node runs "
                              f"the {args.kv_profile} profile, so the draft model would never draft "
                              f"(use --kv-profile exact with --backend llama, or drop --draft-model)")
    from artifacts.vocab_file import materialize_vocabulary
    from nodes.llama_engine import LlamaShardEngine

    if not args.draft_model.is_file():
        raise DraftModelError(f"no file {args.draft_model}")
    why = vocabulary_mismatch(materialize_vocabulary(source), args.draft_model)
    if why:
        raise DraftModelError(f"{args.draft_model} does not share the model's vocabulary: {why}")
    info = read_model_info(args.draft_model)
    if why := weightless(len(open_source(args.draft_model).header.tensors), info.n_layer):
        raise DraftModelError(f"{args.draft_model} cannot draft: {why}")
    n_layer = info.n_layer
    # the route's profile where the draft model allows it: a self-draft then proposes the route's own tokens
    engine = LlamaShardEngine(args.draft_model, 0, n_layer, n_ctx=args.ctx or DEFAULT_CTX, max_sessions=args.max_sessions,
                              kv_memory=args.kv_memory, n_threads=args.threads, measure=False,
                              kv_profile=usual_kv_profile(info.head_dim))
    log.info("drafting with %s (%d layers)", args.draft_model, n_layer)
    return ModelDrafter(engine)


def _node_options(args: argparse.Namespace, node_id: str) -> NodeOptions:
    return NodeOptions(
        node_id=node_id, window=args.window, wire_dtype=args.wire_dtype, compression=args.compression,
        max_sessions=args.max_sessions, mixed_prefill_rows=args.mixed_prefill_rows,
        prefill_slice_s=args.inline_slice_ms / 1e3 if args.inline_slice_ms > 0 else None, lease_s=args.lease,
        reap_interval_s=args.reap_interval, keep_s=args.restart_keep_s, evidence_mb=max(0, args.evidence_mb),
        test_delay_s=float(os.environ.get(TEST_DELAY_ENV, "0")) / 1e3, verify_depth=args.verify_depth,
        stats_token=os.environ.get(STATS_TOKEN_ENV, ""),
    )


def _connection_bounds(args: argparse.Namespace) -> ConnectionBounds:
    return ConnectionBounds(
        first_request_s=args.first_request_timeout, head_timeout_s=args.head_timeout,
        body_timeout_s=args.body_timeout, body_min_rate=args.body_min_rate, idle_timeout_s=args.idle_timeout, max_connections=args.max_connections,
        max_connections_per_peer=args.max_connections_per_peer)


async def _load(args: argparse.Namespace, source: Path | ModelSource, start: int, end: int,
                shared: ThreadPoolExecutor | None) -> tuple[EngineRunner, Drafter] | str:
    """The shard's engine and the head's drafter, or why they cannot load."""
    info = read_model_info(open_source(source))
    args.kv_profile = kv_profile(args, info.head_dim)
    log.info("loading %s layers [%d,%d) with the %s backend (%s KV profile)", getattr(source, "name", source), start,
             end, args.backend, args.kv_profile)
    if (ctx := args.ctx or DEFAULT_CTX) > info.n_ctx_train > 0:
        log.warning("--ctx %d is beyond the %d tokens of context the model was trained on: positions past "
                    "those may give degraded output", ctx, info.n_ctx_train)
    try:
        engine_runner = await _engine_runner(args, source, start, end, shared)
    except (FaultError, GGUFFormatError, EngineError, ShardFileError) as exc:  # a range outside the model, an
        # unsupported one, a shard file the cache's disk has no room for
        return str(exc)
    try:
        return engine_runner, await asyncio.to_thread(_drafter, args, source, start)
    except (DraftModelError, EngineError) as exc:
        await engine_runner.close()
        return f"--draft-model: {exc}"


async def serve(args: argparse.Namespace) -> int:
    """Run the node (every shard of a composite node) until SIGINT/SIGTERM; the exit code."""
    shards = shard_namespaces(args)
    proc = NodeProcess(len(shards))
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, proc.stop.set)
    if len(shards) > 1:  # a composite node's shards call their engines on one thread: their model calls take turns
        proc.turns = EngineTurns()
        if args.engine_placement == "thread":
            proc.shared = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shard-engine")
    try:
        node_credentials_from_env(os.environ)
    except ValueError as exc:
        print(f"meshnet node: {NODE_CREDENTIALS_ENV} is not a JSON object of node id -> user, password: {exc}",
              file=sys.stderr)
        return 2
    try:
        results = await asyncio.gather(*(_serve_or_stop(a, proc) for a in shards), return_exceptions=True)
    finally:
        if proc.shared is not None:
            proc.shared.shutdown(wait=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return max(r for r in results if isinstance(r, int))


async def _serve_or_stop(args: argparse.Namespace, proc: NodeProcess) -> int:
    """One shard; however it ends, the process's other shards stop too."""
    try:
        return await _serve_shard(args, proc)
    finally:
        proc.stop.set()


async def _connect(args: argparse.Namespace, node_id: str) -> Bus | None:
    """The shard's bus, as its own user: --nats-user, else its entry in a composite node's
    MESHNET_NODE_CREDENTIALS, else MESHNET_NATS_USER (or the dev user)."""
    if args.no_bus:
        return None
    s = BusSettings.from_args("node", args)
    own = node_credentials_from_env(os.environ).get(node_id)
    user, password = (own.user, own.password) if own is not None and not args.nats_user else (s.user, s.password)
    return await connect_node(s.url, user=user, password=password, node_id=node_id)


async def _unless_stopped(work: Awaitable[T], stop: asyncio.Event) -> T | None:
    """`work`'s result, or None when `stop` is set first (`work` is then cancelled: a fetch
    aborts its pieces in flight, keeping their partial files for the next start)."""
    task = asyncio.ensure_future(work)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, stopped, return_exceptions=True)
    if task.cancelled():
        return None
    return task.result()


async def _connect_or_stop(args: argparse.Namespace, node_id: str, stop: asyncio.Event) -> Bus | str | None:
    """The shard's bus (None: --no-bus), or why it has none: refused, or a signal came while it
    waited for a server that is not up yet (it waits as long as that takes)."""
    connecting = asyncio.ensure_future(_connect(args, node_id))
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({connecting, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (connecting, stopped):
            task.cancel()
        await asyncio.gather(connecting, stopped, return_exceptions=True)
    if not connecting.done() or connecting.cancelled():
        return "stopped while waiting for the NATS server"
    if isinstance(exc := connecting.exception(), BusConnectError):
        return str(exc)
    return connecting.result()


async def _serve_shard(args: argparse.Namespace, proc: NodeProcess) -> int:
    """Serve one shard until the process stops; a shard that cannot start stops it. A wrong
    model path, a file that is no GGUF or is cut short, or a busy port is said at once, before
    the bus is up and the model loads."""
    node_id = args.node_id or f"node-{uuid.uuid4().hex[:8]}"
    try:
        if args.model or not args.manifest:
            GGUFFile(resolve_model(args.model)).check_complete()
        sock = _listen(args.host, args.port)  # connections wait in the backlog while the model loads
    except (ModelNotFoundError, GGUFFormatError) as exc:
        return _refuse_start(proc, str(exc))
    except OSError as exc:
        return _refuse_start(proc, f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}")
    try:
        return await _load_and_serve(args, proc, node_id, sock)
    finally:
        sock.close()  # the frame server closed it already if it served


def _refuse_start(proc: NodeProcess, why: str) -> int:
    print(f"meshnet node: {why}", file=sys.stderr)
    proc.stop.set()
    return 2


async def _load_and_serve(args: argparse.Namespace, proc: NodeProcess, node_id: str, sock: socket.socket) -> int:
    """Join the bus, fetch and load the shard, then serve frames on `sock` until the process stops."""
    bus = await _connect_or_stop(args, node_id, proc.stop)
    if isinstance(bus, str):
        print(f"meshnet node: {bus}", file=sys.stderr)
        stopped = proc.stop.is_set()
        proc.stop.set()
        return 0 if stopped and bus.startswith("stopped") else 2
    seeds = SeedRoutes(chunk_delay_s=seed_delay_s())
    try:
        got = await _unless_stopped(_shard_source(args, bus, node_id, seeds), proc.stop)
        if got is None:  # SIGINT/SIGTERM while a spare waited for its order or the pieces came
            print(f"meshnet node {node_id}: stopped before its shard was loaded", file=sys.stderr, flush=True)
            if bus is not None:
                await bus.close()
            return 0
        source, (start, end), _store = got
        loaded = await _load(args, source, start, end, proc.shared)
    except (ManifestError, SwarmError, RangeDoesNotFit, GGUFFormatError) as exc:
        loaded, code = str(exc), 3 if isinstance(exc, SwarmError) else 2
    else:
        code = 2
    if isinstance(loaded, str):
        print(f"meshnet node: {loaded}", file=sys.stderr)
        proc.stop.set()
        if bus is not None:
            await bus.close()
        return code
    engine_runner, drafter = loaded
    lost = bus is not None and bus.lost.is_set()  # closed for good while the shard loaded
    if lost or not await proc.all_loaded():  # or another shard failed, or a signal came
        if lost:
            print(f"meshnet node {node_id}: its NATS connection was lost for good while the shard loaded",
                  file=sys.stderr, flush=True)
            proc.stop.set()
        if bus is not None:
            await bus.close()
        await engine_runner.close()
        return 1 if lost else 0
    url = activation_url(args.advertise, args.host, sock.getsockname()[1])
    if (warning := loopback_only(url, args.host)) is not None:
        log.warning("%s", warning)
    runtime = NodeRuntime(engine_runner, _node_options(args, node_id), url=url, bus=bus, drafter=drafter,
                          turns=proc.turns)
    try:
        lost = await _serve_frames(runtime, args, sock, seeds, proc.stop)
    finally:
        if bus is not None:
            await bus.close()
        await runtime.runner.close()
    return 1 if lost else 0


async def _serve_frames(runtime: NodeRuntime, args: argparse.Namespace, sock: socket.socket, seeds: SeedRoutes,
                        stop: asyncio.Event) -> bool:
    """The shard's activation port (frames, its app, its seeds) until `stop`, or until its bus
    is lost for good (True: the process ends with an error, for its supervisor to restart it)."""
    from nodes.artifact_plane import SeedPresence

    app = create_app(runtime)
    if seeds.holders:
        seeds.register(app)  # pieces are served on the activation port, apart from frames
        if runtime.bus is not None:
            app.cleanup_ctx.append(SeedPresence(runtime.bus, seeds, node_id=runtime.node_id,
                                                seed_url=runtime.url).tasks())
    # connections handed to the app keep the frame plane's idle bound between requests
    runner = web.AppRunner(app, access_log=None, handle_signals=False, keepalive_timeout=args.idle_timeout)
    frames: FrameServer | None = None
    try:
        try:
            await runner.setup()  # subscribes to directives, announces the node
        except Exception:
            if runtime.bus is None or not runtime.bus.lost.is_set():
                raise
            print(f"meshnet node {runtime.node_id}: its NATS connection was lost for good while it started",
                  file=sys.stderr, flush=True)
            stop.set()
            return True
        # the frame plane; the rest goes to the app
        frames = FrameServer(FrameHandlers(runtime), runner.server, _connection_bounds(args))
        await frames.start(sock)
        cap = runtime.capability
        print(f"meshnet node {runtime.node_id} serving {cap.model_name} layers {cap.layers} at {runtime.url}",
              flush=True)
        lost = await until_stopped(stop, runtime.bus)
        stop.set()  # the process's other shards too
        log.info("%s shutting down: %s", runtime.node_id,
                 "its bus is lost, closing sessions" if lost else "leaving the mesh, closing sessions")
        if runtime.presence is not None and not lost:
            await runtime.presence.leave()
    finally:
        await runtime.table.close_all("node shutting down")  # answers frames still waiting
        if frames is not None:
            await frames.close()
        await runner.cleanup()
    return lost


def main(argv: list[str] | None = None) -> int:
    """Entry point of `meshnet node`."""
    parser = build_parser()
    args = parser.parse_args(argv)
    problem = check_args(args)
    if problem:
        parser.error(problem)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return runloop.run(serve(args))


if __name__ == "__main__":
    sys.exit(main())
