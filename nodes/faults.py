"""Test-only faults a node can be started with (`meshnet node --fault perturb=0.01`).

A perturbing node adds Gaussian noise to every hidden row it sends on: each element gets
N(0, (sigma * rms(row))^2). It computes everything else honestly, so only replay validation
can tell it from a good node (tests/test_validation.py). `perturb=0.01,every=3` perturbs only
every third session it serves: a node that is right most of the time. Refused unless MESHNET_TESTING=1: no
operator can start a wrong node by accident.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from nodes.engine import BatchPart, EngineError, PartResult, ShardEngine, ShardOutput

TESTING_ENV = "MESHNET_TESTING"
FAULT_KINDS = ("perturb",)


class FaultError(ValueError):
    """A --fault value that is malformed or not allowed here."""


@dataclass(frozen=True, slots=True)
class Fault:
    kind: str
    sigma: float
    every: int = 1  # perturb one session in this many (the every-th, 2 every-th, ...)


def parse_fault(raw: str, env: dict[str, str] | None = None) -> Fault:
    """`perturb=SIGMA[,every=N]` -> Fault, only when MESHNET_TESTING=1 (pure but for `env`)."""
    env = dict(os.environ) if env is None else env
    if env.get(TESTING_ENV) != "1":
        raise FaultError(f"--fault is for tests only: set {TESTING_ENV}=1 to use it")
    raw, _, rest = raw.partition(",")
    every = 1
    if rest:
        key, _, n = rest.partition("=")
        if key != "every" or not n.isdigit() or int(n) < 1:
            raise FaultError(f"--fault takes ',every=N' (N >= 1) after the kind, got {rest!r}")
        every = int(n)
    kind, sep, value = raw.partition("=")
    if kind not in FAULT_KINDS or not sep:
        raise FaultError(f"--fault must be one of {', '.join(k + '=SIGMA' for k in FAULT_KINDS)}, got {raw!r}")
    try:
        sigma = float(value)
    except ValueError:
        raise FaultError(f"--fault {kind}= needs a number, got {value!r}") from None
    if not 0.0 < sigma <= 10.0:
        raise FaultError(f"--fault {kind}= must be in (0, 10], got {sigma:g}")
    return Fault(kind, sigma, every)


def perturb_rows(rows: np.ndarray, sigma: float, rng: np.random.Generator) -> np.ndarray:
    """`rows` [n, d] plus noise of sigma times each row's RMS (pure but for `rng`)."""
    x = rows.astype(np.float32, copy=False)
    rms = np.sqrt(np.mean(np.square(x, dtype=np.float64), axis=1, keepdims=True))
    return (x + rng.standard_normal(x.shape) * (sigma * rms)).astype(np.float32)


class PerturbingEngine:
    """A ShardEngine whose hidden outputs are perturbed; everything else is the wrapped engine's."""

    def __init__(self, inner: ShardEngine, sigma: float, seed: int = 0, every: int = 1) -> None:
        if inner.layers.is_tail:
            raise FaultError("perturb adds noise to the hidden rows a node sends on; a tail shard sends none")
        self.inner = inner
        self.sigma = sigma
        self.every = every
        self._rng = np.random.default_rng(seed)
        self._order: dict[str, int] = {}  # session -> the how-many-th it was (bounded: test runs are short)

    def _perturbs(self, session_id: str) -> bool:
        if session_id not in self._order:
            if len(self._order) >= 100_000:
                self._order.clear()
            self._order[session_id] = len(self._order) + 1
        return self._order[session_id] % self.every == 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def forward_batch(self, parts: Sequence[BatchPart]) -> list[PartResult]:
        out: list[PartResult] = []
        for part, r in zip(parts, self.inner.forward_batch(parts), strict=True):
            if not isinstance(r, EngineError) and r.hidden is not None and self._perturbs(part.session_id):
                r = ShardOutput(hidden=perturb_rows(r.hidden, self.sigma, self._rng), token=r.token, logits=r.logits,
                                reused=r.reused)
            out.append(r)
        return out


def with_fault(engine: ShardEngine, fault: Fault | None) -> ShardEngine:
    """The engine a node serves with: itself, or wrapped by its test fault."""
    if fault is None:
        return engine
    return PerturbingEngine(engine, fault.sigma, every=fault.every)  # type: ignore[return-value]
