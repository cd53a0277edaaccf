"""When a Decode Run's tokens are written: the pure flush rule and the held-token buffer."""

from __future__ import annotations

from nodes.server.run_flush import HeldTokens, flush_due


def test_flush_due_without_an_interval_or_before_the_first_write() -> None:
    assert flush_due(5.0, None, 0.05)
    assert flush_due(5.0, 4.999, 0.0)
    assert not flush_due(5.0, 4.99, 0.05)
    assert flush_due(5.06, 5.0, 0.05)


def test_held_tokens_go_out_first_at_once_then_together_per_interval() -> None:
    now = [0.0]
    held = HeldTokens(0.05, clock=lambda: now[0])
    assert held.add(b"t1") == [b"t1"]  # the first token is never held
    now[0] = 0.02
    assert held.add(b"t2") == [] and held.pending == 1
    now[0] = 0.04
    assert held.add(b"t3") == [] and held.pending == 2
    now[0] = 0.06
    assert held.add(b"t4") == [b"t2", b"t3", b"t4"] and held.pending == 0
    now[0] = 0.07
    assert held.add(b"t5") == []
    assert held.take() == [b"t5"] and held.take() == []  # the run's end takes what is left


def test_no_interval_writes_every_token() -> None:
    held = HeldTokens(0.0, clock=lambda: 1.0)
    assert [held.add(b"%d" % i) for i in range(3)] == [[b"0"], [b"1"], [b"2"]]
