"""The pure parts of speculative decoding (nodes/speculation.py) and how the hop scheduler plans
a verify step's rows."""

from __future__ import annotations

import numpy as np
import pytest

from nodes.engine import TokenChoice
from nodes.sampling import choose_token, token_rng
from nodes.server.scheduler import PendingView, plan_batch
from nodes.speculation import (
    DraftState,
    Verifier,
    draft_length,
    expected_tokens,
    guess_holds,
    guess_pays,
    lookup_draft,
)
from schemas.sampling import SamplingParams


@pytest.mark.parametrize("history,k,draft", [
    ([1, 2, 3, 4, 9, 9, 1, 2, 3], 3, [4, 9, 9]),  # "1 2 3" came before, followed by 4 9 9
    ([1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3], 2, [5, 1]),  # the latest occurrence proposes
    ([1, 2, 3, 4, 5, 6, 7, 3], 4, [4, 5]),  # one token matching proposes two at most
    ([1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2], 8, [3, 4, 5, 6]),  # two tokens matching, four at most
    ([1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3], 8, [4, 5, 6, 7, 8, 9, 1, 2]),  # three: as many as asked
    ([1, 2, 3, 4, 5, 6, 7, 8], 4, []),  # nothing occurred before
    ([5, 6, 7, 8, 6, 7], 8, [8, 6, 7]),  # no more than the history has after the match
    ([1, 2, 1, 2], 0, []),
    ([], 3, []),
])
def test_prompt_lookup_proposes_what_followed_the_last_tokens(history: list[int], k: int, draft: list[int]) -> None:
    assert lookup_draft(history, k) == draft


def test_expected_tokens_per_step() -> None:
    assert expected_tokens(0.0, 4) == pytest.approx(1.0)
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert expected_tokens(1.0, 8) == pytest.approx(9.0, rel=0.05)


@pytest.mark.parametrize("acceptance,trip,row,k", [
    (0.9, 0.050, 0.002, 8),  # far hops, cheap rows, good drafts: draft all
    (0.9, 0.010, 0.004, 3),  # near hops: a row costs 0.4 of the trip (4 is not clearly better)
    (0.1, 0.050, 0.002, 1),  # rarely right, but a row costs little against the trip
    (0.02, 0.050, 0.002, 0),  # almost never right: do not draft
    (0.6, 0.020, 0.020, 0),  # each draft costs a trip's worth of compute: it cannot pay
])
def test_draft_length_weighs_acceptance_against_what_rows_cost(acceptance: float, trip: float, row: float,
                                                               k: int) -> None:
    assert draft_length(acceptance, trip, row, 8) == k


def test_a_run_learns_its_costs_and_stops_drafting_where_drafts_fail() -> None:
    s = DraftState(k_max=8)
    assert s.length(remaining=5) == 2  # nothing measured: a short try
    assert s.length(remaining=2) == 1  # within what is left to make
    assert s.length(remaining=1) == 0
    s.measured(0, 0, trip_s=0.060, compute_s=0.010)  # a plain step over far hops
    assert s.latency_s == pytest.approx(0.050) and s.c1_s == pytest.approx(0.010)
    s.measured(4, 4, trip_s=0.064, compute_s=0.014)  # 4 drafts, all kept: 1 ms a row more
    assert s.m_s == pytest.approx(0.001)
    assert s.length(100) == 8
    for _ in range(12):
        s.measured(8, 0, trip_s=0.068, compute_s=0.018)
    assert s.length(100) == 0  # every draft rejected: plain steps
    for _ in range(40):
        s.measured(0, 0, trip_s=0.060, compute_s=0.010)
    assert s.length(100) > 0  # and after a while it tries again


def greedy_row(token: int, vocab: int = 16) -> np.ndarray:
    row = np.zeros(vocab, np.float32)
    row[token] = 5.0
    return row


def test_the_verifier_keeps_drafts_while_the_model_agrees_then_takes_the_models_token() -> None:
    sampling = SamplingParams(temperature=0.0)
    rng = np.random.default_rng(0)
    v = Verifier([3, 4, 5], lambda logits, pos: choose_token(logits, sampling, token_rng(sampling, pos, rng)), 10)
    for i, t in enumerate([3, 4, 9, 5]):  # the model agrees with drafts 3 and 4, then says 9
        v.row(i, greedy_row(t))
    assert [c.token_id for c in v.accepted] == [3, 4] and v.token.token_id == 9


def test_the_verifier_adds_the_models_next_token_after_keeping_every_draft() -> None:
    seen: list[int] = []

    def choose(logits: np.ndarray, position: int) -> TokenChoice:
        seen.append(position)
        return TokenChoice(int(logits.argmax()))

    v = Verifier([3, 4], choose, 20)
    for i, t in enumerate([3, 4, 7]):
        v.row(i, greedy_row(t))
    assert [c.token_id for c in v.accepted] == [3, 4] and v.token.token_id == 7
    assert seen == [20, 21, 22]  # each choice at the position of the token it makes


def test_seeded_sampling_verifies_to_the_tokens_plain_steps_draw() -> None:
    """A seeded draw is keyed by position: the verifier's choice at a position is plain
    decoding's, so a draft is kept exactly when plain decoding would have drawn it."""
    sampling = SamplingParams(temperature=1.0, seed=7)
    rows = [np.random.default_rng(i).standard_normal(16).astype(np.float32) for i in range(5)]
    plain = [choose_token(r, sampling, token_rng(sampling, 30 + i, np.random.default_rng())).token_id
             for i, r in enumerate(rows)]
    drafts = [plain[0], plain[1], (plain[2] + 1) % 16, plain[3]]
    v = Verifier(drafts, lambda logits, pos: choose_token(logits, sampling, token_rng(sampling, pos, np.random.default_rng())), 30)
    for i, r in enumerate(rows):
        v.row(i, r)
    assert [c.token_id for c in v.accepted] == plain[:2] and v.token.token_id == plain[2]


def test_a_verify_step_runs_whole_with_the_decode_rows() -> None:
    pending = [PendingView("a", 1), PendingView("b", 5, whole=True), PendingView("c", 40), PendingView("d", 1)]
    plan = plan_batch(pending, max_rows=16, prefill_rows=64, mixed_prefill_rows=8)
    assert plan[:3] == [(0, 1), (1, 5), (3, 1)]  # decode rows first, the verify step unsplit
    assert plan[3][0] == 2 and plan[3][1] <= 8  # the prompt takes what the mixed bound leaves
    assert sum(n for _, n in plan) <= 16


def test_a_slow_drafter_drafts_less() -> None:
    cheap, slow = DraftState(k_max=8), DraftState(k_max=8)
    for s, draft_s in ((cheap, 0.0), (slow, 0.080)):
        s.measured(0, 0, trip_s=0.060, compute_s=0.010)
        for _ in range(2):  # (the first drafted step's drafting is not timed)
            s.measured(4, 4, trip_s=0.064, compute_s=0.014, draft_s=draft_s)  # 20 ms a draft for `slow`
    assert cheap.length(100) == 8
    assert slow.length(100) < cheap.length(100)


def test_under_load_a_draft_must_pay_for_every_session_it_slows() -> None:
    s = DraftState(k_max=8)
    assert s.length(100, sharing=8) == 0  # nothing measured, and others share the calls: no guess
    s.measured(0, 0, trip_s=0.020, compute_s=0.010)  # near hops: compute bounds the step
    s.measured(4, 3, trip_s=0.040, compute_s=0.030)  # 5 ms a drafted row
    assert s.length(100, sharing=1) > 0
    assert s.length(100, sharing=8) == 0
    far = DraftState(k_max=8)
    far.measured(0, 0, trip_s=0.110, compute_s=0.010)  # far hops: the network bounds it
    far.measured(4, 4, trip_s=0.130, compute_s=0.030)
    assert far.length(100, sharing=8) > 0


def test_a_pipelined_step_goes_only_while_the_steps_in_flight_likely_hold() -> None:
    assert guess_pays(0.97, [8])  # a verbatim copy: 0.97^9 = 0.76
    assert not guess_pays(0.7, [8])  # 0.7^9 = 0.04: the step would be voided
    assert guess_pays(0.9, [2])  # a short step in flight: 0.9^3 = 0.73
    assert not guess_pays(0.9, [2, 8])  # two in flight must both hold: 0.73 x 0.39
    assert guess_pays(1.0, [8, 8, 8])
    assert guess_pays(0.7, [8], streak=1)  # the last step kept every draft: one goes ahead
    assert not guess_pays(0.7, [8, 8], streak=3)  # deeper only by the odds
    assert not guess_pays(1.0, [8], streak=1, draft_s=0.012, latency_s=0.002)  # a draft model on near hops
    assert guess_pays(1.0, [8], streak=1, draft_s=0.012, latency_s=0.050)


def test_a_runs_first_drafted_step_does_not_measure_the_drafting_time() -> None:
    """A draft model's first call of a run also reads the prompt (160 ms here): counted per
    drafted token, it would stop drafting for the rest of the run."""
    plan = DraftState(k_max=8)
    plan.measured(0, 0, trip_s=0.060, compute_s=0.010)  # under load a run's first step drafts nothing
    plan.measured(2, 2, trip_s=0.070, compute_s=0.015, draft_s=0.160)
    assert plan.d_s == 0.0 and plan.length(100) > 0
    plan.measured(4, 4, trip_s=0.080, compute_s=0.025, draft_s=0.040)  # 10 ms a draft
    assert plan.d_s == 0.010 and plan.length(100) > 0


def test_the_streak_counts_steps_in_a_row_that_kept_every_draft() -> None:
    plan = DraftState(8)
    for drafted, accepted, streak in [(4, 4, 1), (8, 8, 2), (0, 0, 2), (8, 5, 0), (2, 2, 1)]:
        plan.kept(drafted, accepted)
        assert plan.streak == streak


def test_a_guess_holds_when_every_draft_is_kept_and_the_token_is_the_guessed_one() -> None:
    assert guess_holds([5, 6, 7], 3, 9, 9)
    assert not guess_holds([5, 6, 7], 2, 9, 9)  # a draft rejected: the next step starts earlier
    assert not guess_holds([5, 6, 7], 3, 8, 9)  # all kept, another token: the same position, another row
    assert guess_holds([], 0, 4, 4)
