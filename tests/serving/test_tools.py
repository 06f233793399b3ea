"""Tool calls: the parsers of each model family's format, `tool_choice` required / named
(forced by a schema: arguments always parse and validate), `auto` parsed from what the
model writes (made to write a call with a regex constraint), streaming deltas, parallel
calls, tool messages fed back through the chat template, and bad tools as 400s."""

from __future__ import annotations

import json

import jsonschema
import pytest

from hf_paged.serving.tools import auto_parser, calls_at
from test_structured_server import byte_level_server

TEMPLATE = (
    "{%- if tools %}<|system|>tools: {{ tools | tojson }}\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|assistant|>"
    "{%- for c in m.tool_calls %}<tool_call>{\"name\": \"{{ c.function.name }}\", "
    "\"arguments\": {{ c.function.arguments | tojson }}}</tool_call>{% endfor %}\n"
    "{%- elif m.role == 'tool' %}<|tool|>{{ m.tool_call_id }}: {{ m.content }}\n"
    "{%- else %}<|{{ m.role }}|>{{ m.content }}\n{% endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|assistant|>{% endif %}")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather of a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 8},
        "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"],
        "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "integer", "minimum": -12, "maximum": 12}}, "required": ["zone"],
        "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "weather in Paris?"}]


@pytest.fixture(scope="module")
def served():
    with byte_level_server(TEMPLATE, context=4096, block_size=16) as server:
        yield server


def check_calls(calls, names=None):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert names is None or call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


# -- parsers ------------------------------------------------------------------------------------
def test_hermes_parser():
    text = ('Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"zone": 1}}</tool_call>')
    start, calls = calls_at("hermes", text)
    assert text[:start] == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"zone": 1})]
    assert calls_at("hermes", "no call here") == (len("no call here"), [])
    assert calls_at("hermes", "<tool_call>{not json</tool_call>")[1] == []


def test_llama3_and_mistral_parsers():
    start, calls = calls_at("llama3_json", '<|python_tag|>{"name": "get_time", "parameters": '
                                           '{"zone": 2}}; {"name": "get_weather", "parameters": '
                                           '{"city": "Oslo"}}')
    assert start == 0 and [c.name for c in calls] == ["get_time", "get_weather"]
    assert json.loads(calls[0].arguments) == {"zone": 2}
    assert calls_at("llama3_json", "Hello {there}")[1] == []
    text = 'ok [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Rome"}}]'
    start, calls = calls_at("mistral", text)
    assert text[:start] == "ok " and calls[0].name == "get_weather"
    assert auto_parser(TEMPLATE) == "hermes"
    assert auto_parser("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert auto_parser("<|python_tag|>{{ x }}") == "llama3_json"


# -- forced calls -----------------------------------------------------------------------------
@pytest.mark.parametrize("parallel", [True, False])
def test_required_calls_always_parse_and_validate(served, parallel):
    out = served.client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required", n=2,
        parallel_tool_calls=parallel, max_tokens=1500, temperature=0.8, seed=5)
    ended = [c for c in out.choices if c.finish_reason == "tool_calls"]
    # A random model may go on adding parallel calls until max_tokens; one call always ends.
    assert ended and (parallel or len(ended) == len(out.choices))
    for choice in out.choices:
        if choice.finish_reason == "tool_calls":
            check_calls(choice.message.tool_calls, SCHEMAS)
        else:
            assert choice.finish_reason == "length" and parallel
        if not parallel:
            assert len(choice.message.tool_calls) == 1


def test_named_function_and_streaming(served):
    """A call forced by name ends as its answer did ("stop"), as OpenAI and vLLM say it."""
    kw = dict(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=200, temperature=0,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = served.client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "stop"
    check_calls(whole.message.tool_calls, ["get_weather"])
    chunks = [c for c in served.client.chat.completions.create(**kw, stream=True) if c.choices]
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert [d.function.name for d in deltas] == ["get_weather"] and deltas[0].index == 0
    assert deltas[0].function.arguments == whole.message.tool_calls[0].function.arguments
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_streamed_calls_of_several_choices_equal_the_response(served):
    """n=2 with a named function, streamed: each choice's call comes once (later chunks
    still carry a choice that has ended), with the logprobs of its tokens, as in the
    response without streaming."""
    kw = dict(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=200, temperature=1.0,
              seed=11, n=2, logprobs=True, top_logprobs=2,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = served.client.chat.completions.create(**kw)
    chunks = [c for c in served.client.chat.completions.create(**kw, stream=True) if c.choices]
    for choice in whole.choices:
        mine = [c.choices[0] for c in chunks if c.choices[0].index == choice.index]
        calls = [d for c in mine for d in (c.delta.tool_calls or [])]
        assert [(d.function.name, d.function.arguments) for d in calls] == [
            (t.function.name, t.function.arguments) for t in choice.message.tool_calls]
        streamed = [e for c in mine if c.logprobs for e in c.logprobs.content]
        assert [e.token for e in streamed] == [e.token for e in choice.logprobs.content]
        assert [e.logprob for e in streamed] == pytest.approx(
            [e.logprob for e in choice.logprobs.content], abs=1e-4)
        ends = [c.finish_reason for c in mine if c.finish_reason]
        assert ends == [choice.finish_reason] == ["stop"]


# -- auto: what the model writes --------------------------------------------------------------
CALL = ('Sure.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'
        '</tool_call>')


def _regex(text: str) -> str:
    return "".join("\\" + ch if ch in r".^$*+?{}[]\|()" else ch for ch in text)


@pytest.mark.parametrize("before", ["Sure.", " Sure. \n", " "])
def test_auto_parses_the_models_own_calls(served, before):
    """Content before the call ends without its trailing whitespace, streamed or not (a
    stream holds whitespace back until text follows it)."""
    call = before + CALL.removeprefix("Sure.")
    kw = dict(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=200, temperature=0,
              extra_body={"structured_outputs": {"regex": _regex(call)}})
    choice = served.client.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == (before.rstrip() or None)
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Paris",
                                                                         "unit": "c"}
    chunks = [c for c in served.client.chat.completions.create(**kw, stream=True) if c.choices]
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    calls = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert content == before.rstrip() and "<tool_call>" not in content
    assert calls[0].function.name == "get_weather"
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    plain = served.client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=5, temperature=0,
        extra_body={"structured_outputs": {"regex": "abc"}})
    assert plain.choices[0].message.content == "abc" and not plain.choices[0].message.tool_calls
    none = served.client.chat.completions.create(**kw | {"tool_choice": "none"})
    assert none.choices[0].message.content == call and not none.choices[0].message.tool_calls


@pytest.mark.parametrize("skip", [True, False])
def test_content_before_a_call_reads_as_the_text_does(served, skip):
    """A special token in the content before a call (a Mistral-style marker is one itself)
    is left out of the content as it is of the text when skip_special_tokens is on, kept
    when off; a token running into the marker keeps its part before it."""
    from hf_paged import CompletionOutput
    from hf_paged.serving.tools import ToolMode
    from conftest import make_byte_fallback_tokenizer

    # (byte fallback: a character's byte tokens decode to replacement characters until its
    # last one, so the decoded text does not only grow token by token)
    for tok in (served.tok, make_byte_fallback_tokenizer()):
        bos = tok.convert_tokens_to_ids("<s>")
        for head, tail in (("ab", "cd"), ("ab <", "cd"), ("a b", "😀"), ("", "é 😀")):
            ids = [*tok.encode(head, add_special_tokens=False), bos]
            content_ids = ids + tok.encode(tail, add_special_tokens=False)
            ids = content_ids + tok.encode(CALL[5:], add_special_tokens=False)
            out = CompletionOutput(0, text=tok.decode(ids, skip_special_tokens=skip),
                                   token_ids=ids, finish_reason="length")
            content, calls = ToolMode("hermes", "auto", True, skip).answer(out, tok)
            assert [c.name for c in calls] == ["get_weather"]
            assert content == tok.decode(content_ids, skip_special_tokens=skip).strip()
            assert "<s>" not in content if skip else "<s>" in content
            assert out.text.startswith(content)  # (what a stream sent of the text goes on)


def test_tool_results_go_back_through_the_template(served):
    messages = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    got = served.http.post("/tokenize", json={"messages": messages, "tools": TOOLS}).json()
    rendered = served.tok.apply_chat_template(
        [messages[0], dict(messages[1], tool_calls=[{"id": "call_1", "type": "function",
                                                      "function": {"name": "get_weather",
                                                                   "arguments": {"city": "Paris"}}}]),
         messages[2]], tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert '"arguments": {"city": "Paris"}' in rendered and "call_1: sunny" in rendered
    assert got["tokens"] == served.tok(rendered, add_special_tokens=False)["input_ids"]
    out = served.client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS,
                                                max_tokens=4)
    assert out.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("body, param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "bogus"}}}], "tool_choice": "required"}, "tools"),  # (does not compile)
])
def test_bad_tools_are_400s(served, body, param):
    r = served.http.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES,
                                                       "max_tokens": 5, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
