"""Other servers' parameters at the values where they change nothing (gateway/neutral_params.py):
accepted, and a 400 naming them at any other value (pure request validation)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from gateway.api_chat import _encode_chat
from gateway.chat_request import parse_chat_request
from gateway.completion_request import parse_completion_request
from gateway.errors import InvalidRequestError
from gateway.neutral_params import thinks

MSG = [{"role": "user", "content": "hi"}]

# the fields llama-server's web UI sends (tools/server/webui: its chat service, the older UI's
# `cache_prompt` and `typical_p`), each at a value that changes nothing here
WEB_UI = {
    "stream": True, "cache_prompt": True, "reasoning_format": "none", "temperature": 0.8, "top_k": 40,
    "top_p": 0.95, "min_p": 0.05, "dynatemp_range": 0, "dynatemp_exponent": 1, "xtc_probability": 0,
    "xtc_threshold": 0.1, "typical_p": 1, "typ_p": 1, "repeat_last_n": 64, "repeat_penalty": 1,
    "presence_penalty": 0, "frequency_penalty": 0, "dry_multiplier": 0, "dry_base": 1.75,
    "dry_allowed_length": 2, "dry_penalty_last_n": -1, "dry_sequence_breakers": ["\n", ":", "\"", "*"],
    "mirostat": 0, "mirostat_tau": 5.0, "mirostat_eta": 0.1, "samplers": ["top_k", "min_p", "temperature", "top_p"],
    "timings_per_token": False, "return_progress": False, "backend_sampling": False, "n_probs": 0, "min_keep": 0,
    "top_n_sigma": -1, "id_slot": -1, "post_sampling_probs": False, "return_tokens": False, "grammar": "",
    "chat_template_kwargs": {},
}
# vLLM's extra sampling fields at their defaults
VLLM = {"top_k": -1, "min_tokens": 0, "repetition_penalty": 1.0, "skip_special_tokens": True,
        "spaces_between_special_tokens": True, "ignore_eos": False, "include_stop_str_in_output": False,
        "stop_token_ids": [], "use_beam_search": False, "length_penalty": 1.0, "chat_template_kwargs": {},
        "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": False},
        "add_generation_prompt": True, "continue_final_message": False}


def _refused(body: dict[str, Any]) -> tuple[str | None, str]:
    with pytest.raises(InvalidRequestError) as info:
        parse_chat_request({"model": "m", "messages": MSG, **body})
    return info.value.param, info.value.code


@pytest.mark.parametrize("extra", [WEB_UI, VLLM], ids=["llama-server web UI", "vLLM"])
def test_a_clients_neutral_fields_are_served_as_if_left_out(extra: dict[str, Any]) -> None:
    """Before: each of these fields was a 400 (`typical_p: 1`, `mirostat: 0`, `cache_prompt: true`,
    ...), so llama-server's web UI and vLLM clients could not talk to the gateway at all."""
    own = {k: extra[k] for k in ("temperature", "top_k", "top_p", "min_p", "stream") if k in extra}
    if "stream_options" in extra:
        own["stream_options"] = {"include_usage": True}
    assert parse_chat_request({"model": "m", "messages": MSG, **extra}) == \
        parse_chat_request({"model": "m", "messages": MSG, **own})
    assert parse_completion_request({"model": "m", "prompt": "a", **extra}) == \
        parse_completion_request({"model": "m", "prompt": "a", **own})


@pytest.mark.parametrize(("field", "value"), [
    ("typical_p", 0.9), ("typ_p", 0.5), ("typical_p", True), ("mirostat", 2), ("mirostat", False),
    ("dynatemp_range", 0.5), ("xtc_probability", 0.5), ("dry_multiplier", 0.8), ("top_n_sigma", 1.0),
    ("n_probs", 3), ("min_keep", 5), ("id_slot", 0), ("timings_per_token", True),
    ("return_tokens", True), ("post_sampling_probs", True), ("backend_sampling", True), ("grammar", "root ::= \"a\""),
    ("reasoning_format", "deepseek"), ("cache_prompt", 1), ("repetition_penalty", 1.1), ("min_tokens", 3),
    ("skip_special_tokens", False), ("spaces_between_special_tokens", False), ("include_stop_str_in_output", True),
    ("use_beam_search", True), ("length_penalty", 0.5),
    ("chat_template_kwargs", {"enable_thinking": False}), ("add_generation_prompt", False),
    ("continue_final_message", True), ("echo", True),
])
def test_any_other_value_is_a_400_naming_the_field(field: str, value: Any) -> None:
    assert _refused({field: value}) == (field, "unsupported_parameter")


@pytest.mark.parametrize(("tuning", "value", "switch", "on"), [
    ("mirostat_tau", 5.0, "mirostat", 2), ("mirostat_eta", 0.1, "mirostat", 1),
    ("dynatemp_exponent", 1.0, "dynatemp_range", 0.5), ("xtc_threshold", 0.1, "xtc_probability", 0.5),
    ("dry_base", 1.75, "dry_multiplier", 0.8), ("dry_allowed_length", 2, "dry_multiplier", 0.8),
    ("dry_penalty_last_n", 64, "dry_multiplier", 0.8), ("dry_sequence_breakers", ["\n"], "dry_multiplier", 0.8),
    ("repeat_last_n", 64, "repeat_penalty", 1.1),
])
def test_a_parameter_that_tunes_another_passes_any_value_only_while_that_one_is_off(
        tuning: str, value: Any, switch: str, on: Any) -> None:
    parse_chat_request({"model": "m", "messages": MSG, tuning: value})
    parse_chat_request({"model": "m", "messages": MSG, tuning: value, switch: None})
    assert _refused({tuning: value, switch: on})[0] in (tuning, switch)
    assert _refused({switch: on, tuning: value})[0] == switch  # the first field it cannot honour is named
    assert _refused({tuning: "five"}) == (tuning, "unsupported_parameter")  # still of its type


@pytest.mark.parametrize("penalty", ["presence_penalty", "frequency_penalty"])
def test_llama_servers_penalty_window_is_refused_with_the_penalties_this_gateway_applies(penalty: str) -> None:
    """The gateway's presence and frequency penalties count every generated token (no prompt token):
    a llama-server window of the last 64 tokens would be ignored, so it is a 400 naming it."""
    assert parse_chat_request({"model": "m", "messages": MSG, penalty: 0.5}).sampling is not None
    assert _refused({penalty: 0.5, "repeat_last_n": 64}) == ("repeat_last_n", "unsupported_parameter")
    assert parse_chat_request({"model": "m", "messages": MSG, penalty: 0, "repeat_last_n": 64}).model == "m"


def test_max_tokens_of_minus_one_is_llama_servers_no_limit() -> None:
    """llama-server's web UI sends `max_tokens: -1` by default ("-1 for infinite"): it was a 400.
    A chat answer then ends where one without max_tokens does; a legacy completion, whose
    default is 16 tokens, gets no limit either. Other negative values stay 400s."""
    plain = parse_chat_request({"model": "m", "messages": MSG})
    for field in ("max_tokens", "max_completion_tokens"):
        assert parse_chat_request({"model": "m", "messages": MSG, field: -1}) == plain
    assert parse_completion_request({"model": "m", "prompt": "a", "max_tokens": -1}).max_tokens is None
    assert parse_completion_request({"model": "m", "prompt": "a"}).max_tokens == 16
    for body in ({"max_tokens": -2}, {"max_tokens": -1.0}, {"max_completion_tokens": True}):
        assert _refused(body) == (next(iter(body)), "invalid_value")
    with pytest.raises(InvalidRequestError) as info:
        parse_completion_request({"model": "m", "prompt": "a", "max_completion_tokens": -1})
    assert info.value.param == "max_completion_tokens"  # not a field of the legacy endpoint


def test_seed_of_minus_one_is_llama_servers_random_seed() -> None:
    """llama-server's clients send `seed: -1` for "a random seed" (its default): it was a 400.
    It is now the same as leaving the seed out; other negative seeds stay 400s."""
    assert parse_chat_request({"model": "m", "messages": MSG, "seed": -1}) == \
        parse_chat_request({"model": "m", "messages": MSG})
    assert parse_completion_request({"model": "m", "prompt": "a", "seed": -1}).sampling.seed is None
    assert parse_completion_request({"model": "m", "prompt": "a", "seed": -1, "max_tokens": -1}).max_tokens is None
    for seed in (-2, -1.0, True):
        assert _refused({"seed": seed}) == ("seed", "invalid_value")


def test_vllms_chat_echo_at_false_is_served_and_at_true_refused() -> None:
    """`echo` is chat's in vLLM (the last message repeated first): false passes, true is a 400;
    /v1/completions keeps its own echo, which it honours."""
    assert parse_chat_request({"model": "m", "messages": MSG, "echo": False}) == \
        parse_chat_request({"model": "m", "messages": MSG})
    assert parse_completion_request({"model": "m", "prompt": "a", "echo": True}).echo


def test_reasoning_format_auto_is_served_for_a_template_without_thinking_markers() -> None:
    """llama-server's web UI sends `reasoning_format: "auto"` with every request: it was a 400. It
    splits thoughts out only for a template with thinking markers, so for one without (SmolLM2's)
    it changes nothing; the request keeps that it asked, for the prompt encoding to refuse it
    where the model thinks."""
    auto = parse_chat_request({"model": "m", "messages": MSG, "reasoning_format": "auto"})
    assert auto.reasoning_auto and not parse_chat_request({"model": "m", "messages": MSG}).reasoning_auto
    assert not thinks("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}")
    assert thinks("{{ '<think>\\n' }}") and thinks("<|start|>assistant<|channel|>analysis")


def test_reasoning_format_auto_is_a_400_naming_it_for_a_template_that_thinks() -> None:
    """A model whose template thinks would get its thoughts split out by llama-server under "auto":
    not done here, so the request is refused before it waits for a route."""
    req = parse_chat_request({"model": "m", "messages": MSG, "reasoning_format": "auto"})
    tok = SimpleNamespace(template=SimpleNamespace(source="{% if thinking %}<think>{% endif %}"))
    with pytest.raises(InvalidRequestError) as info:
        _encode_chat(tok, req, 512)  # type: ignore[arg-type]
    assert (info.value.param, info.value.code) == ("reasoning_format", "unsupported_parameter")


def test_return_progress_is_a_chat_requests_own_field() -> None:
    """llama-server's web UI streams with `return_progress: true`: it was a 400. A streamed chat
    answer now sends a `prompt_progress` chunk; a legacy completion still refuses it (no such
    chunk there), and so does a chat with n > 1 (one progress per choice is not sent)."""
    assert parse_chat_request({"model": "m", "messages": MSG, "stream": True, "return_progress": True}).return_progress
    assert not parse_chat_request({"model": "m", "messages": MSG, "return_progress": True}).return_progress
    with pytest.raises(InvalidRequestError) as info:
        parse_completion_request({"model": "m", "prompt": "a", "stream": True, "return_progress": True})
    assert info.value.param == "return_progress"
    assert _refused({"stream": True, "n": 2, "return_progress": True}) == ("return_progress", "unsupported_value")
