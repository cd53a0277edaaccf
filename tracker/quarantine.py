"""Which nodes the validators' verdicts implicate (pure): the quarantine decision.

A failing verdict implicates every node of the route that produced the first bad token (a
reference cannot see inside a route), and a passing one clears every node it ran. So one
failing verdict never singles out a node: a node is quarantined when, in at least
`min_fails` failing verdicts, every other node implicated with it has been seen computing
correctly in a verdict without it ("the same node in the failing routes, clean on the
others"). A node that only ever ran together with the faulty
one stays in service until some verdict clears it or the evidence changes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

DEFAULT_MIN_FAILS = 2
HISTORY = 512  # verdicts remembered (older evidence ages out)


@dataclass(frozen=True, slots=True)
class VerdictFacts:
    """What the decision needs of one ValidationVerdict."""

    verdict_id: str
    implicated: tuple[str, ...]
    cleared: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class QuarantineDecision:
    node_id: str
    reason: str
    verdict_ids: tuple[str, ...]


def decide(verdicts: Sequence[VerdictFacts], *, min_fails: int = DEFAULT_MIN_FAILS,
           already: Iterable[str] = ()) -> list[QuarantineDecision]:
    """Nodes to quarantine now, given the verdicts remembered (those in `already` excluded).

    For a suspect X, another node Y of a failing verdict counts as clean only when a passing
    verdict without X cleared it (a pass shared with X says nothing about which of them is
    wrong when they later fail together). Verdicts that implicate a node already quarantined
    are explained by it and single out nobody else. Replays on llama.cpp are bit-exact, so an
    honest node fails none: `min_fails` such verdicts are enough, however often X passed."""
    out_already = set(already)
    live = [v for v in verdicts if not out_already & set(v.implicated)]
    decided: list[QuarantineDecision] = []
    for node in sorted({n for v in live for n in v.implicated}):
        cleared_without = {n for v in verdicts if v.cleared and node not in v.cleared for n in v.cleared}
        singled = [v for v in live if node in v.implicated
                   and all(other in cleared_without for other in v.implicated if other != node)]
        if len(singled) >= min_fails:
            ids = tuple(v.verdict_id for v in singled)
            decided.append(QuarantineDecision(node, (
                f"implicated by {len(singled)} failing replay verdict(s) in which every other node of "
                f"the route was seen correct without it"), ids))
    return decided


def standing(stored: Iterable[tuple[int, VerdictFacts]], lifted: Mapping[str, int]) -> list[VerdictFacts]:
    """The stored verdicts, (audit stream sequence, facts) oldest first, that still count: a
    lift of node X up to sequence S drops every verdict at or before S that implicates X, as
    VerdictBook.forget did when the lift happened."""
    return [f for seq, f in stored if not any(seq <= lifted.get(n, 0) for n in f.implicated)]


class VerdictBook:
    """The verdicts a tracker remembers, oldest dropped first."""

    def __init__(self, history: int = HISTORY) -> None:
        self._verdicts: deque[VerdictFacts] = deque(maxlen=history)
        self._seen: set[str] = set()

    def add(self, facts: VerdictFacts) -> bool:
        """Remember a verdict (False if it was already seen: a redelivery changes nothing)."""
        if facts.verdict_id in self._seen:
            return False
        if len(self._verdicts) == self._verdicts.maxlen:
            self._seen.discard(self._verdicts[0].verdict_id)
        self._verdicts.append(facts)
        self._seen.add(facts.verdict_id)
        return True

    def forget(self, node_id: str) -> None:
        """Drop the evidence against a node (an operator lifted its quarantine): every failing
        verdict that implicated it goes, so it cannot be pinned on that route's other nodes."""
        kept = [v for v in self._verdicts if node_id not in v.implicated]
        self._verdicts.clear()
        self._verdicts.extend(kept)

    @property
    def verdicts(self) -> list[VerdictFacts]:
        return list(self._verdicts)
