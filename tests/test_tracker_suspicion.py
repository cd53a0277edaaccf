"""How long a node reported lost stays out of new routes (tracker/suspicion.py, pure)."""

from __future__ import annotations

import pytest

from tracker.suspicion import CONFIRM_S, HOLD_S, STRIKE_MEMORY_S, Suspicion, clears, heard, reported


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


def test_messages_held_by_the_bus_do_not_bring_a_dead_node_back() -> None:
    """nats-server frozen: the node's last heartbeats, sent before it was SIGKILLed, reach the
    tracker in one burst with the gateway's report (before: the first one cleared it, and the
    dead node took new routes until it expired 3 s later)."""
    s = reported(None, 100.0, still_out=False, started_at=50.0)
    for at in (100.01, 100.02, 100.03):  # the held heartbeats, all of the dead process
        after = heard(s, at, 50.0)
        assert after is not None
        s = after
    assert heard(s, 100.01 + CONFIRM_S, 50.0) is None  # a live node's next heartbeat, a second later


def test_a_restarted_process_is_back_at_its_first_word() -> None:
    s = reported(None, 100.0, still_out=False, started_at=50.0)
    assert heard(s, 100.1, 99.0) is None  # a newer process: nothing it says is stale
    assert heard(s, 99.0, 99.0) is s  # still not before the report
    unknown = reported(None, 100.0, still_out=False)  # the reported process unknown: twice, as any
    assert heard(unknown, 100.1, 99.0) == Suspicion(100.0, 1, 0.0, 100.1)
