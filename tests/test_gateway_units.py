"""Pure parts of the gateway: request validation, stop strings, UTF-8 deltas, telemetry, metrics."""

from __future__ import annotations

import asyncio

import pytest

from gateway.chat_request import check_context, parse_chat_request, parse_json_body
from gateway.completion_request import parse_completion_request
from gateway.errors import (
    ContextLengthError,
    InvalidRequestError,
    RouteUnavailableError,
    SessionConflictError,
)
from gateway.generation import replays_by_prefill
from gateway.held_wait import HELD_WAIT_MAX_S, LOST_NODE_WAIT_S, HeldWait, held_wait_s
from gateway.mesh_view import MeshView
from gateway.metrics import GatewayMetrics
from gateway.openai_format import ChunkFactory, TextFormat, TokenLogprob, Usage, sse_data
from gateway.session_ids import check_session_id
from gateway.session_machine import finish_reason_for
from gateway.telemetry import RateMeter, should_emit
from gateway.telemetry_hub import HubLimits, TelemetryHub
from gateway.telemetry_publisher import bus_should_publish
from gateway.text_stream import IncrementalDetokenizer, StopMatcher, held_back_length
from schemas.coverage import chains_exactly, missing_ranges
from schemas.route import Hop

MSG = [{"role": "user", "content": "hi"}]


# -- request validation --------------------------------------------------------------------


def test_parse_minimal_request_defaults() -> None:
    req = parse_chat_request({"model": "m", "messages": MSG})
    assert req.model == "m"
    assert req.messages[0].content == "hi"
    assert req.sampling.temperature == 1.0 and req.sampling.top_p == 1.0
    assert req.max_tokens is None and req.stop == () and not req.stream


def test_parse_full_request_with_caller_metadata_and_neutral_unsupported_fields() -> None:
    req = parse_chat_request({
        "model": "m",
        "messages": [{"role": "system", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}, *MSG],
        "max_completion_tokens": 7, "max_tokens": 99, "temperature": 0, "top_p": 0.5,
        "stop": "END", "seed": 3, "stream": True, "stream_options": {"include_usage": True},
        "logprobs": True, "top_logprobs": 2, "presence_penalty": 0, "user": "x", "n": 1,
        "metadata": {"k": "v"}, "store": False, "modalities": ["text"], "functions": [],
    })
    assert req.messages[0].content == "ab"
    assert req.max_tokens == 7
    assert req.stop == ("END",)
    assert req.stream and req.include_usage
    s = req.sampling
    assert (s.temperature, s.top_p, s.seed, s.logprobs, s.top_logprobs) == (0.0, 0.5, 3, True, 2)


def test_a_null_field_sets_nothing_so_it_passes_even_where_a_value_would_be_refused() -> None:
    """`"reasoning_effort": null`, as clients that write every field send it: served (before: a
    400 for a field the client never set); a value is still refused, naming the field."""
    body = {"model": "m", "messages": MSG, "reasoning_effort": None, "verbosity": None, "web_search_options": None}
    assert parse_chat_request(body).model == "m"
    assert parse_completion_request({"model": "m", "prompt": "a", "reasoning_effort": None}).prompt == "a"
    with pytest.raises(InvalidRequestError) as info:
        parse_chat_request({**body, "reasoning_effort": "low"})
    assert (info.value.param, info.value.code) == ("reasoning_effort", "unsupported_parameter")


@pytest.mark.parametrize(("field", "neutral", "refused"), [("store", False, True), ("service_tier", "auto", "priority"),
                                                           ("service_tier", "default", "flex")])
def test_storing_an_answer_or_another_service_tier_is_refused_not_ignored(field: str, neutral: object,
                                                                         refused: object) -> None:
    """`store: true` asks for the answer to be kept for a later GET, `service_tier: "priority"` for
    a faster tier: neither exists here, so each is a 400 naming it (both were accepted and ignored)."""
    assert parse_chat_request({"model": "m", "messages": MSG, field: neutral}).model == "m"
    with pytest.raises(InvalidRequestError) as info:
        parse_chat_request({"model": "m", "messages": MSG, field: refused, "metadata": {"k": "v"}})
    assert (info.value.param, info.value.code) == (field, "unsupported_parameter")


def test_a_completions_max_tokens_of_null_is_the_default_and_stream_options_are_strict() -> None:
    assert parse_completion_request({"model": "m", "prompt": "a", "max_tokens": None}).max_tokens == 16
    with pytest.raises(InvalidRequestError) as info:
        parse_completion_request({"model": "m", "prompt": "a", "stream": True,
                                  "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    assert (info.value.param, info.value.code) == ("stream_options.continuous_usage_stats", "unsupported_parameter")


@pytest.mark.parametrize(("prompt", "param"), [("", "prompt"), ([], "prompt"), (["a", ""], "prompt[1]"),
                                               ([[1, 2], []], "prompt[1]"), (["", "a"], "prompt[0]")])
def test_an_empty_prompt_of_a_batch_is_named_by_its_index(prompt: object, param: str) -> None:
    """A batch's empty item named `prompt`, not which one: now `prompt[i]`, OpenAI's param path."""
    with pytest.raises(InvalidRequestError) as info:
        parse_completion_request({"model": "m", "prompt": prompt})
    assert (info.value.param, info.value.code) == (param, "invalid_value")


def test_a_batch_prompt_knows_its_param_path() -> None:
    assert parse_completion_request({"model": "m", "prompt": "a"}).prompt_param == "prompt"
    assert parse_completion_request({"model": "m", "prompt": [1, 2]}).prompt_param == "prompt"  # one prompt of ids
    assert parse_completion_request({"model": "m", "prompt": ["a", "b"]}).prompt_param == "prompt[0]"
    assert parse_completion_request({"model": "m", "prompt": [[1], [2]]}).prompt_param == "prompt[0]"


@pytest.mark.parametrize("key", ["\u00b2", "\u0661\u0662", "a", "1234567890"])
def test_completions_refuse_a_logit_bias_key_that_is_not_ascii_digits(key: str) -> None:
    """'²' passes str.isdigit but not int(): the request failed with a 500, now a 400."""
    with pytest.raises(InvalidRequestError) as info:
        parse_completion_request({"model": "m", "prompt": "a", "logit_bias": {key: 1}})
    assert (info.value.param, info.value.code) == ("logit_bias", "invalid_value")


def test_completions_refuse_echo_with_any_logprobs_and_name_n_when_it_is_too_large() -> None:
    """`logprobs: 0` asks for the chosen tokens' logprobs, with echo the prompt's too, which no
    hop computes: refused as `logprobs: 1` is (before: answered with the answer's logprobs only).
    A lone prompt's n over the bound names `n`, not `prompt`."""
    for logprobs in (0, 1):
        with pytest.raises(InvalidRequestError) as info:
            parse_completion_request({"model": "m", "prompt": "a", "echo": True, "logprobs": logprobs})
        assert info.value.param == "logprobs", logprobs
    assert parse_completion_request({"model": "m", "prompt": "a", "echo": True}).echo
    with pytest.raises(InvalidRequestError) as info:
        parse_completion_request({"model": "m", "prompt": "a", "n": 9})
    assert info.value.param == "n"
    with pytest.raises(InvalidRequestError) as info:
        parse_completion_request({"model": "m", "prompt": ["a"] * 5, "n": 2})
    assert info.value.param == "prompt"


def test_top_k_off_is_0_or_vllms_minus_1() -> None:
    for off in (0, -1):
        assert parse_chat_request({"model": "m", "messages": MSG, "top_k": off}).sampling.top_k == 0
        assert parse_completion_request({"model": "m", "prompt": "a", "top_k": off}).sampling.top_k == 0
    assert parse_chat_request({"model": "m", "messages": MSG, "top_k": 40}).sampling.top_k == 40


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"messages": MSG}, "model", "missing_required_parameter"),
        ({"model": "m"}, "messages", "missing_required_parameter"),
        ({"model": "m", "messages": []}, "messages", "invalid_value"),
        ({"model": "m", "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role",
         "invalid_value"),
        ({"model": "m", "messages": MSG, "temperature": 3}, "temperature", "invalid_value"),
        ({"model": "m", "messages": MSG, "top_p": 0}, "top_p", "invalid_value"),
        ({"model": "m", "messages": MSG, "max_tokens": 0}, "max_tokens", "invalid_value"),
        ({"model": "m", "messages": MSG, "max_tokens": "ten"}, "max_tokens", "invalid_value"),
        ({"model": "m", "messages": MSG, "n": 9}, "n", "invalid_value"),
        ({"model": "m", "messages": MSG, "validate": "maybe"}, "validate", "invalid_value"),
        ({"model": "m", "messages": MSG, "tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0]",
         "invalid_value"),
        ({"model": "m", "messages": MSG, "tools": {"f": 1}}, "tools", "invalid_value"),
        ({"model": "m", "messages": MSG, "tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]},
         "tools[0].function.parameters", "invalid_value"),
        ({"model": "m", "messages": MSG, "tool_choice": "required"}, "tool_choice", "invalid_value"),
        ({"model": "m", "messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}],
          "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice", "invalid_value"),
        ({"model": "m", "messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}],
          "parallel_tool_calls": "yes"}, "parallel_tool_calls", "invalid_value"),
        ({"model": "m", "messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}],
          "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format", "invalid_value"),
        ({"model": "m", "messages": MSG, "functions": [{"name": "f"}]}, "functions", "unsupported_parameter"),
        # fields other servers honour and this gateway does not: named, never silently dropped
        ({"model": "m", "messages": MSG, "grammar": 'root ::= "a"'}, "grammar", "unsupported_parameter"),
        ({"model": "m", "messages": MSG, "ignore_eos": True}, "ignore_eos", "unsupported_parameter"),
        ({"model": "m", "messages": MSG, "repetition_penalty": 1.2}, "repetition_penalty", "unsupported_parameter"),
        ({"model": "m", "messages": MSG, "stop_token_ids": [28]}, "stop_token_ids", "unsupported_parameter"),
        ({"model": "m", "messages": MSG, "foo": 1}, "foo", "unsupported_parameter"),
        # ... and inside known ones: the whole path is named
        ({"model": "m", "messages": MSG, "stream": True,
          "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
         "stream_options.continuous_usage_stats", "unsupported_parameter"),
        ({"model": "m", "messages": MSG, "stream": True, "stream_options": {"include_usage": "yes"}},
         "stream_options.include_usage", "invalid_value"),
        ({"model": "m", "messages": MSG, "stream": True, "stream_options": {"include_obfuscation": True}},
         "stream_options.include_obfuscation", "invalid_value"),
        ({"model": "m", "messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content",
         "missing_required_parameter"),
        ({"model": "m", "messages": MSG, "response_format": {"type": "json_object", "extra": 1}},
         "response_format.extra", "unsupported_parameter"),
        ({"model": "m", "messages": MSG, "response_format": {"type": "json_schema", "json_schema": {
            "name": "p", "schema": {"type": "object"}, "bogus": 1}}}, "response_format.json_schema.bogus",
         "unsupported_parameter"),
        ({"model": "m", "messages": MSG, "tools": [{"type": "function", "function": {"name": "f", "bogus": 1}}]},
         "tools[0].function.bogus", "unsupported_parameter"),
        ({"model": "m", "messages": [{"role": "user"}]}, "messages[0].content", "missing_required_parameter"),
        ({"model": "m", "messages": [{"role": "user", "content": []}]}, "messages[0].content",
         "missing_required_parameter"),
        ({"model": "m", "messages": [*MSG, {"role": "tool", "content": "18 C"}]}, "messages[1].tool_call_id",
         "missing_required_parameter"),
        # a result for a call no earlier assistant message made (OpenAI refuses it too)
        ({"model": "m", "messages": [*MSG, {"role": "tool", "tool_call_id": "call_9", "content": "18 C"}]},
         "messages[1].tool_call_id", "invalid_value"),
        ({"model": "m", "messages": [*MSG, {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
                                      {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function",
                                                                            "function": {"name": "f", "arguments": "{}"}}]}]},
         "messages[1].tool_call_id", "invalid_value"),
        ({"model": "m", "messages": MSG, "response_format": {"type": "xml"}}, "response_format", "invalid_value"),
        ({"model": "m", "messages": MSG, "response_format": "json"}, "response_format", "invalid_value"),
        ({"model": "m", "messages": MSG, "response_format": {"type": "json_schema"}}, "response_format",
         "invalid_value"),
        ({"model": "m", "messages": MSG, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "frobnicate"}}}}, "response_format", "invalid_value"),
        ({"model": "m", "messages": MSG, "response_format": {"type": "json_schema", "json_schema": {
            "schema": ["not", "an", "object"]}}}, "response_format", "invalid_value"),
        ({"model": "m", "messages": MSG, "presence_penalty": 2.5}, "presence_penalty", "invalid_value"),
        ({"model": "m", "messages": MSG, "frequency_penalty": -3}, "frequency_penalty", "invalid_value"),
        ({"model": "m", "messages": MSG, "logit_bias": {"a": -100}}, "logit_bias", "invalid_value"),
        ({"model": "m", "messages": MSG, "logit_bias": {"42": -101}}, "logit_bias", "invalid_value"),
        # digits str.isdigit takes and int() does not (they were a 500), and non-ASCII ones
        ({"model": "m", "messages": MSG, "logit_bias": {"\u00b2": 1}}, "logit_bias", "invalid_value"),
        ({"model": "m", "messages": MSG, "logit_bias": {"\u0661\u0662": 1}}, "logit_bias", "invalid_value"),
        ({"model": "m", "messages": MSG, "top_k": -2}, "top_k", "invalid_value"),
        ({"model": "m", "messages": MSG, "min_p": 1.5}, "min_p", "invalid_value"),
        ({"model": "m", "messages": MSG, "seed": -2}, "seed", "invalid_value"),  # -1: llama-server's random seed
        ({"model": "m", "messages": MSG, "seed": 1.5}, "seed", "invalid_value"),
        ({"model": "m", "messages": MSG, "seed": 2.0}, "seed", "invalid_value"),
        ({"model": "m", "messages": MSG, "seed": True}, "seed", "invalid_value"),
        ({"model": "m", "messages": MSG, "seed": "7"}, "seed", "invalid_value"),
        ({"model": "m", "messages": MSG, "seed": 2**63}, "seed", "invalid_value"),
        ({"model": "m", "messages": MSG, "temperature": -0.1}, "temperature", "invalid_value"),
        ({"model": "m", "messages": MSG, "temperature": "0.5"}, "temperature", "invalid_value"),
        ({"model": "m", "messages": MSG, "temperature": True}, "temperature", "invalid_value"),
        ({"model": "m", "messages": MSG, "top_p": 1.01}, "top_p", "invalid_value"),
        ({"model": "m", "messages": MSG, "max_tokens": 5.0}, "max_tokens", "invalid_value"),
        ({"model": "m", "messages": MSG, "stop": [""]}, "stop", "invalid_value"),
        ({"model": "m", "messages": MSG, "stop": ["x"] * 17}, "stop", "invalid_value"),
        ({"model": "m", "messages": MSG, "top_logprobs": 2}, "top_logprobs", "invalid_value"),
        ({"model": "m", "messages": MSG, "stream_options": {"include_usage": True}},
         "stream_options", "invalid_value"),
        ({"model": "m", "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages[0].content",
         "unsupported_content"),
    ],
)
def test_bad_requests_name_the_parameter(body: dict, param: str, code: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        parse_chat_request(body)
    err = info.value.body()["error"]
    assert (err["param"], err["code"], err["type"]) == (param, code, "invalid_request_error")
    assert info.value.status == 400


@pytest.mark.parametrize(
    ("messages", "param", "message"),
    [
        (["hi"], "messages[0]", "Input should be a JSON object"),
        ([{"role": "user", "content": 5}], "messages[0].content", "Input should be a valid string or a valid list"),
        ([{"role": "user", "content": [{"type": "text", "text": 5}]}], "messages[0].content[0].text",
         "Input should be a valid string"),
        ([{"role": "user", "content": [5]}], "messages[0].content[0]", "Input should be a JSON object"),
    ],
)
def test_a_malformed_message_is_named_where_it_went_wrong_in_words_a_client_knows(
        messages: list, param: str, message: str) -> None:
    """Content is a string or a list of parts: the error comes from inside the shape the value
    got furthest in, and never names the gateway's own classes."""
    with pytest.raises(InvalidRequestError) as info:
        parse_chat_request({"model": "m", "messages": messages})
    assert (info.value.param, info.value.message) == (param, f"invalid value for {param}: {message}")


def test_an_openai_answer_passed_back_as_history_is_accepted() -> None:
    """History is not instructions: an answer's message passed back as the SDK gives it (from
    `parse()`: `parsed`, a call's `parsed_arguments`; from its stream helper: a call's `index`;
    a reasoning server's `reasoning_content`) is read for its role, content and calls."""
    call = {"id": "call_1", "type": "function", "index": 0,
            "function": {"name": "f", "arguments": '{"a": 1}', "parsed_arguments": {"a": 1}}}
    answer = {"role": "assistant", "content": "Paris.", "refusal": None, "audio": None, "function_call": None,
              "annotations": [], "parsed": {"city": "Paris"}, "reasoning_content": "hm", "tool_calls": [call]}
    req = parse_chat_request({"model": "m", "stream": True, "stream_options": {"include_obfuscation": False},
                              "messages": [*MSG, answer, {"role": "user", "content": "And Spain?"}]})
    assert [m.content for m in req.messages][-2:] == ["Paris.", "And Spain?"]
    assert req.messages[-2].tool_calls[0]["function"] == {"name": "f", "arguments": '{"a": 1}'}


@pytest.mark.parametrize("seed", [0, 1, 2**63 - 1])
def test_seed_accepts_non_negative_64_bit_integers(seed: int) -> None:
    assert parse_chat_request({"model": "m", "messages": MSG, "seed": seed}).sampling.seed == seed


@pytest.mark.parametrize("raw", [b"{", b"[1, 2]", b"", b"nul"])
def test_malformed_json_is_400(raw: bytes) -> None:
    with pytest.raises(InvalidRequestError) as info:
        parse_json_body(raw)
    assert info.value.status == 400 and info.value.code == "invalid_json"


def test_context_budget() -> None:
    assert check_context(10, None, 100) == 90
    assert check_context(10, 5, 100) == 5
    assert check_context(10, 90, 100) == 90
    with pytest.raises(ContextLengthError) as info:
        check_context(10, 91, 100)
    assert info.value.code == "context_length_exceeded" and info.value.requested == 101
    with pytest.raises(ContextLengthError):
        check_context(100, None, 100)


@pytest.mark.parametrize("value", ["a" * 65, "has space", "dot.ted", "", "ü"])
def test_session_id_must_be_url_safe_and_short(value: str) -> None:
    with pytest.raises(InvalidRequestError):
        check_session_id(value)


def test_session_id_accepts_url_safe() -> None:
    assert check_session_id("my-Session_01") == "my-Session_01"
    assert check_session_id("a" * 64) == "a" * 64


# -- stop strings and UTF-8 ----------------------------------------------------------------


def _run_stops(pieces: list[str], stops: list[str]) -> tuple[str, bool]:
    m = StopMatcher(stops)
    out = []
    for p in pieces:
        scan = m.feed(p)
        out.append(scan.emit)
        if scan.stopped:
            return "".join(out), True
    return "".join(out) + m.flush(), False


@pytest.mark.parametrize(
    ("pieces", "stops", "text", "stopped"),
    [
        (["Hello", " world"], [], "Hello world", False),
        (["Hello", " wor", "ld"], ["world"], "Hello ", True),
        (["Hel", "lo EN", "D more"], ["END"], "Hello ", True),
        (["a<", "|", "x"], ["<|end|>"], "a<|x", False),
        (["abc"], ["b", "c"], "a", True),
        (["xENDyEN"], ["END"], "x", True),
        (["ab", "c"], ["abcd"], "abc", False),
        (["stop"], ["stop"], "", True),
    ],
)
def test_stop_matcher(pieces: list[str], stops: list[str], text: str, stopped: bool) -> None:
    assert _run_stops(pieces, stops) == (text, stopped)


def test_held_back_length() -> None:
    assert held_back_length("abc<|e", ["<|end|>"]) == 3
    assert held_back_length("abc", ["<|end|>"]) == 0
    assert held_back_length("xx", ["xxx", "x"]) == 2


def test_detokenizer_never_splits_utf8() -> None:
    pieces = {1: "é".encode()[:1], 2: "é".encode()[1:], 3: b"!", 4: "😀".encode()[:3],
              5: "😀".encode()[3:]}
    d = IncrementalDetokenizer(pieces.__getitem__)
    assert [d.feed(t) for t in (1, 2, 3, 4, 5)] == ["", "é", "!", "", "😀"]
    assert d.flush() == ""
    d2 = IncrementalDetokenizer(pieces.__getitem__)
    assert d2.feed(4) == "" and d2.flush() == "\ufffd"


@pytest.mark.parametrize(
    ("eog", "stopped", "generated", "max_tokens", "expected"),
    [(True, False, 3, 10, "stop"), (False, True, 3, 10, "stop"), (False, False, 10, 10, "length"),
     (False, False, 3, 10, None)],
)
def test_finish_reason(eog: bool, stopped: bool, generated: int, max_tokens: int,
                       expected: str | None) -> None:
    assert finish_reason_for(token_is_eog=eog, stopped=stopped, generated=generated,
                             max_tokens=max_tokens) == expected


# -- mesh view -----------------------------------------------------------------------------


def _hops(*profiles: str) -> list[Hop]:
    return [Hop(node_id=f"n{i}", activation_url="http://x", layer_start=i, layer_end=i + 1, kv_profile=p)
            for i, p in enumerate(profiles)]


@pytest.mark.parametrize(
    ("mode", "profiles", "batched"),
    [
        ("auto", ("exact", "exact"), True),
        ("auto", ("exact",), True),
        ("auto", ("exact", "default"), False),  # one default hop: its prefill is not its decode
        ("auto", ("default", "default"), False),  # a default-profile mesh: auto is decode
        ("auto", (), False),
        ("decode", ("exact", "exact"), False),
        ("decode", ("default",), False),
        ("prefill", ("default", "default"), True),
        ("prefill", ("exact",), True),
    ],
)
def test_replay_by_prefill_only_where_it_is_exact_or_asked_for(mode: str, profiles: tuple[str, ...],
                                                               batched: bool) -> None:
    assert replays_by_prefill(mode, _hops(*profiles)) is batched  # type: ignore[arg-type]


def test_a_hop_without_a_profile_is_default() -> None:
    hop = Hop.model_validate({"node_id": "n", "activation_url": "http://x", "layer_start": 0, "layer_end": 1})
    assert hop.kv_profile == "default" and not replays_by_prefill("auto", [hop])


@pytest.mark.parametrize(
    ("ranges", "n", "covers", "gaps"),
    [
        ([(0, 15), (15, 30)], 30, True, []),
        ([(0, 10), (15, 30)], 30, False, [(10, 15)]),
        ([(0, 20), (10, 30)], 30, False, []),  # overlapping shards do not chain
        ([(0, 10), (0, 20), (20, 30)], 30, True, []),
        ([(15, 30)], 30, False, [(0, 15)]),
        ([], 4, False, [(0, 4)]),
    ],
)
def test_chain_coverage(ranges: list[tuple[int, int]], n: int, covers: bool,
                        gaps: list[tuple[int, int]]) -> None:
    assert chains_exactly(ranges, n) is covers
    assert missing_ranges(ranges, n) == gaps


def _announcement(node_id: str, start: int, end: int, revision: str = "rev1"):
    from schemas.capability import CapabilityReport, ShardRange
    from schemas.node import NodeAnnouncement

    cap = CapabilityReport(
        model_arch="llama", model_name="m", model_revision=revision, runtime="llama.cpp",
        layers=ShardRange(start=start, end=end, n_layer=30), hidden_size=8, vocab_size=8,
        n_ctx=512 if start else 1024, cache_abi="abi", cache_bytes_per_token=1)
    return NodeAnnouncement(node_id=node_id, activation_url="http://x", capability=cap,
                            started_at=0.0)


def test_mesh_view_liveness_and_routability() -> None:
    from schemas.node import NodeHeartbeat

    view = MeshView(node_timeout=5.0)
    view.on_announce(_announcement("a", 0, 15), now=0.0)
    assert view.find("rev1", now=1.0) is None
    assert "missing layers [(15, 30)]" in view.unroutable_reason("rev1", now=1.0)
    view.on_announce(_announcement("b", 15, 30), now=2.0)
    found = view.find("rev1", now=3.0)
    assert found is not None and found.node_ids == ("a", "b") and found.n_ctx == 512
    view.on_heartbeat(NodeHeartbeat(node_id="b"), now=6.0)
    assert view.find("rev1", now=6.5) is None  # "a" has been silent for more than 5 s
    assert [a.node_id for a in view.live(now=6.5)] == ["b"]
    assert view.find("other", now=6.5) is None
    assert "no live node" in view.unroutable_reason("other", now=6.5)


def test_a_context_seen_once_is_not_forgotten_when_heartbeats_are_late() -> None:
    """A gateway that stood still (a long request on its loop) reads every heartbeat late: the
    context its prompts must fit stays the routes' last seen, never the larger default."""
    view = MeshView(node_timeout=5.0, default_n_ctx=8192)
    assert view.context_of("rev1", now=0.0) == 8192  # never seen: the model's own
    view.on_announce(_announcement("a", 0, 15), now=0.0)
    view.on_announce(_announcement("b", 15, 30), now=0.0)
    assert view.context_of("rev1", now=1.0) == 512
    assert view.find("rev1", now=30.0) is None and view.context_of("rev1", now=30.0) == 512


# -- telemetry -----------------------------------------------------------------------------


def test_rate_meter() -> None:
    m = RateMeter(window=4)
    assert m.rolling == 0.0 and m.average == 0.0
    for i in range(11):
        m.tick(i * 0.1)  # 10 tok/s for the first 11 tokens
    for i in range(1, 5):
        m.tick(1.0 + i * 0.05)  # then 20 tok/s
    assert m.count == 15
    assert m.rolling == pytest.approx(20.0)
    assert m.average == pytest.approx(14 / 1.2)



def test_rate_meter_counts_tokens_that_arrive_together_as_one_arrival() -> None:
    """A user probe: a speculative session's kept drafts arrive together, so 16 ticks spanned
    a fraction of a millisecond and the rolling rate read 32,000-83,000 tok/s."""
    m = RateMeter()
    for trip in range(40):  # 9 tokens a trip (8 kept drafts and one more), a trip every 0.1 s
        for i in range(9):
            m.tick(trip * 0.1 + i * 1e-5)
    assert m.rolling == pytest.approx(90.0, rel=0.01)
    assert m.average == pytest.approx((40 * 9 - 1) / (39 * 0.1 + 8e-5), rel=0.01)


def test_emit_throttle_rules() -> None:
    assert should_emit(phase_changed=True, phase="decode", now=0.01, last_emit=0.0, min_interval=1)
    assert should_emit(phase_changed=False, phase="prefill", now=0.01, last_emit=0.0, min_interval=1)
    assert not should_emit(phase_changed=False, phase="decode", now=0.5, last_emit=0.0,
                           min_interval=1)
    assert should_emit(phase_changed=False, phase="decode", now=1.0, last_emit=0.0, min_interval=1)
    assert not bus_should_publish(phase_changed=False, phase="decode", now=0.1, last=0.0,
                                  interval=0.25)
    assert bus_should_publish(phase_changed=True, phase="decode", now=0.1, last=0.0, interval=0.25)
    assert bus_should_publish(phase_changed=False, phase="decode", now=0.1, last=None,
                              interval=0.25)


async def test_hub_follow_replay_and_end() -> None:
    sunk = []
    hub = TelemetryHub(HubLimits(min_decode_interval=0.0), sink=lambda e, ch: sunk.append(e))
    t = hub.open("s1", "m")
    t.set_phase("routing")
    t.routed("r1", ["a", "b"])
    t.set_phase("prefill")
    t.prefill_progress(4, 8)
    t.prefill_progress(8, 8)
    t.set_phase("decode")
    record = hub.get("s1")
    assert record is not None
    seen = []

    async def follow(after: int) -> None:
        async for ev in hub.follow(record, after, keepalive=5.0):
            assert ev is not None
            seen.append(ev)

    task = asyncio.create_task(follow(2))
    await asyncio.sleep(0)
    for _ in range(3):
        t.token()
    t.complete("stop")
    await asyncio.wait_for(task, 5)  # the follower ends by itself after `completed`
    assert [e.seq for e in seen] == list(range(3, 3 + len(seen)))
    assert [e.phase for e in seen][:3] == ["prefill", "prefill", "prefill"]
    assert seen[-1].phase == "completed" and seen[-1].finish_reason == "stop"
    assert seen[-1].generated_tokens == 3 and seen[-1].route_nodes == ["a", "b"]
    assert [e.seq for e in sunk] == list(range(1, seen[-1].seq + 1))
    with pytest.raises(SessionConflictError) as exc:
        hub.open("s1", "m")
    assert "finished session" in exc.value.message  # the id is held by the finished session's telemetry
    hub.open("s2", "m")
    with pytest.raises(SessionConflictError) as exc:
        hub.open("s2", "m")
    assert exc.value.message.endswith("is already in use")


async def test_hub_waits_for_unknown_session_and_bounds_history() -> None:
    hub = TelemetryHub(HubLimits(session_history=3, max_finished=1, retention_seconds=60))
    waiter = asyncio.create_task(hub.wait_for("later", wait=5.0))
    await asyncio.sleep(0)
    t = hub.open("later", "m")
    record = await waiter
    assert record is not None and record.telemetry is t
    assert await hub.wait_for("never", wait=0.01) is None
    for phase in ("routing", "prefill", "decode", "finalizing"):
        t.set_phase(phase)  # type: ignore[arg-type]
    assert [e.seq for e in record.history] == [3, 4, 5]
    t.fail("boom")
    hub.open("other", "m").fail("x", last_phase="routing")
    assert hub.prune() == 1  # only one finished session is kept
    assert hub.get("later") is None and hub.get("other") is not None
    assert hub.get("other").latest.last_phase == "routing"
    assert hub.prune(now=10**9) == 1  # retention time passed


# -- metrics and chunk shapes ----------------------------------------------------------------


def test_metrics_exposition() -> None:
    m = GatewayMetrics()
    m.ttft.observe(0.03)
    m.ttft.observe(3.0)
    m.generated_tokens.inc(5)
    m.failures.inc(phase="decode")
    m.active.value = 2
    text = m.render()
    assert 'meshnet_gateway_time_to_first_token_seconds_bucket{le="0.05"} 1' in text
    assert 'meshnet_gateway_time_to_first_token_seconds_bucket{le="+Inf"} 2' in text
    assert "meshnet_gateway_time_to_first_token_seconds_count 2" in text
    assert "meshnet_gateway_generated_tokens_total 5" in text
    assert 'meshnet_gateway_session_failures_total{phase="decode"} 1' in text
    assert "meshnet_gateway_active_sessions 2" in text
    assert text.endswith("\n")


def test_chunk_shapes() -> None:
    f = ChunkFactory("chatcmpl-x", 1, "m", include_usage=True)
    first = f.delta(role=True, content="")
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert first["usage"] is None and first["object"] == "chat.completion.chunk"
    last = f.usage(Usage(3, 4))
    assert last["choices"] == [] and last["usage"]["total_tokens"] == 7
    plain = ChunkFactory("chatcmpl-x", 1, "m").delta(content="a")
    assert "usage" not in plain
    assert sse_data("[DONE]") == b"data: [DONE]\n\n"


def test_a_fill_in_the_middle_prompt_is_prefix_suffix_middle_as_llama_server_infill() -> None:
    from gateway.tokenizer import fim_prompt

    assert fim_prompt([5, 6], [7], (1, 2, 3), bos=0) == [0, 1, 5, 6, 2, 7, 3]
    assert fim_prompt([5], [], (1, 2, 3), bos=None) == [1, 5, 2, 3]


def test_legacy_logprobs_text_offsets_count_characters_not_tokens() -> None:
    """/v1/completions' `text_offset`: where each token's text begins in the choice's text. A
    character split across two tokens (the euro sign's three bytes) begins at the first of
    them, and only the token that ends it moves the offset on; streamed in pieces or at once."""
    raws = [b"a", b"\xe2\x82", b"\xac", b"b"]
    items = [TokenLogprob(token=r.decode(errors="replace"), logprob=-0.5, raw=r) for r in raws]
    text = b"".join(raws).decode()  # "a€b"
    fmt = TextFormat("cmpl-x", 0, "m", echo="Hi ")
    body = fmt.body(text, "stop", Usage(1, 4), items)
    assert body["choices"][0]["text"] == "Hi a€b"
    assert body["choices"][0]["logprobs"]["text_offset"] == [3, 4, 4, 5]
    streamed = TextFormat("cmpl-x", 0, "m", echo="Hi ")
    streamed.opening()
    chunks = [streamed.delta(t, [i]) for t, i in zip(["a", "", "€", "b"], items, strict=True)]
    assert [c[0]["choices"][0]["logprobs"]["text_offset"] for c in chunks] == [[3], [4], [4], [5]]


def test_legacy_top_logprobs_always_hold_the_chosen_token() -> None:
    """A sampled token outside the top N is still in its `top_logprobs` (N + 1 entries)."""
    picked = TokenLogprob(token=" is", logprob=-3.91, raw=b" is", top=[("-", -0.78, b"-")])
    greedy = TokenLogprob(token="-", logprob=-0.78, raw=b"-", top=[("-", -0.78, b"-")])
    body = TextFormat("cmpl-x", 0, "m").body(" is-", "length", Usage(1, 2), [picked, greedy])
    assert body["choices"][0]["logprobs"]["top_logprobs"] == [{"-": -0.78, " is": -3.91}, {"-": -0.78}]


def test_speculation_is_on_unless_the_body_or_the_header_turns_it_off() -> None:
    from gateway.chat_request import speculative_wanted
    from gateway.errors import InvalidRequestError

    assert speculative_wanted(None, None) is True
    assert speculative_wanted(None, "off") is False and speculative_wanted(None, " ON ") is True
    assert speculative_wanted(True, "off") is True and speculative_wanted(False, "on") is False  # the body wins
    with pytest.raises(InvalidRequestError) as exc:
        speculative_wanted(None, "maybe")
    assert exc.value.param == "x-meshnet-speculative"
    # the message names every value the header takes (it said "on or off" though "false" works)
    assert "true/false, 1/0" in str(exc.value) and speculative_wanted(None, "FALSE") is False


@pytest.mark.parametrize("switch, header", [("speculative_wanted", "x-meshnet-speculative"),
                                            ("validate_flagged", "x-meshnet-validate")])
def test_a_bad_switch_header_is_a_400_even_where_the_body_field_wins(switch: str, header: str) -> None:
    """`"speculative": false` with `x-meshnet-speculative: yes` was a 200 that never read the
    header: the body wins, but a header value no switch takes is still named in a 400."""
    import gateway.chat_request as chat_request
    from gateway.errors import InvalidRequestError

    wanted = getattr(chat_request, switch)
    for body in (True, False):
        with pytest.raises(InvalidRequestError) as exc:
            wanted(body, "yes")
        assert exc.value.param == header
        assert wanted(body, "off") is body and wanted(body, None) is body
    with pytest.raises(InvalidRequestError):
        chat_request.restart_wanted(False, "sometimes", True)


def test_a_labelled_counter_has_no_series_before_its_first_label() -> None:
    """An unlabelled `meshnet_gateway_requests_total 0` beside the labelled series is a series
    of its own to a scraper; a counter without labels still shows its 0."""
    from gateway.metrics import Counter

    assert Counter("x_total", "h", labelled=True).render() == ["# HELP x_total h", "# TYPE x_total counter"]
    assert Counter("y_total", "h").render()[-1] == "y_total 0"


def test_a_node_that_announces_it_is_leaving_is_no_longer_live() -> None:
    """A node stopped cleanly (Ctrl-C) announces `leaving`: the gateway took that for a fresh
    announcement and kept it live (in /healthz's nodes and routable models) until its heartbeats
    timed out. A leaving message of an older process of the same id removes nothing."""
    view = MeshView(node_timeout=5.0)
    view.on_announce(_announcement("a", 0, 30), now=0.0)
    older = _announcement("a", 0, 30).model_copy(update={"leaving": True, "started_at": -1.0})
    view.on_announce(older, now=0.5)
    assert [a.node_id for a in view.live(now=1.0)] == ["a"]
    view.on_announce(_announcement("a", 0, 30).model_copy(update={"leaving": True}), now=1.0)
    assert view.live(now=1.5) == [] and view.find("rev1", now=1.5) is None


@pytest.mark.parametrize(("field", "value"), [("user", 5), ("safety_identifier", ["x"]), ("prompt_cache_key", True),
                                              ("metadata", "k=v"), ("metadata", {"k": 1}),
                                              ("metadata", {f"k{i}": "v" for i in range(17)}),
                                              ("metadata", {"k" * 65: "v"}), ("metadata", {"k": "v" * 513})])
def test_caller_metadata_of_the_wrong_type_is_a_400_naming_it(field: str, value: object) -> None:
    """`"user": 5` or `"metadata": "k=v"` were answered as if well formed (the OpenAI API answers
    a 400); both endpoints now refuse them, naming the field, and still take well-formed ones."""
    good = {"user": "u", "safety_identifier": "s", "prompt_cache_key": "p", "metadata": {"k": "v"}}
    assert parse_chat_request({"model": "m", "messages": MSG, **good}).model == "m"
    assert parse_completion_request({"model": "m", "prompt": "a", **good}).prompt == "a"
    for parse, body in ((parse_chat_request, {"model": "m", "messages": MSG}),
                        (parse_completion_request, {"model": "m", "prompt": "a"})):
        with pytest.raises(InvalidRequestError) as info:
            parse({**body, field: value})
        assert (info.value.param, info.value.code) == (field, "invalid_value")


def test_a_small_context_replica_does_not_shrink_the_mesh_context() -> None:
    """A user probe: a tail replica started with --ctx 256 beside a 2048 head and tail; every
    prompt over 256 tokens was refused ('maximum context length is 256 tokens') although the
    2048 chain serves it. The mesh's context is its widest chain's: 2048; a chain's is its
    smallest hop's."""
    view = MeshView(node_timeout=5.0)
    for node_id, start, end, n_ctx in (("h", 0, 15, 2048), ("t", 15, 30, 2048), ("small", 15, 30, 256)):
        a = _announcement(node_id, start, end)
        view.on_announce(a.model_copy(update={"capability": a.capability.model_copy(update={"n_ctx": n_ctx})}),
                         now=0.0)
    assert view.context_of("rev1", now=1.0) == 2048
    view.on_announce(_announcement("h2", 0, 15).model_copy(), now=0.0)  # a head of 1024 (_announcement's)
    assert view.context_of("rev1", now=1.0) == 2048  # h + t still chain at 2048


def test_a_held_node_is_waited_for_as_long_as_its_hold_from_when_the_ask_began() -> None:
    """gateway/held_wait.py: a `no_coverage` naming nodes the tracker holds out is asked again
    for the hold left and LOST_NODE_WAIT_S more, counted from when the ask began (a request
    queued behind others does not wait the whole time again); a longer hold, a plain
    `no_coverage` or another refusal is not waited for."""
    now = [100.0]
    wait = HeldWait(clock=lambda: now[0])

    def held(s: float, nodes: tuple[str, ...] = ("n1",), code: str = "no_coverage") -> RouteUnavailableError:
        return RouteUnavailableError("gap", code=code, held_nodes=nodes, held_s=s)

    assert held_wait_s(held(0.0)) == LOST_NODE_WAIT_S and held_wait_s(held(HELD_WAIT_MAX_S)) is not None
    assert held_wait_s(held(HELD_WAIT_MAX_S + 0.1)) is None  # a third loss within 10 minutes: no wait
    assert held_wait_s(held(0.0, ())) is None and held_wait_s(held(0.0, code="no_capacity")) is None
    # a restart's ask that may take its lost hop again waits for it whatever the tracker says (expired, say)
    assert held_wait_s(held(0.0, ()), lost="n1") == LOST_NODE_WAIT_S
    now[0] = 102.0  # queued 2 s before its first ask
    assert wait.waits(held(1.0))  # deadline 100 + 1 + 5
    now[0] = 105.9
    assert wait.waits(held(0.0))
    now[0] = 106.0
    assert not wait.waits(held(0.0))
