"""Argument types the benchmarks share: numbers with bounds and comma-separated lists of them,
refused by argparse with a message naming the flag (not a traceback after the mesh started)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence


def number(low: float, high: float = float("inf"), *, above: bool = False,
           integer: bool = False) -> Callable[[str], float]:
    """A number in [low, high] (in (low, high] with `above`); an int with `integer`."""
    def parse(text: str) -> float:
        try:
            value = int(text) if integer else float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {'an integer' if integer else 'a number'}: {text!r}") from None
        if not math.isfinite(value) or value < low or value > high or (above and value == low):
            bounds = f"{'above' if above else 'at least'} {low:g}" + (f" and at most {high:g}" if high < float("inf") else "")
            raise argparse.ArgumentTypeError(f"must be {bounds}, got {text}")
        return value
    return parse


def number_list(low: float, high: float = float("inf"), *, integer: bool = False) -> Callable[[str], list]:
    """A comma-separated list of numbers, each as `number` reads it."""
    one = number(low, high, integer=integer)

    def parse(text: str) -> list:
        return [one(part.strip()) for part in text.split(",")]
    return parse


def parse_with_quick(parser: argparse.ArgumentParser, argv: Sequence[str] | None,
                     quick: dict[str, object]) -> argparse.Namespace:
    """Parse `argv`; with --quick, `quick` replaces the defaults only, so a flag given on the
    command line still wins."""
    args = parser.parse_args(argv)
    if args.quick:
        parser.set_defaults(**quick)
        args = parser.parse_args(argv)
    return args
