"""llama.cpp shard engine on the real model: split == whole, seams, sessions, rejections."""

from __future__ import annotations

import numpy as np
import pytest

from nodes.engine import (
    CacheFullError,
    InputShapeError,
    LayerRangeError,
    PositionMismatchError,
    SessionExistsError,
    UnknownSessionError,
)
from tests.fixtures.model import TEST_N_CTX, route_generate, route_prefill

SPLITS = {
    "cut-1": [(0, 1), (1, 30)],
    "cut-15": [(0, 15), (15, 30)],
    "cut-29": [(0, 29), (29, 30)],
    "3-way": [(0, 10), (10, 20), (20, 30)],
}


@pytest.mark.parametrize("split", sorted(SPLITS))
def test_split_matches_whole_model(split, shard_engine, baseline) -> None:
    engines = [shard_engine(a, b) for a, b in SPLITS[split]]
    logits, tokens = route_generate(engines, f"s-{split}", baseline.prompt_ids, 64)
    assert logits.shape == baseline.logits.shape
    assert float(np.abs(logits - baseline.logits).max()) <= 1e-3
    assert tokens == baseline.greedy


def test_whole_model_shard_matches_baseline(shard_engine, baseline) -> None:
    engine = shard_engine(0, 30)
    logits, tokens = route_generate([engine], "whole", baseline.prompt_ids, 16)
    assert float(np.abs(logits - baseline.logits).max()) <= 1e-3
    assert tokens == baseline.greedy[:16]


def test_decode_step_sends_one_row_per_seam(shard_engine, baseline) -> None:
    engines = [shard_engine(a, b) for a, b in SPLITS["3-way"]]
    sid = "seams"
    for e in engines:
        e.open_session(sid)
    try:
        seams: list[tuple[int, ...]] = []
        out = route_prefill(engines, sid, baseline.prompt_ids, seams=seams)
        n = len(baseline.prompt_ids)
        assert seams == [(n, 576), (n, 576)]
        seams.clear()
        out = route_prefill(engines, sid, [out.token.token_id], n, seams=seams)
        assert seams == [(1, 576), (1, 576)]
        assert out.hidden is None and out.token is not None
        assert [e.position(sid) for e in engines] == [n + 1] * 3
    finally:
        for e in engines:
            e.close_session(sid)


def test_interleaved_sessions_match_each_alone(shard_engine, baseline) -> None:
    engines = [shard_engine(a, b) for a, b in SPLITS["cut-15"]]
    prompts = {"a": baseline.prompt_ids, "b": [*baseline.prompt_ids[:5], 504, 3458, 314]}
    alone = {sid: route_generate(engines, f"alone-{sid}", ids, 12)[1] for sid, ids in prompts.items()}
    for e in engines:
        for sid in prompts:
            e.open_session(sid)
    try:
        toks = {sid: [route_prefill(engines, sid, ids).token.token_id] for sid, ids in prompts.items()}
        pos = {sid: len(ids) for sid, ids in prompts.items()}
        for _ in range(11):
            for sid in prompts:  # one step of a, one step of b, ...
                out = route_prefill(engines, sid, [toks[sid][-1]], pos[sid])
                toks[sid].append(out.token.token_id)
                pos[sid] += 1
    finally:
        for e in engines:
            for sid in prompts:
                e.close_session(sid)
    assert toks == alone


def test_close_returns_cache_bytes_and_slot_is_reused(shard_engine, baseline) -> None:
    engines = [shard_engine(a, b) for a, b in SPLITS["cut-15"]]
    head = engines[0]
    report = head.capability()
    ids = [f"c{i}" for i in range(report.max_sessions)]
    for sid in ids:
        head.open_session(sid)
    with pytest.raises(CacheFullError):
        head.open_session("one-too-many")
    head.forward(ids[0], 0, token_ids=np.asarray(baseline.prompt_ids, dtype=np.int32))
    assert head.cache_bytes(ids[0]) == len(baseline.prompt_ids) * report.cache_bytes_per_token > 0
    for sid in ids:
        head.close_session(sid)
    with pytest.raises(UnknownSessionError):
        head.cache_bytes(ids[0])
    assert head.sessions() == []
    # every slot was freed: a fresh route over the same shards gives the baseline answer again
    logits, tokens = route_generate(engines, "reuse", baseline.prompt_ids, 8)
    assert float(np.abs(logits - baseline.logits).max()) <= 1e-3
    assert tokens == baseline.greedy[:8]


def test_bad_frames_are_rejected_before_execution(shard_engine, baseline) -> None:
    head, tail = (shard_engine(a, b) for a, b in SPLITS["cut-15"])
    sid, n = "bad", len(baseline.prompt_ids)
    ids = np.asarray(baseline.prompt_ids, dtype=np.int32)
    for e in (head, tail):
        e.open_session(sid)
    try:
        hidden = head.forward(sid, 0, token_ids=ids).hidden
        bad_calls = [
            (PositionMismatchError, tail, dict(position=1, hidden=hidden)),
            (UnknownSessionError, tail, dict(position=0, hidden=hidden, session_id="nope")),
            (InputShapeError, tail, dict(position=0, hidden=hidden[:, :500].copy())),
            (InputShapeError, tail, dict(position=0, hidden=hidden.astype(np.float64))),
            (InputShapeError, tail, dict(position=0, hidden=np.zeros((0, 576), np.float32))),
            (InputShapeError, tail, dict(position=0, token_ids=ids)),
            (InputShapeError, head, dict(position=n, hidden=hidden[-1:])),
            (InputShapeError, head, dict(position=n, token_ids=np.asarray([49152], np.int32))),
            (InputShapeError, head, dict(position=n, token_ids=np.asarray([-1], np.int32))),
            (PositionMismatchError, head, dict(position=0, token_ids=ids)),
            (CacheFullError, head, dict(position=n, token_ids=np.zeros(TEST_N_CTX, np.int32))),
        ]
        for err, engine, kw in bad_calls:
            call_sid = kw.pop("session_id", sid)
            before = engine.position(sid)
            with pytest.raises(err):
                engine.forward(call_sid, kw.pop("position"), **kw)
            assert engine.position(sid) == before
        out = tail.forward(sid, 0, hidden=hidden, want_logits=True)
        assert float(np.abs(out.logits - baseline.logits).max()) <= 1e-3
        assert out.token.token_id == baseline.greedy[0]
    finally:
        for e in (head, tail):
            e.close_session(sid)


def test_session_lifecycle_errors(shard_engine) -> None:
    head = shard_engine(0, 15)
    head.open_session("dup")
    try:
        with pytest.raises(SessionExistsError):
            head.open_session("dup")
    finally:
        head.close_session("dup")
    with pytest.raises(UnknownSessionError):
        head.close_session("dup")


@pytest.mark.parametrize("start,end", [(0, 31), (5, 5), (-1, 3), (20, 10)])
def test_layer_range_outside_model_is_rejected_at_load(model_path, shard_cache, start, end) -> None:
    from nodes.engine_factory import load_engine

    with pytest.raises(LayerRangeError):
        load_engine("llama.cpp", model_path, start, end)


def test_capability_report(shard_engine, model_path) -> None:
    from artifacts.revision import model_revision

    head, tail = shard_engine(0, 15), shard_engine(15, 30)
    for engine, (a, b) in ((head, (0, 15)), (tail, (15, 30))):
        r = engine.capability()
        assert (r.layers.start, r.layers.end, r.layers.n_layer) == (a, b, 30)
        assert r.model_arch == "llama" and r.runtime == "llama.cpp"
        assert r.model_revision == model_revision(model_path)
        assert r.hidden_size == 576 and r.vocab_size == 49152
        assert r.supports_layer_range and r.supports_prefill and r.supports_decode_step
        # 15 layers (+ the head's capture layer) × (K + V) × 3 kv heads × 64 dims × f16
        assert r.cache_bytes_per_token == (15 + (a == 0)) * 2 * 3 * 64 * 2
        assert r.prefill_tokens_per_second > 0 and r.decode_tokens_per_second > 0
        assert r.memory_floor_bytes > 0 and r.n_ctx == TEST_N_CTX
        # dense: a token reads every weight the shard runs (tests/test_shard_weights.py has MoE)
        assert r.active_param_bytes_per_token == r.param_bytes > 0 and r.expert_count == 0
    # the tail maps its file; the head also keeps the quantized embedding table for lookups
    assert tail.capability().memory_floor_bytes == tail.shard_path.stat().st_size
    assert head.capability().memory_floor_bytes > head.shard_path.stat().st_size


def test_self_measurement_reports_the_fastest_call(model_path, shard_cache) -> None:
    """A neighbour slowing one call (here: the first prefill and decode step, 0.5 s each) does
    not lower the Capability Report's rates: the report takes each kind's fastest call."""
    import time

    from nodes.llama_engine import LlamaShardEngine

    calls: list[tuple[int, float]] = []  # rows, seconds (sleep included)

    class Slowed(LlamaShardEngine):
        def _run(self, parts, runs, results):  # type: ignore[no-untyped-def]
            rows = sum(len(r) for _, _, r in runs)
            t0 = time.perf_counter()
            if not any(r == rows for r, _ in calls):
                time.sleep(0.5)  # the first call of each kind: a neighbour had the cores
            out = super()._run(parts, runs, results)  # inside the engine's own timing
            calls.append((rows, time.perf_counter() - t0))
            return out

    with Slowed(model_path, 0, 15, n_ctx=TEST_N_CTX, max_sessions=1, n_threads=2) as e:
        r = e.capability()
    assert len(calls) >= 8 and len(calls) % 4 == 0  # rounds of one prefill chunk and three decode steps
    n = max(rows for rows, _ in calls)
    assert {rows for rows, _ in calls} == {1, n}
    slowed = {rows: rows / s for rows, s in (next(c for c in calls if c[0] == k) for k in (1, n))}
    # the slowed calls took 0.5 s more than the others: the report is well above their rates
    assert r.prefill_tokens_per_second > 1.5 * slowed[n] and r.decode_tokens_per_second > 5 * slowed[1]


def test_callback_capture_gives_the_same_rows(model_path, shard_cache, shard_engine, baseline) -> None:
    from nodes.engine_factory import load_engine

    ids = np.asarray(baseline.prompt_ids, dtype=np.int32)
    default = shard_engine(0, 15)
    with load_engine("llama.cpp", model_path, 0, 15, n_ctx=TEST_N_CTX, max_sessions=1, n_threads=2,
                     capture="cb_eval", measure=False) as via_callback:
        rows = []
        for engine in (default, via_callback):
            engine.open_session("cb")
            try:
                prefill = engine.forward("cb", 0, token_ids=ids).hidden
                step = engine.forward("cb", len(ids), token_ids=ids[:1]).hidden
                rows.append((prefill, step))
            finally:
                engine.close_session("cb")
    (a_pf, a_step), (b_pf, b_step) = rows
    assert a_pf.shape == (len(ids), 576) and a_step.shape == (1, 576)
    assert np.array_equal(a_pf, b_pf) and np.array_equal(a_step, b_step)


_SPIN_PROBE = """
import builtins, os, sys
os.environ.pop("GOMP_SPINCOUNT", None)
seen = []
real_import = builtins.__import__
def probe(name, *args, **kwargs):
    if name.split(".")[0] == "llama_cpp" and not seen:
        seen.append(os.environ.get("GOMP_SPINCOUNT"))
    return real_import(name, *args, **kwargs)
builtins.__import__ = probe
from artifacts.bundled import bundled_model_path
from nodes.llama_engine import LlamaShardEngine
LlamaShardEngine(bundled_model_path(), START, END, n_ctx=64, max_sessions=1, n_threads=1, measure=False).close()
print(seen[0] if seen else "never imported")
"""


@pytest.mark.parametrize("start,end", [(0, 15), (15, 30), (0, 30)])
def test_llama_cpp_loads_with_short_openmp_spin(start, end) -> None:
    """libgomp reads GOMP_SPINCOUNT once, when the first llama_cpp import loads it: a shard that
    imported llama_cpp before setting it let each idle worker spin ~10 ms after its model call,
    on the core the next hop's call needed (the head's decode step: 9.7 -> 23 ms)."""
    import subprocess
    import sys
    from pathlib import Path

    code = _SPIN_PROBE.replace("START", str(start)).replace("END", str(end))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parent.parent, check=True).stdout.split()
    assert out[-1] == "2000"
