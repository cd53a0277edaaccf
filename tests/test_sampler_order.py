"""llama-server's `samplers` (its sampler order), honoured: the gateway turns it into the tail's
SamplingParams.order (gateway/sampler_order.py), and the tail applies top_k, min_p, temperature
and top_p in that order with llama.cpp's semantics (nodes/sampling.py), checked against
llama.cpp's own sampler chain on the same rows."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest

from gateway.chat_request import parse_chat_request
from gateway.completion_request import parse_completion_request
from gateway.errors import InvalidRequestError
from gateway.sampler_order import active_stages
from nodes.sampling import choose_token, nucleus_probs, session_rng, shaped_logits, tempered_probs
from schemas.sampling import DEFAULT_ORDER, SamplingParams
from tests.fixtures.llama_chain import llama_cpp_kept

MSG = [{"role": "user", "content": "hi"}]
LLAMA_DEFAULT = ["penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature"]
WEB_UI = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}


def our_probs(row: np.ndarray, sampling: SamplingParams) -> np.ndarray:
    return tempered_probs(shaped_logits(row, sampling), sampling)


def kept(row: np.ndarray, sampling: SamplingParams) -> set[int]:
    return {int(i) for i in np.flatnonzero(our_probs(row, sampling))}


ROW = np.array([3.0, 2.5, 2.0, 1.0, 0.0, -1.0], dtype=np.float32)


@pytest.mark.parametrize(("params", "first", "then", "kept_first", "kept_then"), [
    # top_p on the untempered row keeps the 0.8 of it; tempered first, the mass spreads: one more
    ({"top_p": 0.8, "temperature": 2.0}, "top_p", "temperature", {0, 1, 2}, {0, 1, 2, 3}),
    # min_p judged on the untempered row, or on the tempered (flatter) one
    ({"min_p": 0.3, "temperature": 2.0}, "min_p", "temperature", {0, 1, 2}, {0, 1, 2, 3}),
    # top_p's mass over top_k's survivors (renormalized), or over the whole row
    ({"top_k": 3, "top_p": 0.8, "temperature": 1.0}, "top_k", "top_p", {0, 1}, {0, 1, 2}),
    # top_p's mass over min_p's survivors, or min_p after top_p
    ({"min_p": 0.3, "top_p": 0.8, "temperature": 1.0}, "min_p", "top_p", {0, 1}, {0, 1, 2}),
    # these commute: both judge the same ranking
    ({"top_k": 2, "temperature": 2.0}, "top_k", "temperature", {0, 1}, {0, 1}),
    ({"top_k": 2, "min_p": 0.3, "temperature": 1.0}, "top_k", "min_p", {0, 1}, {0, 1}),
])
def test_each_order_of_two_stages_keeps_what_llama_cpp_keeps(
        params: dict[str, Any], first: str, then: str, kept_first: set[int], kept_then: set[int]) -> None:
    """Before: the tail had one fixed order, so a request could not have llama.cpp's other ones."""
    rest = tuple(s for s in DEFAULT_ORDER if s not in (first, then))
    for order, want in (((first, then, *rest), kept_first), ((then, first, *rest), kept_then)):
        sampling = SamplingParams(**params, order=order)
        assert kept(ROW, sampling) == want, order
        assert set(llama_cpp_kept(ROW, order[:2], sampling)) == want, order


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
def test_every_order_gives_llama_cpps_candidates_and_probabilities(temperature: float) -> None:
    """All 24 orders of top_k, min_p, temperature and top_p on rows of 64 logits: the kept set is
    llama.cpp's chain's, and the draw's probabilities the softmax of what it leaves."""
    rng = np.random.default_rng(7)
    for _ in range(12):
        row = (rng.standard_normal(64) * 2).astype(np.float32)
        sets = set()
        for order in itertools.permutations(DEFAULT_ORDER):
            sampling = SamplingParams(temperature=temperature, top_k=20, top_p=0.8, min_p=0.05, order=order)
            theirs = llama_cpp_kept(row, order, sampling)
            ids = sorted(theirs)
            probs = our_probs(row, sampling)
            assert kept(row, sampling) == set(ids), order
            logit = np.array([theirs[i] for i in ids], dtype=np.float64)
            want = np.exp(logit - logit.max()) / np.exp(logit - logit.max()).sum()
            np.testing.assert_allclose(probs[ids], want, rtol=1e-5, atol=1e-8)
            sets.add(frozenset(ids))
        assert len(sets) > 1  # the orders do give different candidates


def test_the_default_order_is_the_tails_arithmetic_of_before() -> None:
    sampling = SamplingParams(temperature=0.7, top_k=3, min_p=0.1, top_p=0.9)
    shaped = shaped_logits(ROW, sampling)
    assert np.array_equal(tempered_probs(shaped, sampling), nucleus_probs(shaped, 0.7, 0.9))


@pytest.mark.parametrize("order", list(itertools.permutations(DEFAULT_ORDER))[::5])
def test_greedy_is_the_argmax_of_the_biased_row_in_any_order(order: tuple[str, ...]) -> None:
    sampling = SamplingParams(temperature=0.0, top_k=2, top_p=0.1, min_p=0.9, logit_bias=((2, 5.0),), order=order)
    assert choose_token(ROW, sampling, session_rng(sampling)).token_id == 2


def test_a_tiny_temperature_before_a_cut_still_samples_the_likeliest_token() -> None:
    sampling = SamplingParams(temperature=1e-40, min_p=0.5, top_p=0.5, order=("temperature", "min_p", "top_p", "top_k"))
    assert choose_token(ROW, sampling, session_rng(sampling)).token_id == 0


def test_an_order_must_list_each_stage_once() -> None:
    with pytest.raises(ValueError):
        SamplingParams(order=("top_k", "top_k", "temperature", "top_p"))
    with pytest.raises(ValueError):
        SamplingParams(order=("top_k", "temperature", "top_p"))


@pytest.mark.parametrize(("request_", "stages"), [
    ({}, []),
    (WEB_UI, ["top_k", "min_p", "temperature", "top_p"]),
    ({"temperature": 0, "top_k": 40, "top_p": 0.95, "frequency_penalty": 0.5}, ["penalties", "temperature"]),
    ({"top_k": -1, "top_p": 1, "temperature": 1, "presence_penalty": 0}, []),
])
def test_the_stages_a_request_turns_on(request_: dict[str, Any], stages: list[str]) -> None:
    assert active_stages(parse_chat_request({"model": "m", "messages": MSG, **request_}).sampling) == stages


@pytest.mark.parametrize(("samplers", "request_", "order"), [
    # llama-server's default order, as a list and as letters, with its web UI's default settings
    (LLAMA_DEFAULT, WEB_UI, ("top_k", "top_p", "min_p", "temperature")),
    ("edskypmxt", WEB_UI, ("top_k", "top_p", "min_p", "temperature")),
    (["top_k", "typ_p", "top_p", "min_p", "temperature"], WEB_UI, ("top_k", "top_p", "min_p", "temperature")),
    (LLAMA_DEFAULT, {"temperature": 0.8, "top_p": 0.95}, ("top_p", "temperature", "top_k", "min_p")),
    # the tail's own order, or one that gives what it gives (top_k commutes with min_p and temperature)
    (["top_k", "min_p", "temperature", "top_p"], WEB_UI, DEFAULT_ORDER),
    (["min_p", "temperature", "top_k", "top_p"], WEB_UI, DEFAULT_ORDER),
    (LLAMA_DEFAULT, {"temperature": 0.8, "top_k": 40}, DEFAULT_ORDER),
    (["temperature", "top_k", "min_p", "top_p"], WEB_UI, ("top_k", "temperature", "min_p", "top_p")),
    # a sampler that is off does nothing wherever, and however often, it is listed
    (["top_k", "top_k", "temperature", "xtc", "xtc"], {"temperature": 0.8}, DEFAULT_ORDER),
    (["top_p", "temperature"], {"temperature": 0, "top_p": 0.5}, DEFAULT_ORDER),  # greedy: the likeliest token
    (["top_k", "penalties", "temperature"], {"temperature": 0.8, "presence_penalty": 0.5}, DEFAULT_ORDER),
    ([], {}, DEFAULT_ORDER),
])
def test_samplers_becomes_the_tails_order(samplers: Any, request_: dict[str, Any], order: tuple[str, ...]) -> None:
    """Before: every order but ones that gave the tail's fixed order was a 400, llama-server's
    default (top_p before min_p and temperature) with its web UI's settings among them."""
    assert parse_chat_request({"model": "m", "messages": MSG, **request_, "samplers": samplers}).sampling.order == order
    assert parse_completion_request({"model": "m", "prompt": "a", **request_, "samplers": samplers}).sampling.order \
        == order


@pytest.mark.parametrize(("samplers", "request_"), [
    (["top_k", "penalties", "temperature"], {"temperature": 0.8, "top_k": 40, "frequency_penalty": 0.5}),
    (["top_k"], {"frequency_penalty": 0.5}),  # penalties on, not listed
    (["top_k", "top_p"], {"temperature": 0.8}),  # temperature on, not listed: llama-server would skip it
    (["top_p"], {"temperature": 0}),  # without `temperature` llama-server would not be greedy
    (["temperature", "temperature"], {"temperature": 0.5}),  # applied twice
    (["top_k", "top_p", "top_k", "temperature"], WEB_UI),
    (["infill", "temperature"], {}), ("ikt", {}), (["adaptive_p"], {}), (["mirostat"], {}), ("kq", {}), (["top_k", 3], {}),
    (7, {}), ("", {"temperature": 0.5}),
])
def test_an_order_the_tail_cannot_follow_is_a_400_naming_samplers(samplers: Any, request_: dict[str, Any]) -> None:
    for parse, body in ((parse_chat_request, {"messages": MSG}), (parse_completion_request, {"prompt": "a"})):
        with pytest.raises(InvalidRequestError) as info:
            parse({"model": "m", **body, **request_, "samplers": samplers})
        assert info.value.param == "samplers", info.value
