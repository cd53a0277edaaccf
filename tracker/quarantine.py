"""Which nodes the validators' verdicts implicate (pure): the quarantine decision.

A verdict implicates only nodes whose own computation it showed wrong: the validator checks each
hop of a failing route on the rows it received and sent (validator/localize.py). So the rule is
plain: a node is quarantined once `min_fails` remembered failing verdicts implicate it. Passing
verdicts clear nobody for later (a node that is right most of the time and wrong sometimes is
still caught), and nothing is inherited: a node restarted under the same id starts with exactly
the evidence against it, never with trust. Verdicts whose blame rests on a whole route (stored
before blame came from evidence) implicate nobody.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

DEFAULT_MIN_FAILS = 2
HISTORY = 512  # verdicts remembered (older evidence ages out)


@dataclass(frozen=True, slots=True)
class VerdictFacts:
    """What the decision needs of one ValidationVerdict: the nodes its evidence blames."""

    verdict_id: str
    implicated: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class QuarantineDecision:
    node_id: str
    reason: str
    verdict_ids: tuple[str, ...]


def decide(verdicts: Sequence[VerdictFacts], *, min_fails: int = DEFAULT_MIN_FAILS,
           already: Iterable[str] = ()) -> list[QuarantineDecision]:
    """Nodes to quarantine now (those in `already` excluded): every node that `min_fails` of the
    remembered verdicts implicate."""
    out_already = set(already)
    decided: list[QuarantineDecision] = []
    for node in sorted({n for v in verdicts for n in v.implicated} - out_already):
        against = [v.verdict_id for v in verdicts if node in v.implicated]
        if len(against) >= min_fails:
            decided.append(QuarantineDecision(node, (
                f"{len(against)} failing replay verdict(s) found its own rows wrong"), tuple(against)))
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
