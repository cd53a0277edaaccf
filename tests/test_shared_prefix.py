"""Shared prefixes: a session that starts with rows another open session holds reuses that
session's KV on the hop, and gets bit-identical logits, tokens and hidden rows."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from gateway.tokenizer import ModelTokenizer
from nodes.llama_engine import LlamaShardEngine
from nodes.shared_prefix import MIN_COMPUTED, MIN_REUSE, PrefixMatch, SharedPrefixIndex
from tests.fixtures.model import TEST_N_CTX, TEST_THREADS

# --- the index alone (no model) -----------------------------------------------------------


def rows(*values: int) -> np.ndarray:
    return np.asarray(values, dtype=np.int32)


def test_match_finds_the_longest_held_prefix_and_leaves_rows_to_compute() -> None:
    idx = SharedPrefixIndex(max_rows=64)
    a = np.arange(20, dtype=np.int32)
    idx.extend("a", 0, a, None)
    b = np.concatenate([a[:12], rows(99, 98, 97)])
    assert idx.match(b) == PrefixMatch("a", 12)
    # the same rows again: all but MIN_COMPUTED reused
    assert idx.match(a) == PrefixMatch("a", len(a) - MIN_COMPUTED)
    # shorter than MIN_REUSE shared: nothing
    assert idx.match(np.concatenate([a[:MIN_REUSE - 1], rows(99, 98, 97)])) is None
    assert idx.match(rows(5, *range(1, 20))) is None


def test_only_batched_parts_that_continue_the_held_rows_are_indexed() -> None:
    idx = SharedPrefixIndex(max_rows=64)
    a = np.arange(30, dtype=np.int32)
    idx.extend("a", 0, a[:10], None)
    idx.extend("a", 10, a[10:11], None)  # a one-row part (a decode step): not indexed
    idx.extend("a", 11, a[11:30], None)  # no longer continues what is held
    assert idx.held_rows("a") == 10
    idx2 = SharedPrefixIndex(max_rows=16)
    idx2.extend("b", 0, a[:10], None)
    idx2.extend("b", 10, a[10:30], None)
    assert idx2.held_rows("b") == 16  # at most max_rows


def test_cut_rename_and_drop_take_rows_out_of_the_index() -> None:
    idx = SharedPrefixIndex(max_rows=64)
    a = np.arange(30, dtype=np.int32)
    idx.extend("a", 0, a, None)
    idx.cut("a", 9)
    assert idx.match(a) == PrefixMatch("a", 9)
    idx.rename("a", "a-e2")
    assert idx.match(a) == PrefixMatch("a-e2", 9)
    idx.drop("a-e2")
    assert idx.match(a) is None


def test_reused_rows_carry_their_outputs_and_can_be_reused_again() -> None:
    idx = SharedPrefixIndex(max_rows=32, hidden_size=3)
    a = np.arange(20, dtype=np.int32)
    out = np.arange(60, dtype=np.float32).reshape(20, 3)
    idx.extend("a", 0, a, out)
    found = idx.match(a[:16])
    assert found == PrefixMatch("a", 14)
    idx.reused("b", found)
    idx.extend("b", 0, a[:16], out[:16])  # the part that reused them: its computed rows count too
    assert idx.held_rows("b") == 16
    idx.drop("a")  # b holds them now
    assert idx.match(a[:18]) == PrefixMatch("b", 16)
    np.testing.assert_array_equal(idx.outputs("b", 16), out[:16])
    assert (idx.hits, idx.rows_reused) == (1, 14)


def test_off_matches_nothing() -> None:
    idx = SharedPrefixIndex(max_rows=0)
    idx.extend("a", 0, np.arange(20, dtype=np.int32), None)
    assert not idx.enabled and idx.match(np.arange(20, dtype=np.int32)) is None


# --- the llama.cpp engine on the real model -----------------------------------------------

PROFILES = ("default", "exact")


@pytest.fixture(scope="module")
def prompts(model_path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Two chat prompts that share the template's opening (29 tokens)."""
    tok = ModelTokenizer(model_path)
    a = tok.encode_chat([{"role": "user", "content": "Write a long story about a lighthouse."}])
    b = tok.encode_chat([{"role": "user", "content": "Write a long story about a violin maker."}])
    return np.asarray(a, dtype=np.int32), np.asarray(b, dtype=np.int32)


@pytest.fixture
def engines(model_path: Path, shard_cache: Path) -> Iterator[dict[tuple[str, int, int, bool], LlamaShardEngine]]:
    """Engines loaded for this test alone (closed sessions leave retained prefixes behind)."""
    loaded: dict[tuple[str, int, int, bool], LlamaShardEngine] = {}

    def get(profile: str, start: int, end: int, reuse: bool) -> LlamaShardEngine:
        key = (profile, start, end, reuse)
        if key not in loaded:
            loaded[key] = LlamaShardEngine(model_path, start, end, n_ctx=TEST_N_CTX, max_sessions=4,
                                           n_threads=TEST_THREADS, kv_profile=profile, measure=False,
                                           prefix_rows=256 if reuse else 0)
        return loaded[key]

    yield get  # type: ignore[misc]
    for e in loaded.values():
        e.close()


def shared(a: np.ndarray, b: np.ndarray) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def close_sessions(*engines: LlamaShardEngine) -> None:
    for e in engines:
        for sid in e.sessions():
            e.close_session(sid)


def greedy(engine: LlamaShardEngine, sid: str, ids: np.ndarray, steps: int) -> list[np.ndarray]:
    """Prefill `ids` in a fresh session, then `steps` greedy decode steps: every logits row."""
    engine.open_session(sid)
    out = engine.forward(sid, 0, token_ids=ids, want_logits=True)
    got = [out.logits]
    for k in range(steps):
        out = engine.forward(sid, len(ids) + k, token_ids=np.asarray([out.token.token_id], np.int32),
                             want_logits=True)
        got.append(out.logits)
    return got


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("case", ["other prompt", "same prompt", "two rows to compute"])
def test_a_reused_prefix_gives_the_same_logits_bit_for_bit(engines, prompts, profile, case) -> None:
    a, b = prompts
    if case == "same prompt":
        b = a.copy()
    elif case == "two rows to compute":
        b = np.concatenate([a[:-2], b[-2:]])
    reuse, fresh = engines(profile, 0, 30, True), engines(profile, 0, 30, False)
    before = reuse.shared_prefix_stats()
    try:
        greedy(reuse, "a", a, 0)
        got = greedy(reuse, "b", b, 6)
        want = greedy(fresh, "b", b, 6)
    finally:
        close_sessions(reuse, fresh)
    after = reuse.shared_prefix_stats()
    assert after["hits"] == before["hits"] + 1
    assert after["rows_reused"] - before["rows_reused"] == min(shared(a, b), len(b) - MIN_COMPUTED)
    for k, (g, w) in enumerate(zip(got, want, strict=True)):
        assert np.array_equal(g, w), f"logits of step {k} differ by {float(np.abs(g - w).max())}"


@pytest.mark.parametrize("profile", PROFILES)
def test_a_split_route_reuses_on_every_hop_and_sends_the_same_rows(engines, prompts, profile) -> None:
    a, b = prompts
    head, tail = engines(profile, 0, 15, True), engines(profile, 15, 30, True)
    ref_head, ref_tail = engines(profile, 0, 15, False), engines(profile, 15, 30, False)
    n = shared(a, b)
    try:
        for e in (head, tail, ref_head, ref_tail):
            e.open_session("a")
            e.open_session("b")
        tail.forward("a", 0, hidden=head.forward("a", 0, token_ids=a).hidden)
        h_b = head.forward("b", 0, token_ids=b).hidden
        ref_h_b = ref_head.forward("b", 0, token_ids=b).hidden
        assert np.array_equal(h_b, ref_h_b)  # the reused rows come from the kept outputs
        out = tail.forward("b", 0, hidden=h_b, want_logits=True)
        ref = ref_tail.forward("b", 0, hidden=ref_h_b, want_logits=True)
        assert np.array_equal(out.logits, ref.logits)
        assert head.shared_prefix_stats()["rows_reused"] >= n
        assert tail.shared_prefix_stats()["rows_reused"] >= n
    finally:
        close_sessions(head, tail, ref_head, ref_tail)


def test_a_closed_session_leaves_its_prefix_for_the_next_one(engines, prompts) -> None:
    """One request after another (a single user): the next session reuses the closed one's
    leading rows, retained in its free slot, and gets the same logits bit for bit."""
    a, b = prompts
    reuse, fresh = engines("default", 0, 30, True), engines("default", 0, 30, False)
    try:
        greedy(reuse, "a", a, 0)
        reuse.close_session("a")
        before = reuse.shared_prefix_stats()
        got = greedy(reuse, "b", b, 4)
        want = greedy(fresh, "b", b, 4)
        after = reuse.shared_prefix_stats()
        assert after["hits"] == before["hits"] + 1
        assert after["rows_reused"] - before["rows_reused"] == shared(a, b)
        assert all(np.array_equal(g, w) for g, w in zip(got, want, strict=True))
    finally:
        close_sessions(reuse, fresh)


def test_a_retained_prefix_goes_when_its_slot_is_taken_or_newer_ones_come(engines, prompts) -> None:
    a, _ = prompts
    e = engines("default", 0, 30, True)
    fresh = engines("default", 0, 30, False)
    rng = np.random.default_rng(7)
    others = [rng.integers(100, 40000, 20, dtype=np.int32) for _ in range(4)]
    try:
        greedy(e, "a", a, 0)
        e.close_session("a")  # retained, in the slot handed out last
        for k, rows in enumerate(others):  # 4 sessions take every slot, the retained one last
            greedy(e, f"s{k}", rows, 0)
        e.close_session("s0")
        before = e.shared_prefix_stats()["hits"]
        got = greedy(e, "again", a, 2)  # a's rows are gone: computed anew, nothing stale copied
        assert e.shared_prefix_stats()["hits"] == before
        want = greedy(fresh, "again", a, 2)
        assert all(np.array_equal(g, w) for g, w in zip(got, want, strict=True))
        close_sessions(e)
        # at most MAX_RETAINED closed sessions' prefixes stay: the oldest goes first
        for k, rows in enumerate(others[:3]):
            greedy(e, f"r{k}", rows, 0)
            e.close_session(f"r{k}")
        before = e.shared_prefix_stats()["hits"]
        greedy(e, "old", others[0], 0)
        assert e.shared_prefix_stats()["hits"] == before
        greedy(e, "new", others[2], 0)
        assert e.shared_prefix_stats()["hits"] == before + 1
    finally:
        close_sessions(e, fresh)


def test_a_cut_session_is_reused_only_up_to_its_cut(engines, prompts) -> None:
    a, b = prompts
    e = engines("default", 0, 30, True)
    try:
        greedy(e, "a", a, 0)
        e.adopt_session("a", "a2", 4)  # cut back below MIN_REUSE (a Kept Hop's keep)
        before = e.shared_prefix_stats()["hits"]
        greedy(e, "b", b, 0)
        assert e.shared_prefix_stats()["hits"] == before
    finally:
        close_sessions(e)


def test_stepwise_rows_are_never_reused(engines, prompts) -> None:
    """A stepwise replay's rows (one model call each, a decode step's arithmetic) are not what a
    prefill of the same tokens makes with the default profile, so they are not indexed."""
    from nodes.engine import BatchPart

    a, _ = prompts
    e = engines("default", 0, 30, True)
    try:
        e.open_session("a")
        e.forward_batch([BatchPart("a", 0, a[:10], sample=False, stepwise=True)])
        e.forward_batch([BatchPart("a", 10, a[10:], sample=False)])
        before = e.shared_prefix_stats()["hits"]
        greedy(e, "b", a, 0)
        assert e.shared_prefix_stats()["hits"] == before
    finally:
        close_sessions(e)


async def test_the_hop_books_only_the_rows_it_computed(model_path, shard_cache, prompts) -> None:
    """Through the hop scheduler: the reused rows come back as `reused`, and the engine's work
    meter (heartbeat tok/s) and the hop's counters (NodeWork) leave them out."""
    from nodes.server.runner import EngineRunner
    from nodes.server.scheduler import HopScheduler

    a, b = prompts
    runner = await EngineRunner.load(lambda: LlamaShardEngine(
        model_path, 0, 15, n_ctx=TEST_N_CTX, max_sessions=4, n_threads=TEST_THREADS, measure=False))
    try:
        sched = HopScheduler(runner, slice_s=None)  # whole prompts: a loaded machine's time slices cut b short
        for sid in ("a", "b"):
            runner.engine.open_session(sid)
        out_a, _, _ = await sched.run("a", 0, a, sample=False)
        out_b, _, _ = await sched.run("b", 0, b, sample=False)
        n = shared(a, b)
        assert (out_a.reused, out_b.reused) == (0, n)
        assert out_b.hidden is not None and out_b.hidden.shape == (len(b), runner.engine.hidden_size)
        assert runner.meter.prefill_tokens == len(a) + len(b) - n
    finally:
        await runner.close()


@pytest.mark.parametrize("profile", PROFILES)
def test_sessions_that_start_in_one_batch_share_their_prefix(engines, prompts, profile) -> None:
    """Two prompts in one engine call: the second reuses what the first made in that call."""
    from nodes.engine import BatchPart

    a, b = prompts
    reuse, fresh = engines(profile, 0, 30, True), engines(profile, 0, 30, False)
    got, want = {}, {}
    for e, out in ((reuse, got), (fresh, want)):
        e.open_session("a")
        e.open_session("b")
        res = e.forward_batch([BatchPart("a", 0, a, want_logits=True), BatchPart("b", 0, b, want_logits=True)])
        out.update(a=res[0].logits, b=res[1].logits, reused=res[1].reused)
    assert got["reused"] == shared(a, b) and want["reused"] == 0
    assert np.array_equal(got["a"], want["a"]) and np.array_equal(got["b"], want["b"])
