"""How long a node reported lost stays out of new routes (tracker/suspicion.py, pure)."""

from __future__ import annotations

import pytest

from tracker.suspicion import HOLD_S, STRIKE_MEMORY_S, Suspicion, clears, reported


def test_a_first_report_clears_at_the_nodes_next_word() -> None:
    s = reported(None, 100.0, still_out=False)
    assert s == Suspicion(100.0, 1) and s.hold_s == 0.0
    assert not clears(s, 99.9) and not clears(s, 100.0) and clears(s, 100.1)


def test_reports_while_out_are_one_loss() -> None:
    """Eight sessions through one lost node report it eight times: still one strike."""
    s = reported(None, 100.0, still_out=False)
    for i in range(8):
        s = reported(s, 100.0 + i / 10, still_out=True)
    assert s.strikes == 1 and s.reported_at == pytest.approx(100.7)


@pytest.mark.parametrize("strikes", range(1, len(HOLD_S) + 3))
def test_each_loss_after_coming_back_holds_it_out_longer(strikes: int) -> None:
    s, at = None, 0.0
    for _ in range(strikes):
        at += (s.hold_s if s else 0.0) + 1.0  # it came back, then was lost again
        s = reported(s, at, still_out=False)
    assert s is not None and s.strikes == strikes
    assert s.hold_s == HOLD_S[min(strikes, len(HOLD_S)) - 1]
    assert not clears(s, at + s.hold_s) and clears(s, at + s.hold_s + 0.01)


def test_strikes_are_forgotten_after_a_quiet_while() -> None:
    s = reported(reported(None, 0.0, still_out=False), 5.0, still_out=False)
    assert s.strikes == 2
    assert reported(s, 5.0 + STRIKE_MEMORY_S, still_out=False) == Suspicion(5.0 + STRIKE_MEMORY_S, 1)
