"""Speculative decoding across the route: the head drafts, every hop runs the drafts as rows, the
tail keeps the longest prefix the target model agrees with.

Pure decisions, no I/O:
- `lookup_draft`: the default drafter, prompt lookup. It matches the last few tokens of the
  session against its own earlier tokens (prompt and output) and proposes what followed there.
- `Verifier`: the tail's check of one verify step, row by row, with the session's own token
  choice. A draft is kept when the token the target chooses at its position equals it; the first
  choice that differs is the step's extra token. Since the choice at a position is the one the
  session would make without speculation (a seeded draw is keyed by position, an unseeded one
  consumes the session's generator once per token as before, penalties and output constraints
  see exactly the tokens chosen), the tokens are those of plain decoding, sampled or greedy.
  For a deterministic draft d this is the speculative-sampling rule: d is kept with probability
  p(d), and otherwise the token comes from p without d, renormalised.
- `draft_length`: how many tokens to draft, from the measured acceptance and what a trip and a
  row cost; 0 turns speculation off where it does not pay.
- `guess_pays` and `guess_holds`: pipelined verify steps. The head may send the next step before
  the current one is answered, guessing that every draft in flight is kept and that the step's
  own token is the one the drafter proposes next; the tail voids a step whose guess was wrong.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from nodes.engine import TokenChoice

LOOKUP_NGRAM = (4, 3, 2, 1)  # suffix lengths prompt lookup tries, longest first
# the most tokens a match of n tokens proposes: a short match is often a coincidence, and each
# wrong draft costs a row on every hop (docs/benchmarks.md, "Prompt lookup after an edit")
LOOKUP_REACH = {1: 2, 2: 4}
ACCEPTANCE_PRIOR = 0.6  # a session's assumed acceptance before it has measured its own
ACCEPTANCE_WEIGHT = 0.3  # weight of the newest verify step in the running acceptance
PROBE_DRAFT = 2  # drafts of a run's first step, before it has measured any cost
ROW_COST_PRIOR = 0.5  # a drafted row's compute against a plain step's, before it is measured
ACCEPTANCE_RECOVERY = 0.05  # per plain step, how far the acceptance moves back to the prior
GUESS_ODDS = 0.4  # the least chance that a pipelined step holds for the head to send it


def lookup_draft(history: Sequence[int], k: int, ngrams: Sequence[int] = LOOKUP_NGRAM) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the history's last n
    tokens (the longest n of `ngrams` that occurs; a match of n proposes at most
    LOOKUP_REACH[n]); [] when nothing matches. After the answer departs from what it copies
    (an edit, a changed word) the one-token match finds the copy again a step sooner."""
    if k <= 0:
        return []
    n_hist = len(history)
    arr = np.asarray(history, dtype=np.int64)
    for n in ngrams:
        if n_hist <= n:
            continue
        tail = arr[n_hist - n:]
        # every start i < n_hist - n where arr[i:i+n] == tail; the latest one proposes
        hits = np.flatnonzero(arr[:n_hist - n] == tail[0])
        reach = min(k, LOOKUP_REACH.get(n, k))
        for i in hits[::-1]:
            if i + n < n_hist and np.array_equal(arr[i:i + n], tail):
                return [int(t) for t in arr[i + n:min(i + n + reach, n_hist)]]
    return []


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens one verify step of k drafts yields on average (each draft kept with probability
    `acceptance` while all before it were; plus the step's own token)."""
    a = min(max(acceptance, 0.0), 0.999)
    return (1 - a ** (k + 1)) / (1 - a)


def draft_length(acceptance: float, trip_s: float, row_s: float, k_max: int) -> int:
    """The draft length that makes the most tokens per second: a plain step takes `trip_s`
    (the route's latency and one row's compute on every hop), a step of k drafts k more rows
    (`row_s` each: the marginal compute of a row in the same call, summed over the hops); 0
    when no draft beats plain decoding by a clear margin (a draft also costs batch rows)."""
    best, best_rate = 0, 1.0 / max(trip_s, 1e-6)
    for k in range(1, k_max + 1):
        rate = expected_tokens(acceptance, k) / max(trip_s + k * row_s, 1e-6)
        if rate > best_rate * 1.02:
            best, best_rate = k, rate
    return best


def guess_pays(acceptance: float, in_flight: Sequence[int], streak: int = 0, draft_s: float = 0.0,
               latency_s: float = 1.0) -> bool:
    """Whether to send a verify step built on the steps in flight (`in_flight`: each one's
    draft count): it holds only if each of them keeps every draft and ends with the token the
    drafter guessed, k + 1 agreements per step at `acceptance` each. A step that does not hold
    is voided at the tail, unrun; only the hops before it spent its rows. Right after a step
    that kept all its drafts (`streak` of them in a row) one step goes ahead whatever the
    running acceptance says: a copy keeps being copied, and the average catches up slowly.
    Never where guessing the step's token (`draft_s`, a draft model's call) takes longer than
    the trip (`latency_s`) it would hide."""
    if draft_s > latency_s:
        return False
    if streak >= 1 and len(in_flight) == 1:
        return True
    odds = 1.0
    for k in in_flight:
        odds *= min(max(acceptance, 0.0), 1.0) ** (k + 1)
    return odds >= GUESS_ODDS


def guess_holds(drafts: Sequence[int], kept: int, token: int, guess: int) -> bool:
    """Whether the step after an answered verify step (its `drafts`, `kept` of them kept, then
    `token`) was guessed right: the tail runs it exactly then, and voids it otherwise."""
    return kept == len(drafts) and token == guess


def updated_acceptance(acceptance: float, drafted: int, accepted: int) -> float:
    """The running acceptance after a verify step kept `accepted` of `drafted` drafts."""
    if drafted <= 0:
        return acceptance
    # a step that kept every draft says the rate is at least that high; one rejection ends the
    # step, so count the rejected draft and not the ones after it
    seen = min(drafted, accepted + 1)
    return (1 - ACCEPTANCE_WEIGHT) * acceptance + ACCEPTANCE_WEIGHT * (accepted / seen)


@dataclass(slots=True)
class DraftState:
    """One Decode Run's speculation on the head: acceptance and costs as it measured them.

    A step of k drafts costs latency + c1 + k x (m + d): `latency` is the route's trip time
    without compute, `c1` one row's compute on every hop, `m` one more row's compute in the
    same call (less than c1: a row shares the call's weight reads), `d` the drafter's time per
    drafted token (about 0 for prompt lookup, a model call for a draft model); m starts as
    ROW_COST_PRIOR x c1 until a verify step measures it."""

    k_max: int
    acceptance: float = ACCEPTANCE_PRIOR
    latency_s: float = -1.0  # -1: nothing measured yet
    c1_s: float = 0.0
    m_s: float = -1.0  # -1: no verify step yet
    d_s: float = 0.0  # drafting time per drafted token
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    streak: int = 0  # the last steps in a row that kept every draft (and drafted some)
    catching_up: bool = True  # no drafted step measured yet: its drafting also read the prompt

    def length(self, remaining: int, sharing: int = 1) -> int:
        """Drafts for the next step when `remaining` tokens are still wanted and `sharing`
        sessions decode on the hop: each drafted row lengthens the model call they all share,
        and a draft model's steps take the head's cores from them all, so a draft costs the
        hop's throughput `sharing` times its own time (drafting pays under load only where the
        network, not compute, bounds the step)."""
        k = min(self.k_max, remaining - 1)
        if k <= 0:
            return 0
        if self.latency_s < 0:
            return min(k, PROBE_DRAFT) if sharing <= 1 else 0  # nothing measured yet: a short try, when alone
        m = self.m_s if self.m_s >= 0 else ROW_COST_PRIOR * self.c1_s
        return draft_length(self.acceptance, self.latency_s + self.c1_s, (m + self.d_s) * max(1, sharing), k)

    def kept(self, drafted: int, accepted: int) -> None:
        """Book one step of 1 + `drafted` rows that kept `accepted` drafts."""
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted
        if drafted:
            self.streak = self.streak + 1 if accepted == drafted else 0
            self.acceptance = updated_acceptance(self.acceptance, drafted, accepted)
        else:  # no draft: the estimate drifts back up, so a run that stopped drafting tries again
            self.acceptance += ACCEPTANCE_RECOVERY * (ACCEPTANCE_PRIOR - self.acceptance)

    def measured(self, drafted: int, accepted: int, trip_s: float, compute_s: float,
                 draft_s: float = 0.0) -> None:
        """Book one step (kept) and its costs: its trip (sent to answered), the hops' summed
        model time and the time its drafts took to propose. Only a step sent with none ahead of
        it: a pipelined step's trip overlaps the one before. A run's first drafted step does not
        measure the drafting time: a draft model then also catches up on the prompt."""
        self.kept(drafted, accepted)
        self.latency_s = _smooth(self.latency_s, max(trip_s - compute_s, 0.0))
        if not drafted:
            self.c1_s = _smooth(self.c1_s if self.c1_s else -1.0, compute_s)
        elif self.c1_s:
            self.m_s = _smooth(self.m_s, max(compute_s - self.c1_s, 0.0) / drafted)
        if drafted and self.catching_up:
            self.catching_up = False
        elif drafted:
            self.d_s = _smooth(self.d_s if self.d_s else -1.0, draft_s / drafted)


def _smooth(old: float, new: float) -> float:
    """An exponential average (`old` < 0: none yet)."""
    return new if old < 0 else 0.7 * old + 0.3 * new


@dataclass(slots=True)
class Verifier:
    """The tail's check of one verify step: rows 0..k (the step's token, then k drafts) at
    positions p..p+k; row i's logits choose the token at p+i+1, compared with draft i+1."""

    drafts: Sequence[int]
    choose: Callable[[np.ndarray, int], TokenChoice]  # (logits, position of the chosen token)
    start: int  # p + 1: the position row 0's choice takes
    chosen: list[TokenChoice] = field(default_factory=list)
    done: bool = False

    def row(self, i: int, logits: np.ndarray) -> None:
        """Row i's logits, in row order; rows after the first disagreement are ignored."""
        if self.done or i != len(self.chosen):
            return
        c = self.choose(logits, self.start + i)
        self.chosen.append(c)
        if i >= len(self.drafts) or c.token_id != self.drafts[i]:
            self.done = True

    @property
    def accepted(self) -> list[TokenChoice]:
        """The kept drafts (as chosen, with their logprobs)."""
        return self.chosen[:-1]

    @property
    def token(self) -> TokenChoice:
        """The step's own token: the first choice that is no kept draft."""
        return self.chosen[-1]
