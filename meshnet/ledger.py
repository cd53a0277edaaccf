"""`meshnet ledger`: what each node earned, from the tracker's Work Ledger (docs/control-plane.md).

Reads the MESH_LEDGER key-value bucket as the monitor user (a running `meshnet up`'s login by
default, as `meshnet watch` does). The tracker keeps it (`meshnet tracker`, unless --no-ledger).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys

from bus.client import Bus
from bus.config import add_bus_arguments
from bus.errors import BusConnectError
from bus.jetstream import JetStreamError, read_ledger
from bus.runinfo import read_run_file, run_file_path
from meshnet.watch import monitor_settings
from schemas.ledger import ledger_view


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="meshnet ledger", description=__doc__)
    add_bus_arguments(p)
    p.add_argument("--json", action="store_true", help="one JSON object")
    return p


def render(view: dict) -> str:
    """The ledger as a table (pure). The claims it refused, left waiting or could not read are
    said beside the totals and per node: they are what an operator reads to see a node that
    claims more than it did."""
    lines = [f"Work Ledger: {view['events']} events counted (stream seq {view['last_seq']}), "
             f"{view['duplicates_skipped']} duplicates skipped, {view['refused_claims']} claims refused, "
             f"{view['unvouched_claims']} waiting for a vouch, {view['invalid_skipped']} invalid",
             f"{'node':<24} {'sessions':>8} {'prefill tok':>11} {'decode tok':>10} {'prefill GB':>11} "
             f"{'decode GB':>10} {'seed MB':>9} {'refused':>7}"]
    for n in view["nodes"]:
        lines.append(f"{n['node_id']:<24} {n['sessions']:>8} {n['prefill_tokens']:>11} {n['decode_tokens']:>10} "
                     f"{n['prefill_work']:>11.3f} {n['decode_work']:>10.3f} {n['seed_bytes'] / 1e6:>9.1f} "
                     f"{n['refused_claims']:>7}")
    lines.append(f"work: {view['units']['work']}; seeding is kept apart and earns no inference credit")
    return "\n".join(lines)


async def run(args: argparse.Namespace) -> int:
    settings = monitor_settings(args, os.environ, read_run_file(run_file_path()))
    try:
        bus = await Bus.connect(settings.url, role="monitor", user=settings.user, password=settings.password,
                                name="meshnet-ledger")
    except BusConnectError as exc:
        print(f"meshnet ledger: {exc}", file=sys.stderr)
        return 1
    try:
        view = ledger_view(await read_ledger(bus))
    except JetStreamError as exc:
        print(f"meshnet ledger: {exc}", file=sys.stderr)
        return 1
    finally:
        await bus.close()
    print(json.dumps(view, indent=1) if args.json else render(view))
    return 0


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(run(build_parser().parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
