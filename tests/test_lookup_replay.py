"""bench/lookup_replay.py's replay: the arithmetic its policy comparisons rest on."""

from __future__ import annotations

from bench.lookup_replay import Replayed, continuations, kept, policies, replay

FLAT = {1: 10.0, 16: 10.0}  # a call costs the same for any number of rows


def test_candidates_come_from_distinct_occurrences_latest_and_longest_first() -> None:
    history = [5, 6, 7, 5, 6, 8, 5, 6]
    assert continuations(history, 8, 4) == [[8, 5, 6], [7, 5, 6, 8]]  # 2-token matches reach 4
    assert continuations(history, 8, 1) == [[8, 5, 6]]
    assert kept([1, 2, 3], [1, 2, 4, 5]) == 2 and kept([], [1]) == 0


def test_a_copy_replays_faster_than_plain_decoding_and_no_draft_replays_at_its_speed() -> None:
    prompt = list(range(10, 40))
    answer = list(range(10, 40))  # the answer copies the prompt
    drafters = policies(8)
    fast = replay(prompt, answer, drafters["lookup"], 50.0, FLAT)
    assert fast > 3  # 8 drafts kept per step after the first tokens
    assert replay(prompt, answer, drafters["oracle-length"], 50.0, FLAT) >= fast
    assert 1 < replay(prompt, answer, drafters["head"], 50.0, FLAT) <= fast  # it learns, then drafts
    assert replay(prompt, answer, lambda rtt, costs: Replayed(lambda history, _: []), 50.0, FLAT) == 1.0
    novel = list(range(100, 130))  # nothing to look up: every step is a plain one
    assert replay(prompt, novel, drafters["tree-4"], 50.0, FLAT) == 1.0
