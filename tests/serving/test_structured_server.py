"""Structured outputs through the server with the `openai` client: `response_format`
(json_object, json_schema, the client's pydantic `parse`), vLLM's `structured_outputs`
and `guided_*` fields, streaming, n > 1, and malformed constraints as 400s naming their
field. A random model with a byte-level tokenizer: whatever it samples must parse."""

from __future__ import annotations

import contextlib
import json
import re
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from hf_paged.server import build_app
from conftest import EOS, make_byte_tokenizer, make_model
from test_server import ServerThread

KEY = "k"
SCHEMA = {"type": "object",
          "properties": {"city": {"type": "string", "maxLength": 8},
                         "rank": {"type": "integer", "minimum": 1, "maximum": 20},
                         "open": {"type": "boolean"}},
          "required": ["city", "rank", "open"], "additionalProperties": False}
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@contextlib.contextmanager
def byte_level_server(template: str, context: int = 1024, block_size: int = 8):
    """A random Llama with a byte-level tokenizer (any text is a token sequence) and
    `template`, served on loopback as "tiny", with an `openai` client and an httpx one."""
    tok = make_byte_tokenizer(300)
    tok.chat_template = template
    model = make_model("llama_gqa", vocab_size=320, eos_token_id=EOS,
                       max_position_embeddings=context)
    app = build_app(model, tok, served_model_name="tiny", api_key=KEY, block_size=block_size,
                    num_blocks=512, max_num_seqs=16)
    with ServerThread(app) as server:
        server.tok = tok
        server.client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
        server.http = httpx.Client(base_url=server.url,
                                   headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
        yield server


@pytest.fixture(scope="module")
def served():
    with byte_level_server(TEMPLATE) as server:
        yield server


MESSAGES = [{"role": "user", "content": "a city, please"}]


def test_json_schema_responses_parse_and_validate(served):
    out = served.client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=300, temperature=1.0, seed=4, n=4,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}})
    for choice in out.choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_pydantic_parse(served):
    class City(BaseModel):
        name: str = Field(max_length=5)
        size: Literal["small", "big"]
        capital: bool

    out = served.client.beta.chat.completions.parse(
        model="tiny", messages=MESSAGES, max_tokens=400, temperature=0.7, seed=1,
        response_format=City)
    assert isinstance(out.choices[0].message.parsed, City)


def test_json_object_and_completions(served):
    out = served.client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=300, temperature=0.5, seed=2,
        response_format={"type": "json_object"})
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(out.choices[0].message.content), dict)
    done = served.client.completions.create(
        model="tiny", prompt="the fox", max_tokens=300, temperature=1.0, seed=3,
        extra_body={"structured_outputs": {"json": SCHEMA}})
    jsonschema.validate(json.loads(done.choices[0].text), SCHEMA)


@pytest.mark.parametrize("extra, check", [
    ({"structured_outputs": {"regex": r"[a-c]{3}-\d\d"}},
     lambda t: re.fullmatch(r"[a-c]{3}-\d\d", t)),
    ({"structured_outputs": {"choice": ["café", "naïve"]}}, lambda t: t in ("café", "naïve")),
    ({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
    ({"guided_regex": r"\d{4}"}, lambda t: re.fullmatch(r"\d{4}", t)),
    ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    ({"structured_outputs": {"grammar": 'root ::= "(" [a-z]+ ")"'}},
     lambda t: re.fullmatch(r"\([a-z]+\)", t)),
])
def test_vllm_fields(served, extra, check):
    out = served.client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=200, temperature=1.0, seed=9, n=2,
        extra_body=extra)
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        assert check(choice.message.content), choice.message.content


def test_streamed_json_adds_up(served):
    kw = dict(model="tiny", messages=MESSAGES, max_tokens=300, temperature=0, seed=0,
              response_format={"type": "json_schema", "json_schema": {"name": "c",
                                                                      "schema": SCHEMA}})
    whole = served.client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(served.client.chat.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    jsonschema.validate(json.loads(whole), SCHEMA)


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": 3}}}}, "response_format"),
    # no value matches an empty anyOf, and xgrammar reads a negative length as no bound
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"anyOf": []}}, "required": ["a"]}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "maxLength": -1}}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "minLength": -3}}}}, "response_format"),
    ({"structured_outputs": {"regex": "(a"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"jsn": {}}}, "structured_outputs"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
    ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar"),
])
def test_bad_constraints_are_400s(served, body, param):
    r = served.http.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES,
                                                       "max_tokens": 5, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    message = r.json()["error"]["message"]  # named as sent, without xgrammar's source lines
    assert param in message and ".cc:" not in message, message
    if "jsn" in str(body):  # the unknown name is named
        assert "jsn" in r.json()["error"]["message"]
    ok = served.client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3)
    assert ok.choices[0].finish_reason in ("stop", "length")
