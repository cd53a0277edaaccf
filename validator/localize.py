"""Whom a failing run blames, from each hop's own computation (pure).

The validator holds, for each hop of the failing route, the rows that hop says it received and
sent (its Hop Evidence), and recomputes the hop's layer range from those inputs
(validator/hop_check.py). Each hop is then:
- right: its outputs are what its layers give for its inputs (a tail: its tokens' logprobs);
- wrong: they are not, beyond the tolerance;
- unproven: it kept no evidence (it restarted, dropped the rows, or never answered).
Each seam is checked too: what one hop says it sent must be what the next says it received.

A failure then implicates exactly the wrong hops, and both ends of a seam where the two accounts
disagree (nothing says which of them lies). Only if neither explains the failure does a hop
without evidence carry it, and only when it is the one such hop: every other hop showed its work
was right, so the wrong rows came from it. Two or more unproven hops blame nobody. Passing verdicts clear nobody for later: trust is never inherited, whether from an earlier
verdict or by a restarted node under the same id.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from validator.compare import Blame

# The largest relative RMS difference, per position, between a hop's rows and their recomputation
# from its own inputs: llama.cpp computes a row alike whichever batch it ran in, so an honest hop
# shows ~0 (docs/validation.md has the measurements).
ROW_TOLERANCE = 1e-3
# ...and between the two accounts of one seam: the wire may carry rows as f16 or bf16 (rounding
# of up to ~2e-3 relative RMS).
SEAM_TOLERANCE = 5e-3

HopStatus = Literal["right", "wrong", "unproven"]


@dataclass(frozen=True, slots=True)
class HopCheck:
    node_id: str
    hop_index: int
    status: HopStatus
    detail: str = ""


@dataclass(frozen=True, slots=True)
class SeamCheck:
    sender: str
    receiver: str
    agrees: bool | None  # None: one side kept no rows
    detail: str = ""


def row_errors(rows: np.ndarray, expected: np.ndarray) -> np.ndarray:
    """Per position, the RMS of `rows - expected` over the RMS of `expected` (pure)."""
    a = np.asarray(rows, dtype=np.float64)
    b = np.asarray(expected, dtype=np.float64)
    diff = np.sqrt(np.mean(np.square(a - b), axis=1))
    scale = np.sqrt(np.mean(np.square(b), axis=1))
    return diff / np.maximum(scale, 1e-12)


def first_beyond(errors: np.ndarray, tolerance: float) -> int | None:
    """The first position whose error exceeds `tolerance` (NaN counts as beyond), or None."""
    bad = np.flatnonzero(~(errors <= tolerance))
    return int(bad[0]) if len(bad) else None


def localize(hops: Sequence[HopCheck], seams: Sequence[SeamCheck]) -> tuple[Blame, str]:
    """The nodes a failing run's own evidence blames, the nodes it shows right, and why."""
    wrong = [h.node_id for h in hops if h.status == "wrong"]
    split = [n for s in seams if s.agrees is False for n in (s.sender, s.receiver)]
    implicated = list(dict.fromkeys([*wrong, *split]))
    unproven = [h.node_id for h in hops if h.status == "unproven"]
    if implicated:
        why = "; ".join([*(f"{h.node_id} computed wrong rows ({h.detail})" for h in hops if h.status == "wrong"),
                         *(f"{s.sender} and {s.receiver} disagree on what crossed their seam ({s.detail})"
                           for s in seams if s.agrees is False)])
    elif len(unproven) == 1:
        implicated = unproven
        why = (f"every other hop proved its rows right, and {unproven[0]} kept no evidence "
               f"({'; '.join(h.detail for h in hops if h.status == 'unproven')})")
    elif unproven:
        why = f"{', '.join(unproven)} kept no evidence, and nothing says which of them is wrong"
    else:
        why = "every hop's rows are right for its inputs: the failure is not any node's computation"
    cleared = [h.node_id for h in hops if h.status == "right" and h.node_id not in implicated]
    return Blame(implicated=implicated, cleared=list(dict.fromkeys(cleared))), why
