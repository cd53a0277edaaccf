"""Tool calls (gateway/tool_calls.py): the request's tools, each dialect's prompt and parsing,
the constraint of a forced call, and the answers' shape, streamed and whole (pure; the real
mesh's tool calls are in tests/test_gateway_e2e.py)."""

from __future__ import annotations

import json
from typing import Any

import llguidance
import pytest

from gateway.chat_template import ChatTemplate
from gateway.errors import InvalidRequestError
from gateway.openai_format import ChatFormat, ChunkFactory, TokenLogprob, Usage
from gateway.tool_calls import (
    FALLBACK_KEY,
    MAX_PARALLEL_CALLS,
    Hermes,
    JsonFallback,
    Llama3,
    Mistral,
    Tool,
    ToolCallFormat,
    ToolRequest,
    call_schema,
    calls_schema,
    dialect_for,
    parse_tools,
)
from schemas.output_constraint import grammar_of

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
# a Qwen-2.5-like template: it renders `tools`, and calls and results in its own markup
HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>\n"
    "Answer with <tool_call>{...}</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n"
    "{% for c in m.tool_calls %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
HISTORY = [{"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": "", "tool_calls": [
               {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]


def test_tools_and_tool_choice_parse_into_what_the_model_is_asked_for() -> None:
    req = parse_tools([WEATHER, TIME], None, None)
    assert req is not None and req.choice == "auto" and not req.forced and req.parallel
    assert [t.name for t in req.offered] == ["get_weather", "get_time"]
    named = parse_tools([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}}, False)
    assert named is not None and named.forced and [t.name for t in named.offered] == ["get_time"] and not named.parallel
    name_time = {"type": "function", "function": {"name": "get_time"}}
    assert not parse_tools([WEATHER, TIME], name_time, None).parallel  # type: ignore[union-attr]  # one call ...
    assert parse_tools([WEATHER, TIME], name_time, True).parallel  # type: ignore[union-attr]  # ... unless asked
    assert parse_tools([WEATHER, TIME], "required", None).parallel  # type: ignore[union-attr]
    assert parse_tools([WEATHER], "none", None) is None and parse_tools(None, None, None) is None
    with pytest.raises(InvalidRequestError) as err:
        parse_tools([WEATHER, WEATHER], None, None)
    assert err.value.param == "tools"


@pytest.mark.parametrize(("tools", "choice", "parallel", "param"), [
    (None, None, "yes", "parallel_tool_calls"),  # malformed without tools too
    ([WEATHER], None, "yes", "parallel_tool_calls"),
    ([WEATHER], {"type": "custom", "function": {"name": "get_weather"}}, None, "tool_choice"),
    ([WEATHER], {"type": "function", "function": {"name": "get_weather"}, "extra": 1}, None, "tool_choice.extra"),
    ([WEATHER], {"type": "function", "function": {"name": "get_weather", "bogus": 1}}, None,
     "tool_choice.function.bogus"),
    ([{"type": "function", "function": {"name": "f", "description": 5}}], None, None, "tools[0].function.description"),
])
def test_malformed_tool_parameters_are_400s_naming_them(tools: Any, choice: Any, parallel: Any, param: str) -> None:
    """Never read as something else, nor dropped (before: these were accepted, a `custom`
    tool_choice read as a function's, a non-string description left out of the prompt)."""
    with pytest.raises(InvalidRequestError) as err:
        parse_tools(tools, choice, parallel)
    assert err.value.param == param


def test_the_fallback_describes_the_tools_and_renders_calls_and_results_as_text() -> None:
    req = parse_tools([WEATHER], "auto", None)
    messages, variables = JsonFallback().render(HISTORY, req)
    assert variables == {} and messages[0]["role"] == "system" and "get_weather" in messages[0]["content"]
    assert json.loads(messages[2]["content"]) == {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}
    assert messages[3] == {"role": "user", "content": "Result of the tool call get_weather (call_1):\n18 C, sunny"}
    text, calls = JsonFallback().parse('{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]}', req)
    assert text is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"})]
    assert JsonFallback().parse('{"tool_calls": [{"name": "nope", "arguments": {}}]}', req)[1] == []
    assert JsonFallback().parse("It is sunny.", req) == ("It is sunny.", [])


def test_hermes_templates_render_tools_themselves_and_answer_in_tool_call_blocks() -> None:
    assert isinstance(dialect_for(HERMES_TEMPLATE), Hermes) and isinstance(dialect_for("{{ messages }}"), JsonFallback)
    req = parse_tools([WEATHER], "auto", None)
    messages, variables = Hermes().render(HISTORY, req)
    prompt = ChatTemplate(HERMES_TEMPLATE, "", "").render(messages, variables=variables)
    assert '"name": "get_weather"' in prompt and '"arguments": {"city": "Paris"}' in prompt
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in prompt
    answer = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    text, calls = Hermes().parse(answer, req)
    assert text == "Let me look." and calls[0].name == "get_weather" and json.loads(calls[0].arguments) == {"city": "Rome"}
    assert Hermes().sendable("Let me look.\n<tool") == len("Let me look.\n")
    assert Hermes().sendable("a < b") == len("a < b")


def test_llama3_and_mistral_answers_are_read_as_calls() -> None:
    assert isinstance(dialect_for("{{ '<|python_tag|>' }}"), Llama3) and isinstance(dialect_for("[TOOL_CALLS]"), Mistral)
    req = parse_tools([WEATHER, TIME], "auto", None)
    text, calls = Llama3().parse('<|python_tag|>{"name": "get_time", "parameters": {"zone": "CET"}}', req)
    assert text is None and (calls[0].name, json.loads(calls[0].arguments)) == ("get_time", {"zone": "CET"})
    assert Llama3().parse("The time is noon.", req) == ("The time is noon.", [])
    assert Llama3().sendable('{"na') == 0 and Llama3().sendable("Sure") == 4
    text, calls = Mistral().parse('Checking.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Nice"}}]', req)
    assert text == "Checking." and calls[0].name == "get_weather"
    assert Mistral().sendable("Checking.[TOOL") == len("Checking.")


@pytest.mark.parametrize("dialect", [JsonFallback(), Hermes(), Llama3(), Mistral()])
def test_a_forced_call_is_constrained_to_a_valid_call_of_the_offered_tools(dialect) -> None:
    for parallel in (False, True):
        req = ToolRequest((Tool("get_weather", "", WEATHER["function"]["parameters"]),), "required", parallel=parallel)
        constraint = dialect.constraint(req)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar_of(constraint))
        assert not is_error, messages
    assert dialect.constraint(ToolRequest(req.tools, "auto")) is None


ORDER = {"type": "object", "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/Item"}}},
         "required": ["items"], "$defs": {"Item": {"type": "object", "properties": {
             "sku": {"type": "string"}, "qty": {"type": "integer"}}, "required": ["sku", "qty"]}}}
TREE = {"type": "object", "properties": {"name": {"type": "string"}, "children": {
    "type": "array", "items": {"$ref": "#"}}, "label": {"$ref": "#/properties/name"},
    "kind": {"$ref": "#/definitions/Item"}, "note": {"const": {"$ref": "#"}}}, "required": ["name"],
    "definitions": {"Item": {"type": "string"}}}  # refers to itself and into itself (as zod does), the older section


@pytest.mark.parametrize("dialect", [JsonFallback(), Hermes(), Llama3(), Mistral()])
def test_a_tool_whose_parameters_refer_to_their_own_definitions_is_constrained(dialect) -> None:
    """`openai.pydantic_function_tool` gives nested models as `#/$defs/...`: in the call's schema
    they must resolve to the tool's own definitions (two tools may both name an `Item`). Before,
    the grammar compiler looked them up at the call schema's root and refused the session."""
    other = {**ORDER, "$defs": {"Item": {"type": "string"}}}
    tools = (Tool("place_order", "", ORDER), Tool("other", "", other), Tool("tree", "", TREE))
    for parallel in (False, True):
        constraint = dialect.constraint(ToolRequest(tools, "required", parallel=parallel))
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar_of(constraint))
        assert not is_error, messages
    one = call_schema(tools)
    assert one["anyOf"][0]["properties"]["arguments"]["properties"]["items"]["items"] == {"$ref": "#/$defs/tool0_Item"}
    assert one["$defs"]["tool0_Item"] == ORDER["$defs"]["Item"] and one["$defs"]["tool1_Item"] == {"type": "string"}
    tree = one["$defs"]["tool2"]["properties"]
    assert tree["children"]["items"] == {"$ref": "#/$defs/tool2"} and tree["label"] == {"$ref": "#/$defs/tool2/properties/name"}
    assert tree["kind"] == {"$ref": "#/$defs/tool2_definitions_Item"} and tree["note"] == {"const": {"$ref": "#"}}


def _fmt(dialect, req: ToolRequest) -> ToolCallFormat:
    return ToolCallFormat(ChatFormat(ChunkFactory("chatcmpl-x", 1, "m")), dialect, req)


def test_streamed_calls_are_held_back_and_sent_as_tool_call_chunks() -> None:
    req = parse_tools([WEATHER], "auto", None)
    fmt = _fmt(JsonFallback(), req)
    call = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]}'
    assert all(fmt.delta(call[i:i + 5], None) == [] for i in range(0, len(call), 5))
    chunks = fmt.finish("stop")
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0]["tool_calls"][0]["index"] == 0 and deltas[0]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert json.loads(deltas[0]["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    plain = _fmt(JsonFallback(), req)
    assert plain.delta("Hello", None)[0]["choices"][0]["delta"]["content"] == "Hello"
    assert [c["choices"][0]["finish_reason"] for c in plain.finish("stop")] == ["stop"]
    # text that looked like a call but is not one goes out as text at the end
    odd = _fmt(JsonFallback(), req)
    assert odd.delta('{"tool_calls": 3}', None) == [] and FALLBACK_KEY in odd.text
    assert odd.finish("stop")[0]["choices"][0]["delta"]["content"] == '{"tool_calls": 3}'


def test_a_cut_off_call_list_gives_its_complete_calls_and_never_the_wrapper_as_text() -> None:
    """max_tokens or a stop string may cut a forced answer inside its call list: the calls it
    completed are the answer, the unfinished rest is dropped, the wrapper is never content."""
    req = parse_tools([WEATHER], "required", True)
    one = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    cut = '{"tool_calls": [' + one + ", " + one.replace("Paris", "Rome") + ', {"name": "get'
    text, calls = JsonFallback().parse(cut, req)
    assert text is None and [json.loads(c.arguments)["city"] for c in calls] == ["Paris", "Rome"]
    assert JsonFallback().parse('{"tool_calls": [{"name": "get', req) == (None, [])
    body = _fmt(JsonFallback(), req).body('{"tool_calls": [{"name": "get', "length", Usage(3, 4), None)
    assert body["choices"][0]["message"]["content"] == "" and body["choices"][0]["finish_reason"] == "length"
    streamed = _fmt(JsonFallback(), req)
    assert streamed.delta('{"tool_calls": [{"name": "get', None) == []
    assert [c["choices"][0]["delta"] for c in streamed.finish("length")][-1] == {}
    assert all("content" not in c["choices"][0]["delta"] for c in streamed.finish("length"))
    # a stop string cuts it as max_tokens does (finish_reason "stop", Finished.cut)
    body = _fmt(JsonFallback(), req).body('{"tool_calls": [{"name": "get', "stop", Usage(3, 4), None, cut=True)
    assert body["choices"][0]["message"]["content"] == "" and body["choices"][0]["finish_reason"] == "stop"
    streamed = _fmt(JsonFallback(), req)
    assert streamed.delta('{"tool_calls": [{"name": "get', None) == []
    assert all("content" not in c["choices"][0]["delta"] for c in streamed.finish("stop", cut=True))
    assert calls_schema(req)["maxItems"] == MAX_PARALLEL_CALLS  # a forced answer cannot repeat a call forever


def test_a_whole_answer_carries_message_tool_calls() -> None:
    req = parse_tools([WEATHER], "required", None)
    body = _fmt(Hermes(), req).body('<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>',
                                    "stop", Usage(3, 4), None)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert choice["message"]["tool_calls"][0]["id"].startswith("call_")


def test_a_whole_answers_logprobs_leave_its_calls_out() -> None:
    """OpenAI gives logprobs only for the content: the tokens of a call's markup are left out."""
    req = parse_tools([WEATHER], "auto", None)
    pieces = ["Sure", ". ", '<tool_call>{"name": "get_weather", ', '"arguments": {"city": "Oslo"}}</tool_call>']
    lps = [TokenLogprob(token=p, logprob=-0.1, raw=p.encode()) for p in pieces]
    body = _fmt(Hermes(), req).body("".join(pieces), "stop", Usage(3, 4), lps)
    choice = body["choices"][0]
    assert choice["message"]["tool_calls"] and choice["message"]["content"].startswith("Sure")
    assert choice["message"]["content"] == "Sure."
    assert [c["token"] for c in choice["logprobs"]["content"]] == ["Sure", ". "]
    only_call = _fmt(Hermes(), req).body("".join(pieces[2:]), "stop", Usage(3, 2), lps[2:])
    assert only_call["choices"][0]["logprobs"]["content"] == []
    after = [*pieces[2:], " Done", " now"]  # content after the call: the markup's logprobs never stand in for it
    lps_after = [TokenLogprob(token=p, logprob=-0.1, raw=p.encode()) for p in after]
    late = _fmt(Hermes(), req).body("".join(after), "stop", Usage(3, 4), lps_after)["choices"][0]
    assert late["message"]["content"] == "Done now" and late["logprobs"]["content"] == []
    spaced = ["\n\n", "Sure", ".", *pieces[2:]]
    lps_spaced = [TokenLogprob(token=p, logprob=-0.1, raw=p.encode()) for p in spaced]
    lead = _fmt(Hermes(), req).body("".join(spaced), "stop", Usage(3, 5), lps_spaced)["choices"][0]
    assert [c["token"] for c in lead["logprobs"]["content"]] == ["\n\n", "Sure", "."]
    with pytest.raises(InvalidRequestError) as err:
        parse_tools([{"type": "function", "function": {"name": "f", "bogus": 1}}], None, None)
    assert err.value.param == "tools[0].function.bogus" and err.value.code == "unsupported_parameter"
    bare = parse_tools([{"type": "function", "function": {"name": "f", "strict": True}}], "required", None)
    assert bare is not None and bare.offered[0].parameters == {"type": "object", "properties": {},
                                                                "additionalProperties": False}


def test_markup_the_model_ended_that_is_no_call_is_text_with_its_logprobs() -> None:
    """A user probe: the model wrote `{"tool_calls": [... {<the arguments>}}]}` and stopped.
    That is no call, so the answer is the text as written (as vLLM does), streamed or whole,
    with the logprobs of its tokens; before, it was "" with the markup's logprobs."""
    req = parse_tools([WEATHER], "auto", None)
    pieces = ['{"tool_calls": [{"name": "get_weather", ', '"arguments": {<the arguments>}}]}']
    text = "".join(pieces)
    lps = [TokenLogprob(token=p, logprob=-0.1, raw=p.encode()) for p in pieces]
    body = _fmt(JsonFallback(), req).body(text, "stop", Usage(3, 2), lps)
    choice = body["choices"][0]
    assert choice["message"]["content"] == text and "tool_calls" not in choice["message"]
    assert [c["token"] for c in choice["logprobs"]["content"]] == pieces
    streamed = _fmt(JsonFallback(), req)
    assert all(streamed.delta(p, [lp]) == [] for p, lp in zip(pieces, lps, strict=True))  # held while it may be a call
    chunks = streamed.finish("stop")
    assert chunks[0]["choices"][0]["delta"]["content"] == text
    assert [c["token"] for c in chunks[0]["choices"][0]["logprobs"]["content"]] == pieces
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    # cut off by max_tokens: still never the wrapper, and no logprobs for it
    cut = _fmt(JsonFallback(), req).body('{"tool_calls": [{"name": "get', "length", Usage(3, 2), lps[:1])
    assert cut["choices"][0]["message"]["content"] == "" and cut["choices"][0]["logprobs"]["content"] == []


def test_a_template_without_a_system_role_gets_the_tools_in_the_first_user_turn(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A template that raises on a system message (Mistral's first, Gemma's) answered a request
    with tools and no system message 'chat template error: no system role': the JSON fallback
    had added one. The description now goes into the first user turn; a system message the
    client sent is still the template's error."""
    import gguf

    from gateway.api_chat import _encode_chat
    from gateway.chat_request import parse_chat_request
    from gateway.chat_template import TemplateError
    from gateway.tokenizer import ModelTokenizer
    from tests.fixtures.tiny_gguf import write_tiny_model

    template = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
                "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    real = gguf.GGUFWriter.add_tokenizer_model

    def with_template(self, model: str) -> None:  # type: ignore[no-untyped-def]
        real(self, model)
        self.add_chat_template(template)

    gguf.GGUFWriter.add_tokenizer_model = with_template
    try:
        path = write_tiny_model(tmp_path / "nosys.gguf", "llama")
    finally:
        gguf.GGUFWriter.add_tokenizer_model = real
    tok = ModelTokenizer(path)
    try:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER]}
        rendered: list[str] = []
        encode = tok.encode_chat

        def spy(messages, **kw):  # type: ignore[no-untyped-def]
            ids = encode(messages, **kw)  # raises as the gateway's would
            rendered.append(tok.render_chat(messages, kw.get("variables")))
            return ids

        tok.encode_chat = spy  # type: ignore[method-assign]
        assert _encode_chat(tok, parse_chat_request(body), 256)
        text = rendered[-1]
        assert "[user] You can call these tools" in text and "hi" in text and "[system]" not in text
        body["messages"] = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
        with pytest.raises(TemplateError, match="no system role"):
            _encode_chat(tok, parse_chat_request(body), 256)
    finally:
        tok.close()
