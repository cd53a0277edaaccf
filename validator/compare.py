"""Whether two runs of one session agree, and whom a disagreement blames (pure).

A replay on llama.cpp, on a route or whole in one process, reproduces a route's tokens and
logprobs bit for bit (the split is exact: docs/shard-runtime.md), so its tolerance is tight;
the PyTorch reference differs from llama.cpp's quantized kernels by up to 0.16 nats on the
bundled model and near-ties can flip, so it is compared teacher-forced with a loose one
(docs/validation.md has the measurements).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from schemas.audit import RouteTaken, VerdictOutcome

EXACT_TOLERANCE = 1e-3  # nats: replays on llama.cpp (another route, or the whole model)
TORCH_TOLERANCE = 0.35  # nats: the PyTorch reference (measured max 0.16, near-tie gap 0.26)


def tolerance_for(backend: str) -> float:
    """The |logprob| difference a replay on `backend` may show ("route", "llama.cpp", "torch")."""
    return TORCH_TOLERANCE if backend == "torch" else EXACT_TOLERANCE


@dataclass(frozen=True, slots=True)
class Run:
    """One run's output: ids, the tail's logprob of each, and (a replay's) top alternatives."""

    ids: Sequence[int]
    logprobs: Sequence[float | None]
    top: Sequence[Sequence[tuple[int, float]]] = ()


@dataclass(frozen=True, slots=True)
class Comparison:
    compared: int  # positions compared (both runs reached them)
    first_diff: int | None  # first position whose token or logprob disagrees
    max_logprob_diff: float | None  # over agreeing positions with logprobs on both sides
    tie: bool = False  # the first difference is a near-tie the replay also saw
    why: str = ""

    @property
    def outcome(self) -> VerdictOutcome:
        if self.compared == 0:
            return "inconclusive"
        if self.first_diff is None:
            return "pass"
        return "inconclusive" if self.tie else "fail"


def compare_runs(original: Run, replay: Run, tolerance: float) -> Comparison:
    """Compare position by position until the first token or logprob difference.

    A token difference is a near-tie (inconclusive, not a failure) when the replay's own
    alternatives (when the session asked for top_logprobs) show the original's token within
    `tolerance` of the one it chose."""
    n_orig, n = len(original.ids), min(len(original.ids), len(replay.ids))
    worst: float | None = None
    for i in range(n):
        lo, lr = original.logprobs[i] if i < len(original.logprobs) else None, \
            replay.logprobs[i] if i < len(replay.logprobs) else None
        if original.ids[i] != replay.ids[i]:
            alts = dict(replay.top[i]) if i < len(replay.top) else {}
            tie = lr is not None and original.ids[i] in alts and abs(alts[original.ids[i]] - lr) <= tolerance
            return Comparison(i + 1, i, worst, tie=tie,
                              why=f"token {i}: {original.ids[i]} vs {replay.ids[i]}" + (" (a near-tie)" if tie else ""))
        if lo is not None and lr is not None:
            d = abs(lo - lr)
            if d > tolerance:
                return Comparison(i + 1, i, worst, why=f"token {i}: logprob {lo:.5f} vs {lr:.5f} (|d| {d:.2e} > {tolerance:g})")
            worst = d if worst is None else max(worst, d)
    if n < n_orig:
        return Comparison(n, n, worst, why=f"the replay stopped after {n} of {n_orig} tokens")
    return Comparison(n, None, worst, why=f"{n} tokens equal" + (f", logprobs within {worst:.1e}" if worst is not None else ""))


@dataclass(frozen=True, slots=True)
class ForcedStep:
    """The reference's view of one original token, fed teacher-forced."""

    logprob: float  # the reference's logprob of the original's token
    best_logprob: float  # the reference's best token's logprob at that position


def score_forced(original: Run, steps: Sequence[ForcedStep], *, greedy: bool, tolerance: float) -> Comparison:
    """Judge a run against a reference fed its own tokens: each token's logprob must be the
    reference's within `tolerance`, and a greedy run's token must be the reference's best
    (or within `tolerance` of it: a near-tie either way is no evidence)."""
    worst: float | None = None
    for i, step in enumerate(steps):
        lo = original.logprobs[i] if i < len(original.logprobs) else None
        gap = step.best_logprob - step.logprob
        if greedy and gap > tolerance:
            return Comparison(i + 1, i, worst, why=f"token {i}: greedy chose one {gap:.3f} nats below the reference's best")
        if lo is not None:
            d = abs(lo - step.logprob)
            if d > tolerance:
                return Comparison(i + 1, i, worst, why=f"token {i}: logprob {lo:.5f} vs reference {step.logprob:.5f} "
                                                         f"(|d| {d:.2e} > {tolerance:g})")
            worst = d if worst is None else max(worst, d)
    return Comparison(len(steps), None, worst, why=f"{len(steps)} tokens consistent with the reference"
                                                   + (f", logprobs within {worst:.1e}" if worst is not None else ""))


def route_nodes(routes: Sequence[RouteTaken]) -> list[str]:
    """Every node of every route, in order of first appearance."""
    seen: dict[str, None] = {}
    for r in routes:
        for h in r.hops:
            seen.setdefault(h.node_id, None)
    return list(seen)


def routes_profile(routes: Sequence[RouteTaken]) -> str | None:
    """The one KV profile every hop of these routes ran (schemas/capability.py KvProfile), or
    None when they mixed profiles (pure). Profiles compute attention differently, so a run is
    reproduced bit for bit only by hops of its own profile."""
    profiles = {h.kv_profile for r in routes for h in r.hops}
    return profiles.pop() if len(profiles) == 1 else None


def rebuilt_exactly(restart_replay: str, routes: Sequence[RouteTaken]) -> bool:
    """Whether a session's later routes rebuilt its tokens with the bits of the steps that made
    them (pure): one route (nothing rebuilt), a stepwise replay (`decode`), or a batch on hops
    that all ran the exact KV profile, where a call of several rows gives each row a single
    step's bits (docs/shard-runtime.md, "KV profiles")."""
    return len(routes) <= 1 or restart_replay == "decode" or routes_profile(routes) == "exact"


def comparable(original: str | None, replay: str | None, backend: str) -> bool:
    """Whether a replay of `replay`'s profile can judge a run of `original`'s (pure): the same
    profile, or the PyTorch reference, whose tolerance is far wider than the profiles' gap."""
    return backend == "torch" or (original is not None and original == replay)


@dataclass(frozen=True, slots=True)
class Blame:
    implicated: list[str] = field(default_factory=list)
    cleared: list[str] = field(default_factory=list)


def merge(*blames: Blame) -> Blame:
    """Several judgements of one session's runs together (a node in both lists stays implicated)."""
    implicated = list(dict.fromkeys(n for b in blames for n in b.implicated))
    cleared = [n for n in dict.fromkeys(n for b in blames for n in b.cleared) if n not in implicated]
    return Blame(implicated, cleared)
