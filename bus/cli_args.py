"""Argument types the commands and benchmarks share: numbers with bounds and comma-separated
lists of them, refused by argparse with a message naming the flag (not a traceback after a
model loaded or a mesh started)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def number(low: float, high: float = float("inf"), *, above: bool = False,
           integer: bool = False) -> Callable[[str], float]:
    """A number in [low, high] (in (low, high] with `above`); an int with `integer`."""
    def parse(text: str) -> float:
        try:
            value = int(text) if integer else float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {'an integer' if integer else 'a number'}: {text!r}") from None
        if not math.isfinite(value) or value < low or value > high or (above and value == low):
            show = (lambda v: str(int(v))) if integer else (lambda v: f"{v:g}")
            bounds = f"{'above' if above else 'at least'} {show(low)}" + (
                f" and at most {show(high)}" if high < float("inf") else "")
            raise argparse.ArgumentTypeError(f"must be {bounds}, got {text}")
        return value
    return parse


def number_list(low: float, high: float = float("inf"), *, integer: bool = False) -> Callable[[str], list]:
    """A comma-separated list of numbers, each as `number` reads it."""
    one = number(low, high, integer=integer)

    def parse(text: str) -> list:
        return [one(part.strip()) for part in text.split(",")]
    return parse


def port(text: str) -> int:
    """A TCP port, 0 (any free one) to 65535."""
    return int(number(0, 65535, integer=True)(text))
