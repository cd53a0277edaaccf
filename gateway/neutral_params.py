"""Parameters of other servers' APIs the gateway does not implement, and the values at which each
changes nothing (pure). At such a value a parameter is honoured by ignoring it; at any other it is
a 400 naming it (chat_request.check_honoured). Clients of llama-server (its web UI among them) and
of vLLM send many of these at their off value with every request.

Two kinds (llama-server's `samplers`, its sampler order, is honoured: gateway/sampler_order.py):
- NEUTRAL: a value that is the parameter's own "off" (`typical_p` 1, `mirostat` 0, vLLM's
  `skip_special_tokens` true, which is what this gateway does: special tokens render as nothing).
- TUNING: a parameter that only tunes another one (`mirostat_tau` tunes `mirostat`): any value of
  its type changes nothing while every parameter it tunes is off in the request.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

Check = Callable[[Any, Mapping[str, Any]], bool]


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _equals(x: float) -> Check:
    return lambda v, _data: _number(v) and v == x


def _is(x: bool) -> Check:
    return lambda v, _data: v is x


def _number_of(data: Mapping[str, Any], name: str, default: float) -> float:
    """A sampling parameter's value as this request sets it (default: not set, or not a number,
    which the request's validation refuses later)."""
    v = data.get(name)
    return float(v) if _number(v) else default


# the value at which each parameter that turns something on is off (both this gateway's own and
# the ones it does not implement): a TUNING parameter changes nothing while all it tunes are off
OFF: dict[str, float] = {
    "mirostat": 0, "dynatemp_range": 0, "xtc_probability": 0, "dry_multiplier": 0, "repeat_penalty": 1,
    "presence_penalty": 0, "frequency_penalty": 0,
}


def _off(name: str, data: Mapping[str, Any]) -> bool:
    return data.get(name) is None or _number_of(data, name, OFF[name] + 1) == OFF[name]


def _tunes(*switches: str, kind: Callable[[Any], bool] = _number) -> Check:
    return lambda v, data: kind(v) and all(_off(s, data) for s in switches)


def _integer(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _strings(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(s, str) for s in v)


NEUTRAL: dict[str, Check] = {
    # OpenAI's older or other parameters
    "functions": lambda v, _d: v == [],
    "function_call": lambda v, _d: v == "none",
    "prediction": lambda v, _d: False,
    "audio": lambda v, _d: False,
    "modalities": lambda v, _d: v == ["text"],
    "store": _is(False),  # true asks for the answer to be kept for a later GET: nothing keeps it
    "service_tier": lambda v, _d: v in ("auto", "default"),  # one tier here: "flex" or "priority" would not be
    # llama-server's (tools/server/README.md, POST /completion), each at its documented "disabled"
    "repeat_penalty": _equals(1),
    "typical_p": _equals(1),
    "typ_p": _equals(1),  # the web UI's spelling of typical_p
    "mirostat": _equals(0),
    "dynatemp_range": _equals(0),
    "xtc_probability": _equals(0),
    "dry_multiplier": _equals(0),
    "top_n_sigma": _equals(-1),
    "n_probs": _equals(0),
    "min_keep": _equals(0),
    "id_slot": _equals(-1),
    "ignore_eos": _is(False),  # vLLM's too
    "timings_per_token": _is(False),  # true asks for `timings` in each chunk: none are sent
    "return_progress": _is(False),  # (/v1/completions: true asks for `prompt_progress` chunks, sent on chat only)
    "return_tokens": _is(False),
    "post_sampling_probs": _is(False),
    "backend_sampling": _is(False),
    "grammar": lambda v, _d: v == "",
    # the model's thoughts stay in the content, as here; "auto" splits them out only for a chat template
    # with thinking markers (THINKING_MARKERS), which a chat request's prompt encoding refuses then
    "reasoning_format": lambda v, _d: v in ("none", "auto"),
    "chat_template_kwargs": lambda v, _d: v == {},  # (vLLM's too) no variable for the template
    # prompt reuse across requests: this gateway's hops reuse a shared prefix only where the KV is
    # bit-identical (nodes/shared_prefix.py), so neither value changes an answer
    "cache_prompt": lambda v, _d: isinstance(v, bool),
    # vLLM's (SamplingParams, extra fields of its OpenAI server), each at its default
    "repetition_penalty": _equals(1),
    "min_tokens": _equals(0),
    "skip_special_tokens": _is(True),  # special tokens render as nothing here
    "spaces_between_special_tokens": _is(True),
    "include_stop_str_in_output": _is(False),
    "stop_token_ids": lambda v, _d: v == [],
    "use_beam_search": _is(False),
    "length_penalty": _equals(1),
    "add_generation_prompt": _is(True),  # the chat template always opens the assistant's turn here
    "continue_final_message": _is(False),
    "echo": _is(False),  # (chat: vLLM's echo of the last message; /v1/completions has its own echo)
}

TUNING: dict[str, Check] = {
    "mirostat_tau": _tunes("mirostat"),
    "mirostat_eta": _tunes("mirostat"),
    "dynatemp_exponent": _tunes("dynatemp_range"),
    "xtc_threshold": _tunes("xtc_probability"),
    "dry_base": _tunes("dry_multiplier"),
    "dry_allowed_length": _tunes("dry_multiplier", kind=_integer),
    "dry_penalty_last_n": _tunes("dry_multiplier", kind=_integer),
    "dry_sequence_breakers": _tunes("dry_multiplier", kind=_strings),
    # llama-server's penalty window (the last n tokens, the prompt's among them): this gateway's
    # presence and frequency penalties count every generated token and no prompt token
    "repeat_last_n": _tunes("repeat_penalty", "presence_penalty", "frequency_penalty", kind=_integer),
}

# what marks a chat template that lets a model think (llama.cpp's chat parsers split these out
# under reasoning_format "auto"): DeepSeek-R1, Qwen3 and others' <think>, gpt-oss's channels,
# Magistral's [THINK], Command R7B's thinking tokens, Seed-OSS's, and any template that renders
# an earlier turn's reasoning_content
THINKING_MARKERS = ("<think>", "<|channel|>", "[THINK]", "<|START_THINKING|>", "<seed:think>", "reasoning_content")


def thinks(template_source: str) -> bool:
    """Whether a chat template has thinking markers (pure): reasoning_format "auto" would then
    split the model's thoughts into reasoning_content, which this gateway does not do."""
    return any(m in template_source for m in THINKING_MARKERS)


def neutral(param: str, value: Any, data: Mapping[str, Any]) -> bool | None:
    """Whether `param`, which the gateway does not implement, changes nothing at `value` in this
    request (None: the gateway does not know the parameter at all)."""
    check = NEUTRAL.get(param) or TUNING.get(param)
    return None if check is None else check(value, data)
