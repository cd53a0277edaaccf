"""`meshnet gateway`: run the OpenAI-compatible gateway with live Generation Telemetry."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import TypeVar

from aiohttp import web

from bus import runloop
from bus.cli_args import number, port
from bus.config import BusSettings, add_bus_arguments
from bus.errors import BusConnectError
from gateway.admission import DEFAULT_MAX_QUEUE, DEFAULT_QUEUE_TIMEOUT
from gateway.api_keys import API_KEYS_ENV, key_arg, key_file_arg, keys_from_env
from gateway.app import LOST_HOOK, create_app
from gateway.generation import REPLAY_MODES
from gateway.served_model import ModelLoadError
from gateway.settings import DEFAULT_DRAFT, DEFAULT_TOKEN_FLUSH_MS, GatewaySettings
from gateway.state import BUS_STATE
from schemas.frames import MAX_DRAFT, MAX_RUN_FLUSH_MS
from wire.client import authority

T = TypeVar("T", int, float)


def _flush_ms(raw: str) -> int:
    value = int(raw)
    if not 0 <= value <= MAX_RUN_FLUSH_MS:
        raise argparse.ArgumentTypeError(f"must be between 0 and {MAX_RUN_FLUSH_MS} ms")
    return value


def _rate(raw: str) -> float:
    value = float(raw)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError("must be between 0 and 1")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The command line of `meshnet gateway`."""
    p = argparse.ArgumentParser(prog="meshnet gateway", description=__doc__)
    _serving_arguments(p)
    _session_arguments(p)
    _access_arguments(p)
    p.add_argument("--log-level", default="INFO")
    add_bus_arguments(p)
    return p


def _serving_arguments(p: argparse.ArgumentParser) -> None:
    """Where it listens, the model, how routes are asked for and fed, and its queue."""
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=port, default=8000, help="port to listen on (default 8000)")
    p.add_argument("--model", default=None,
                   help="GGUF path or bundled name whose tokenizer and chat template to use")
    p.add_argument("--route-timeout", type=number(0, above=True), default=5.0,
                   help="seconds to wait for the tracker's route reply")
    p.add_argument("--chunk-size", type=number(1, integer=True), default=None, help="prefill tokens per frame")
    p.add_argument("--token-flush-ms", type=_flush_ms, default=DEFAULT_TOKEN_FLUSH_MS,
                   help="the route's head sends decoded tokens to the gateway at most this often, "
                        "several at a time (first token at once; 0: every token as it comes; "
                        f"default {DEFAULT_TOKEN_FLUSH_MS}, at most {MAX_RUN_FLUSH_MS})")
    p.add_argument("--max-sessions", type=number(1, integer=True), default=64,
                   help="concurrent Route Sessions this gateway drives; more requests queue")
    p.add_argument("--max-queue", type=number(0, integer=True), default=DEFAULT_MAX_QUEUE,
                   help="requests that may wait for a route when none has room; one more gets "
                        f"503 queue_full with Retry-After (default {DEFAULT_MAX_QUEUE})")
    p.add_argument("--queue-timeout", type=number(0), default=DEFAULT_QUEUE_TIMEOUT,
                   help="seconds a request may wait in the queue before 503 queue_timeout with "
                        f"Retry-After (default {DEFAULT_QUEUE_TIMEOUT:g})")
    p.add_argument("--route-policy", choices=("public", "private"), default="public",
                   help="which nodes a request's route may use unless it says (x-meshnet-route-policy header or a "
                        "route_policy body field): public, any node; private, only --allow-nodes")
    p.add_argument("--allow-nodes", default="", metavar="IDS",
                   help="node ids, comma separated: the allow list of --route-policy private")


def _session_arguments(p: argparse.ArgumentParser) -> None:
    """What a session does when it loses a hop or stalls, and how far its head may draft."""
    p.add_argument("--restart", choices=("on", "off"), default="on",
                   help="when a hop of a session is lost, re-prefill the prompt and the tokens so far "
                        "on a new route and continue the answer (default on; a request may say "
                        "otherwise with the x-meshnet-restart header or a `restart` body field)")
    p.add_argument("--max-restarts", type=number(0, integer=True), default=2,
                   help="new routes one request may use after its first (default 2)")
    p.add_argument("--restart-replay", choices=REPLAY_MODES, default="auto",
                   help="how a restart's route rebuilds the tokens generated so far: auto (one batch "
                        "when every hop of the new route runs `--kv-profile exact`, which gives the "
                        "same bits, else as decode; default), decode (one step each, exactly as the "
                        "lost route computed them) or prefill (one batch, faster; with the default KV "
                        "profile llama.cpp's prefill logits differ slightly from its decode's)")
    p.add_argument("--draft", type=int, default=DEFAULT_DRAFT, choices=range(MAX_DRAFT + 1), metavar=f"0..{MAX_DRAFT}",
                   help="speculative decoding: the most tokens a route's head drafts per decode step by "
                        "prompt lookup, on routes whose every hop runs `--kv-profile exact` (verified rows "
                        "then give the same bits as single steps); the head drafts fewer, or none, where "
                        "its measured acceptance, trip and row costs say drafts do not pay. 0: never. A "
                        "request opts out with `\"speculative\": false` or the header x-meshnet-speculative: off")
    p.add_argument("--restart-keep", choices=("on", "off"), default="on",
                   help="on (default): a restart continues on the lost route's hops that still serve; "
                        "they keep the history in their KV cache, so only the lost hop's layers are "
                        "prefilled again (docs/shard-runtime.md, \"Kept hops\"). off: the new route "
                        "prefills the whole history on every hop")
    p.add_argument("--stall-timeout", type=number(0.1), default=10.0,
                   help="a route that shows no progress for this long in decode (or 20 of its measured "
                        "steps, if longer; in prefill 3 times this plus 1 s per 20 rows of a frame, any hop's "
                        "progress counting) counts as lost: the session restarts or fails (default 10 s)")


def _access_arguments(p: argparse.ArgumentParser) -> None:
    """Replay validation's sample, API keys and /metrics."""
    p.add_argument("--validate-rate", type=_rate, default=0.05, metavar="FRACTION",
                   help="fraction of completed sessions kept for the replay validator (`meshnet validator`), "
                        "0 to 1; a client's x-meshnet-validate: on (or body validate: true) always is (default 0.05)")
    p.add_argument("--api-key", action="append", type=key_arg, default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1/* (repeatable; also "
                        f"{API_KEYS_ENV}, comma-separated, or --api-key-file: a key given here shows in ps). "
                        "Without any key the gateway is open")
    p.add_argument("--api-key-file", type=key_file_arg, default=(), metavar="PATH",
                   help="read API keys from this file, one per line (# comments); read once at start")
    p.add_argument("--metrics-public", action="store_true",
                   help="serve /metrics without a key even when keys are set")


def settings_from_args(args: argparse.Namespace) -> GatewaySettings:
    """GatewaySettings from parsed flags (bus flags fall back to env and dev defaults)."""
    bus = BusSettings.from_args("gateway", args)
    return GatewaySettings(
        host=args.host, port=args.port, nats_url=bus.url, nats_user=bus.user,
        nats_password=bus.password, model=args.model, route_timeout=args.route_timeout,
        chunk_size=args.chunk_size, max_sessions=args.max_sessions, token_flush_ms=args.token_flush_ms,
        max_queue=args.max_queue, queue_timeout=args.queue_timeout,
        route_policy=args.route_policy,  # checked in main(): private needs --allow-nodes
        allow_nodes=tuple(n.strip() for n in args.allow_nodes.split(",") if n.strip()),
        restart=args.restart == "on", max_restarts=args.max_restarts, restart_replay=args.restart_replay,
        restart_keep=args.restart_keep, draft=args.draft, stall_timeout=args.stall_timeout, api_keys=keys_from_env(args.api_key, args.api_key_file),
        metrics_public=args.metrics_public, validate_rate=args.validate_rate,
    )


def main(argv: list[str] | None = None) -> int:
    """Run the gateway until interrupted; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.route_policy == "private" and not args.allow_nodes.strip():
        parser.error("--route-policy private needs --allow-nodes (the nodes a route may use)")
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = settings_from_args(args)
    factory = runloop.loop_factory()
    try:
        return _run(settings, factory)
    except ModelLoadError as exc:  # the app loads the model as it starts: one line, not a traceback
        print(f"meshnet gateway: {exc}", file=sys.stderr)
        return 2
    except BusConnectError as exc:  # a wrong login, or another role's: one line too
        print(f"meshnet gateway: {exc}", file=sys.stderr)
        return 2


def _run(settings: GatewaySettings, factory: Callable[[], asyncio.AbstractEventLoop] | None) -> int:
    """Serve until interrupted; the exit code (1: its bus was lost for good, app._exit_when_lost)."""
    app = create_app(settings)
    app[BUS_STATE][LOST_HOOK] = lambda: os.kill(os.getpid(), signal.SIGTERM)  # run_app's graceful stop
    web.run_app(
        app, loop=factory() if factory else None, host=settings.host, port=settings.port,
        print=lambda *_: print(f"meshnet gateway on http://{authority(settings.host, settings.port)}"
                               + (f" ({len(settings.api_keys)} API key(s) required)" if settings.api_keys
                                  else " (open: no API key required)"), flush=True),
        shutdown_timeout=5.0,
    )
    return 1 if app[BUS_STATE].get("lost") else 0
