"""`meshnet validator`: replay the sessions the gateway samples and publish verdicts.

    meshnet validator                         # the bundled model as the llama.cpp reference
    meshnet validator --reference torch       # the PyTorch reference (loose tolerance)
    meshnet validator --reference none        # route replays only

The gateway chooses which sessions are sampled (`meshnet gateway --validate-rate`, default
0.05, and every session a client flags with x-meshnet-validate: on). Trackers quarantine the
nodes the verdicts implicate (docs/validation.md).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

from artifacts.bundled import resolve_model
from artifacts.shard_file import read_model_info
from bus import runloop
from bus.cli_args import number
from bus.client import connect_as, until_stopped
from bus.config import BusSettings, add_bus_arguments
from bus.errors import BusConnectError
from nodes.engine import EngineError
from schemas.capability import KV_PROFILES, MAX_CTX, MIN_CTX, usual_kv_profile
from validator.replay import Reference
from validator.service import VALIDATOR_DURABLE, Validator

log = logging.getLogger("meshnet.validator")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="meshnet validator", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="GGUF path or the bundled model name (the reference's model)")
    p.add_argument("--reference", default="llama.cpp", choices=("llama.cpp", "torch", "none"),
                   help="whole-model engine used when no disjoint route exists, and to say which of two "
                        "disagreeing routes is wrong (default llama.cpp: bit-exact with the routes)")
    p.add_argument("--ctx", type=number(MIN_CTX, MAX_CTX, integer=True), default=4096,
                   help="the reference's context size: the longest session it replays (default 4096)")
    p.add_argument("--kv-profile", default=None, choices=KV_PROFILES,
                   help="the llama.cpp reference's KV profile: it judges only sessions whose hops ran the "
                        "same (meshnet node --kv-profile); others are inconclusive. Default: exact wherever "
                        "the model's head dimension allows a q8_0 K, as `meshnet node`")
    p.add_argument("--threads", type=int, default=1, help="the reference's threads (default 1)")
    p.add_argument("--nice", type=int, default=10,
                   help="run this much below normal CPU priority (default 10): replays are background work, "
                        "and take the CPU users leave; 0 to compete equally")
    p.add_argument("--no-route-replay", action="store_true", help="replay on the reference only")
    p.add_argument("--validator-id", default="validator", help="names its durable consumer and its verdicts")
    p.add_argument("--log-level", default="INFO")
    add_bus_arguments(p)
    return p


async def serve(args: argparse.Namespace) -> int:
    if args.nice > 0:
        os.nice(args.nice)
    try:
        reference, profile = await _load_reference(args)
    except (OSError, ValueError, EngineError) as exc:  # no such file, not a GGUF, a model llama.cpp refuses
        print(f"meshnet validator: {exc}", file=sys.stderr)
        return 2
    s = BusSettings.from_args("validator", args)
    try:
        bus = await connect_as(s.url, "validator", user=s.user, password=s.password, name="meshnet-validator")
    except BusConnectError as exc:
        print(f"meshnet validator: {exc}", file=sys.stderr)
        return 1
    validator = Validator(bus, validator_id=args.validator_id, reference=reference,
                          route_replay=not args.no_route_replay,
                          durable=f"{VALIDATOR_DURABLE}-{args.validator_id}")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    task = asyncio.create_task(validator.run(), name="validator")
    print(f"meshnet validator {args.validator_id}: reference {args.reference} ({profile} KV profile), "
          f"route replay {'off' if args.no_route_replay else 'on'}", flush=True)
    stopping = asyncio.create_task(until_stopped(stop, bus))
    try:
        await asyncio.wait([task, stopping], return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, stopping):
            t.cancel()
        results = await asyncio.gather(task, stopping, return_exceptions=True)
        await bus.close()
        if reference is not None:
            reference.close()
    if isinstance(results[0], Exception):
        print(f"meshnet validator: stopped: {type(results[0]).__name__}: {results[0]}", file=sys.stderr)
        return 1
    return 1 if bus.lost.is_set() else 0


async def _load_reference(args: argparse.Namespace) -> tuple[Reference | None, str]:
    """The reference engine `--reference` names (None for route replays only) and its KV profile:
    the one asked for, else the one a node of this model runs by default (exact only where the
    head dimension allows a q8_0 K: a model with another was refused with a traceback)."""
    if args.reference == "none":
        return None, args.kv_profile or "exact"
    path = resolve_model(args.model)
    info = read_model_info(path)
    profile = args.kv_profile or usual_kv_profile(info.head_dim)
    log.info("loading the %s reference: %s, %d layers", args.reference, path.name, info.n_layer)
    reference = await asyncio.to_thread(Reference, args.reference, path, info.n_layer, n_ctx=args.ctx,
                                        n_threads=args.threads, kv_profile=profile)
    return reference, profile


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return runloop.run(serve(args))


if __name__ == "__main__":
    sys.exit(main())
