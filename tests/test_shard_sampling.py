"""The tail's sampling: pure function cases, then seeds through a real split route."""

from __future__ import annotations

import numpy as np
import pytest

from nodes.sampling import TokenSampler, choose_token, log_softmax, nucleus_probs, session_rng
from schemas.sampling import SamplingParams
from tests.fixtures.model import route_prefill

LOGITS = np.array([1.0, 3.0, 2.0, -1.0], dtype=np.float32)


@pytest.mark.parametrize(
    "temperature,top_p,expected_support",
    [
        (1.0, 1.0, {0, 1, 2, 3}),
        (1.0, 0.5, {1}),  # token 1 alone has ~0.66 of the mass
        (1.0, 0.85, {1, 2}),  # 0.657 + 0.242 covers 0.85
        (0.05, 1.0, {1}),  # near-zero temperature concentrates on the argmax
    ],
)
def test_nucleus_support(temperature, top_p, expected_support) -> None:
    probs = nucleus_probs(LOGITS, temperature, top_p)
    assert abs(probs.sum() - 1.0) < 1e-9
    assert {int(i) for i in np.flatnonzero(probs > 1e-6)} == expected_support


def test_greedy_and_logprobs() -> None:
    params = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2)
    choice = choose_token(LOGITS, params, session_rng(params))
    assert choice.token_id == 1
    lp = log_softmax(LOGITS)
    assert choice.logprob == pytest.approx(lp[1])
    assert [t for t, _ in choice.top_logprobs] == [1, 2]


def test_same_seed_same_draws_pure() -> None:
    params = SamplingParams(temperature=1.0, seed=7)
    a, b = session_rng(params), session_rng(params)
    draws_a = [choose_token(LOGITS, params, a).token_id for _ in range(50)]
    draws_b = [choose_token(LOGITS, params, b).token_id for _ in range(50)]
    assert draws_a == draws_b
    assert len(set(draws_a)) > 1  # it really samples


def _generate(engines, sid, ids, n, sampling) -> list[int]:
    for i, e in enumerate(engines):
        e.open_session(sid, sampling if i == len(engines) - 1 else None)
    try:
        out = route_prefill(engines, sid, ids)
        tokens, pos = [out.token.token_id], len(ids)
        while len(tokens) < n:
            tokens.append(route_prefill(engines, sid, [tokens[-1]], pos).token.token_id)
            pos += 1
        return tokens
    finally:
        for e in engines:
            e.close_session(sid)


def test_seeded_sampling_on_a_split_route(shard_engine, baseline) -> None:
    engines = [shard_engine(0, 15), shard_engine(15, 30)]
    ids = baseline.prompt_ids

    def hot(seed):
        return SamplingParams(temperature=1.2, top_p=0.95, seed=seed)

    first = _generate(engines, "seed-a", ids, 16, hot(1234))
    again = _generate(engines, "seed-b", ids, 16, hot(1234))
    assert first == again
    others = [_generate(engines, f"seed-{s}", ids, 16, hot(s)) for s in (1, 2, 3)]
    assert any(o != first for o in others)
    greedy = _generate(engines, "t0", ids, 16, SamplingParams(temperature=0.0, seed=99))
    assert greedy == baseline.greedy[:16]


def test_draw_picks_what_rng_choice_picks_for_the_same_generator_state() -> None:
    from nodes.sampling import draw, nucleus_probs

    for seed in range(300):
        logits = np.random.default_rng(seed).standard_normal(4096).astype(np.float32) * (1 + seed % 7)
        p = nucleus_probs(logits, 0.7 + (seed % 5) * 0.2, 1.0 if seed % 3 else 0.9)
        want = int(np.random.default_rng((seed, 5)).choice(p.shape[0], p=p))
        assert draw(p, np.random.default_rng((seed, 5))) == want


def test_a_token_logprob_is_the_log_softmax_entry() -> None:
    from nodes.sampling import _log_softmax64, log_softmax, token_logprob

    x = np.random.default_rng(0).standard_normal(49152).astype(np.float32) * 5
    assert token_logprob(x, 7) == log_softmax(x)[7]
    assert np.abs(log_softmax(x) - _log_softmax64(x)).max() < 1e-6


def test_logit_bias_top_k_and_min_p_shape_the_choice_and_leave_logprobs_alone() -> None:
    logits = np.array([1.0, 5.0, 4.0, 0.5, 3.0], dtype=np.float32)
    greedy = SamplingParams()
    assert choose_token(logits, greedy, session_rng(greedy)).token_id == 1
    banned = SamplingParams(logit_bias=((1, -100.0),), logprobs=True)
    choice = choose_token(logits, banned, session_rng(banned))
    assert choice.token_id == 2  # the greedy token banned: the next one
    assert choice.logprob == pytest.approx(float(log_softmax(logits)[2]))  # the model's own logprob
    assert choose_token(logits, SamplingParams(logit_bias=((3, 100.0),)), session_rng(greedy)).token_id == 3
    for k in range(20):  # top_k 1 at any temperature is the argmax, whatever the draw
        one = SamplingParams(temperature=2.0, top_k=1, seed=k)
        assert choose_token(logits, one, session_rng(one)).token_id == 1
    two = [choose_token(logits, p, session_rng(p)).token_id
           for p in (SamplingParams(temperature=2.0, top_k=2, seed=k) for k in range(200))]
    assert set(two) == {1, 2}  # only the two likeliest are ever drawn
    # min_p 0.3: p >= 0.3 p_max  <=>  logit >= 5 + ln 0.3 = 3.80: tokens 1 and 2
    near = [choose_token(logits, p, session_rng(p)).token_id
            for p in (SamplingParams(temperature=2.0, min_p=0.3, seed=k) for k in range(200))]
    assert set(near) == {1, 2}


def test_penalties_count_only_generated_tokens_and_a_restart_starts_from_them() -> None:
    logits = np.array([3.0, 2.9, 0.0, -1.0], np.float32)
    params = SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.25)
    sampler = TokenSampler(params)
    assert sampler.choose(logits, session_rng(params)).token_id == 0  # nothing generated yet
    assert sampler.penalty() == {0: 0.75}
    assert sampler.choose(logits, session_rng(params)).token_id == 1  # 3.0 - 0.75 < 2.9
    assert sampler.choose(logits, session_rng(params)).token_id == 0  # 2.25 vs 2.9 - 0.75
    restarted = TokenSampler(params.model_copy(update={"generated": (0, 1, 0)}))
    assert restarted.counts == sampler.counts and restarted.penalty() == {0: 1.0, 1: 0.75}
    chosen = sampler.choose(logits, session_rng(params))
    assert chosen.logprob is None and chosen.token_id == 1
    lp = TokenSampler(params.model_copy(update={"logprobs": True})).choose(logits, session_rng(params))
    assert lp.logprob == pytest.approx(float(log_softmax(logits)[0]))  # the model's own, never penalized


def test_a_constraint_masks_what_its_grammar_does_not_allow(model_path) -> None:
    from artifacts.vocab_file import materialize_vocabulary
    from nodes.engine import ConstraintError
    from nodes.token_constraint import TokenConstraint, vocabulary_of
    from schemas.output_constraint import OutputConstraint

    vocab = str(materialize_vocabulary(model_path))
    tok = vocabulary_of(vocab)
    spec = OutputConstraint(kind="json_schema", schema_text='{"type": "boolean"}')
    constraint = TokenConstraint(spec, vocab)
    allowed = constraint.allowed()
    texts = {tok.decode_str([int(t)]) for t in np.flatnonzero(allowed)}
    assert texts and all("true".startswith(t) or "false".startswith(t) for t in texts), sorted(texts)[:20]
    params = SamplingParams(temperature=0, constraint=spec)
    sampler = TokenSampler(params, constraint)
    logits = np.zeros(tok.vocab_size, np.float32)
    logits[tok.tokenize_str("hello")[0]] = 50.0  # the model's favourite is not allowed
    first = sampler.choose(logits, session_rng(params)).token_id
    assert tok.decode_str([first]) in texts
    with pytest.raises(ConstraintError):
        TokenConstraint(spec, vocab).consume(tok.tokenize_str("hello")[0])
    # a restart's tail starts from what was generated: the same mask as the tail that made it
    obj = OutputConstraint(kind="json_object")
    made = TokenSampler(SamplingParams(constraint=obj), TokenConstraint(obj, vocab))
    for token in tok.tokenize_str('{"a":'):
        made.consume(token)
    again = TokenSampler(SamplingParams(constraint=obj, generated=tuple(tok.tokenize_str('{"a":'))),
                         TokenConstraint(obj, vocab))
    assert np.array_equal(made.constraint.allowed(), again.constraint.allowed())


@pytest.mark.parametrize("temperature", [1e-300, 1e-40, 1e-38])
def test_a_temperature_too_small_for_float32_samples_the_likeliest_token(temperature) -> None:
    """Valid API temperatures whose scaled row overflows float32 gave NaN probabilities, and the
    draw then picked token 0 (the bundled model's <|endoftext|>: an empty answer)."""
    logits = np.random.default_rng(0).standard_normal(49152).astype(np.float32) * 5
    params = SamplingParams(temperature=temperature, seed=3)
    probs = nucleus_probs(logits, temperature, 1.0)
    assert not np.isnan(probs).any() and probs.sum() == pytest.approx(1.0)
    assert choose_token(logits, params, session_rng(params)).token_id == int(logits.argmax())
    assert choose_token(LOGITS, SamplingParams(temperature=temperature), session_rng(params)).token_id == 1
