"""The benchmarks' own argument handling: --quick defaults that flags given with it still beat.
Bounded numbers come from bus/cli_args.py, as for every command."""

from __future__ import annotations

import argparse
from collections.abc import Sequence


def parse_with_quick(parser: argparse.ArgumentParser, argv: Sequence[str] | None,
                     quick: dict[str, object]) -> argparse.Namespace:
    """Parse `argv`; with --quick, `quick` replaces the defaults only, so a flag given on the
    command line still wins."""
    args = parser.parse_args(argv)
    if args.quick:
        parser.set_defaults(**quick)
        args = parser.parse_args(argv)
    return args
