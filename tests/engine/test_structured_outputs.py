"""Structured outputs in the engine: every completion of a JSON schema, regex, choice, EBNF
grammar or JSON-object constraint is in its language, ends with EOS exactly when complete,
and greedy output equals stock `generate` with xgrammar's own logits processor, token for
token; alone, in batches, with n > 1, async scheduling, preemption and prompt logprobs."""

from __future__ import annotations

import json
import re
import sys

import jsonschema
import pytest
import torch
import xgrammar
from xgrammar.contrib.hf import LogitsProcessor

from hf_paged import LLM, InvalidRequestError, LLMEngine, SamplingParams
from hf_paged.sampling_params import StructuredOutputsParams as S
from conftest import EOS, make_byte_tokenizer, make_model, make_punctuation_tokenizer
from test_engine import run_engine

VOCAB = 320
SCHEMA = {"type": "object",
          "properties": {"ok": {"type": "boolean"},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99},
                         "tag": {"enum": ["a", "bé", "c"]},
                         "name": {"type": "string", "maxLength": 6}},
          "required": ["ok", "n", "tag", "name"], "additionalProperties": False}
GRAMMAR = 'root ::= expr\nexpr ::= num | "(" expr "+" expr ")"\nnum ::= [0-9]'
_cache: dict = {}


def setup(kind="llama_gqa"):
    if kind not in _cache:
        _cache[kind] = (make_model(kind, vocab_size=VOCAB, eos_token_id=EOS),
                        make_byte_tokenizer(300))
    return _cache[kind]


def in_language(spec: S, text: str) -> bool:
    if spec.json is not None or spec.json_object:
        value = json.loads(text)
        if spec.json is not None:
            jsonschema.validate(value, spec.json)
        return spec.json is not None or isinstance(value, dict)
    if spec.regex is not None:
        return re.fullmatch(spec.regex, text) is not None
    if spec.choice is not None:
        return text in spec.choice
    return re.fullmatch(r"[0-9]|\(.*\+.*\)", text) is not None and \
        text.count("(") == text.count(")") == text.count("+")


SPECS = [S(json=SCHEMA), S(regex=r"[0-9]{2,4}-(yes|no)"), S(choice=["café", "naïve", "x"]),
         S(grammar=GRAMMAR), S(json_object=True)]


@pytest.mark.parametrize("spec", SPECS, ids=["json", "regex", "choice", "grammar", "object"])
def test_every_completion_is_in_the_language(spec):
    model, tok = setup()
    llm = LLM(model, tok, block_size=4, num_blocks=1024, max_num_seqs=16)
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=200, structured_outputs=spec)
    outs = llm.generate(["hello", "the quick fox", "日本"], params, use_tqdm=False)
    for out in outs:
        assert out.error is None
        for c in out.outputs:
            if c.finish_reason == "stop":  # ended by EOS: complete
                assert c.token_ids[-1] == EOS
                assert in_language(spec, c.text), c.text
            else:  # cut at max_tokens: a prefix of the language, never a wrong token
                assert c.finish_reason == "length"


def stock_constrained(model, tok, prompt_ids, compiled, max_tokens):
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_tokens,
                         do_sample=False, pad_token_id=0, eos_token_id=EOS,
                         logits_processor=[LogitsProcessor(compiled)])
    return out[0, len(prompt_ids):].tolist()


@pytest.mark.parametrize("kind", ["llama_gqa", "mistral_sw", "falcon_mq"])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_greedy_equals_stock_with_xgrammar(kind, async_scheduling):
    """The engine's masks against xgrammar's Transformers logits processor on the same
    model: the same tokens, EOS included, for every constraint in one batch."""
    model, tok = setup(kind)
    info = xgrammar.TokenizerInfo.from_huggingface(tok, vocab_size=VOCAB, stop_token_ids=[EOS])
    compiler = xgrammar.GrammarCompiler(info)
    compiled = [compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False),
                compiler.compile_regex(r"[0-9]{2,4}-(yes|no)"),
                compiler.compile_grammar(GRAMMAR)]
    specs = [S(json=SCHEMA), S(regex=r"[0-9]{2,4}-(yes|no)"), S(grammar=GRAMMAR)]
    prompts = [tok(p)["input_ids"] for p in ("hello wörld", "the fox", "café")]
    llm = LLM(model, tok, block_size=4, num_blocks=1024, max_num_batched_tokens=16,
              max_num_seqs=8, async_scheduling=async_scheduling)
    params = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=s) for s in specs]
    jobs = [(p, i) for p in prompts for i in range(3)]
    outs = llm.generate([p for p, _ in jobs], [params[i] for _, i in jobs], use_tqdm=False)
    for (prompt, i), out in zip(jobs, outs):
        assert out.outputs[0].token_ids == stock_constrained(model, tok, prompt, compiled[i], 40)


def test_preemption_and_prompt_logprobs_keep_constraints():
    model, tok = setup()
    spec = S(json=SCHEMA)
    params = SamplingParams(temperature=0, max_tokens=60, structured_outputs=spec,
                            prompt_logprobs=1)
    prompts = [tok(p)["input_ids"] for p in ("hello wörld café", "the quick brown fox", "テスト")]
    roomy = LLM(model, tok, block_size=4, num_blocks=1024).generate(prompts, params,
                                                                     use_tqdm=False)
    for mode in ("recompute", "swap"):
        engine = LLMEngine(model, tok, block_size=4, num_blocks=24, max_num_seqs=3,
                           max_num_batched_tokens=8, preemption_mode=mode,
                           admission_headroom=0)
        done = run_engine(engine, prompts, params)
        assert engine.stats().num_preemptions > 0
        for i, ref in enumerate(roomy):
            assert done[str(i)].outputs[0].token_ids == ref.outputs[0].token_ids
            got, want = done[str(i)].prompt_logprobs, ref.prompt_logprobs
            assert got[0] is None and len(got) == len(want)
            for g, w in zip(got[1:], want[1:]):
                assert g.keys() == w.keys()
                assert all(abs(g[t] - w[t]) < 1e-4 for t in w)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_min_tokens_does_not_hold_back_a_complete_constraint(async_scheduling):
    """A choice is complete after a token or two, then allows only EOS; min_tokens masks EOS
    until more tokens are out. The completion ends at its constraint's end ("stop", in the
    language) instead of failing, and the masking still holds where the constraint goes on
    (a regex with more to add, and rows without a constraint)."""
    model, tok = setup()
    llm = LLM(model, tok, block_size=4, num_blocks=1024, async_scheduling=async_scheduling)
    choice = S(choice=["x", "café"])
    short = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=20, min_tokens=8,
                           structured_outputs=choice)
    longer = SamplingParams(temperature=0, max_tokens=20, min_tokens=8,
                            structured_outputs=S(regex=r"[ab]+c?"))
    free = SamplingParams(temperature=0, max_tokens=12, min_tokens=6)
    prompts = [tok(p)["input_ids"] for p in ("hello", "the fox", "日本")]
    outs = llm.generate(prompts, [short, longer, free], use_tqdm=False)
    assert all(out.error is None for out in outs)
    for c in outs[0].outputs:
        assert c.finish_reason == "stop" and c.token_ids[-1] == EOS and c.text in choice.choice
    grown = outs[1].outputs[0]
    assert len(grown.token_ids) >= 8 and re.fullmatch(r"[ab]+c?", grown.text), grown.text
    assert EOS not in outs[2].outputs[0].token_ids[:6]
    alone = LLM(model, tok, block_size=4, num_blocks=1024).generate(
        prompts[2:], free, use_tqdm=False)
    assert outs[2].outputs[0].token_ids == alone[0].outputs[0].token_ids


def test_constraints_compile_once_and_bad_ones_are_refused():
    model, tok = setup()
    engine = LLMEngine(model, tok, block_size=4, num_blocks=256)
    params = SamplingParams(max_tokens=4, structured_outputs=S(json=SCHEMA))
    engine.add_request("a", "hello", params)
    engine.add_request("b", "fox", SamplingParams(max_tokens=4, structured_outputs=S(
        json=json.dumps(SCHEMA, sort_keys=True))))
    assert engine.grammars.compiles == 1
    for bad in (S(regex="(unclosed"), S(grammar="root ::= missing_rule"),
                S(json='{"type": "object", "properties": 5}')):
        with pytest.raises(InvalidRequestError, match="structured_outputs") as err:
            engine.add_request("bad", "hello", SamplingParams(structured_outputs=bad))
        assert err.value.param == "structured_outputs"
    assert set(engine.requests) == {"a", "b"}
    while engine.has_unfinished_requests():
        engine.step()


@pytest.mark.parametrize("schema, rule", [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ({"type": "object", "properties": {"a": {"type": "array", "contains": {"const": 5}}}},
     "'contains' is not enforced (at the root > properties > a)"),
    ({"allOf": [{"type": "object", "required": ["a"], "properties": {"a": {}}},
                {"type": "object", "required": ["b"], "properties": {"b": {}}}]},
     "'allOf' of more than one"),
    ({"type": "object", "properties": {"k": {"type": "string"}, "v": {"type": "integer"}},
      "if": {"properties": {"k": {"const": "a"}}}, "then": {"properties": {"v": {"maximum": 0}}}},
     "'if'"),
    ({"not": {"type": "integer"}}, "'not'"),
    ({"type": "string", "format": "email", "maxLength": 12}, "length beside a 'pattern' or"),
    ({"type": "string", "pattern": "^a+$", "minLength": 3}, "length beside a 'pattern' or"),
    ({"type": "number", "multipleOf": 0.5}, "multipleOf"),
    ({"type": "object", "properties": {"n": {"minimum": 3}}}, "need 'type': 'integer'"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "z"]},
     "['z']"),
    ({"type": "object", "properties": {"a": {"type": "integer"}},
      "anyOf": [{"required": ["a"]}]}, "'anyOf' beside ['properties']"),
    ({"$defs": {"i": {"type": "integer"}}, "type": "object",
      "properties": {"a": {"$ref": "#/$defs/i", "minimum": 5}}}, "'$ref' beside ['minimum']"),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
    ({"enum": [1, "x"], "type": "string"}, "'type' beside an 'enum' or 'const'"),
    ({"type": "string", "const": 5}, "'type' beside an 'enum' or 'const'"),
])
def test_a_schema_rule_the_grammar_engine_would_not_enforce_is_refused(schema, rule):
    """xgrammar compiles these without a word and its outputs then break them (a list with
    duplicates under uniqueItems, a bare number under an allOf of objects, ...): each is
    refused by name and place instead."""
    model, tok = setup()
    engine = LLMEngine(model, tok, block_size=4, num_blocks=64)
    with pytest.raises(InvalidRequestError, match="the grammar engine would serve it "
                       "unchecked") as err:
        engine.add_request("bad", "hello", SamplingParams(structured_outputs=S(json=schema)))
    assert rule in str(err.value) and err.value.param == "structured_outputs"
    assert not engine.requests


@pytest.mark.parametrize("schema, rule", [
    ({"anyOf": []}, "'anyOf' must list at least one schema"),
    ({"type": "array", "items": {"oneOf": []}, "minItems": 1}, "'oneOf' must list"),
    ({"allOf": []}, "'allOf' must list"),
    ({"type": "object", "properties": {"a": {"type": []}}}, "'type' must name at least one"),
    ({"type": "string", "maxLength": -1}, "'maxLength' must be a non-negative integer"),
    ({"type": ["string", "null"], "minLength": 1.5}, "'minLength' must be a non-negative"),
    ({"type": "object", "maxProperties": True}, "'maxProperties' must be a non-negative"),
])
def test_an_invalid_schema_xgrammar_would_serve_is_refused(schema, rule):
    """xgrammar lets an empty anyOf / oneOf end the output at once (an empty text or
    `{"a": }` finishing "stop") and reads a negative maxLength as no bound."""
    model, tok = setup()
    engine = LLMEngine(model, tok, block_size=4, num_blocks=64)
    with pytest.raises(InvalidRequestError, match="invalid schema at the root") as err:
        engine.add_request("bad", "hi", SamplingParams(structured_outputs=S(json=schema)))
    assert rule in str(err.value) and err.value.param == "structured_outputs"
    assert not engine.requests


def test_schemas_of_enforced_rules_still_run():
    """Pydantic's shapes (nullable anyOf beside annotations, $ref into $defs, type lists with
    bounds), anyOf beside its type, an integer step, and keywords JSON Schema does not
    define (ignored, as it says): compiled and kept, every completion valid."""
    model, tok = setup()
    schema = {"$defs": {"Item": {"properties": {"n": {"type": "integer", "multipleOf": 3,
                                                      "minimum": 0, "maximum": 60}},
                                 "required": ["n"], "title": "Item", "type": "object"}},
              "type": "object", "title": "M", "x-vendor": {"a": 1},
              "properties": {"items": {"type": "array", "items": {"$ref": "#/$defs/Item"},
                                       "maxItems": 2, "uniqueItems": False},
                             "tag": {"anyOf": [{"type": "string", "maxLength": 3},
                                               {"type": "null"}], "default": None},
                             "score": {"type": ["integer", "null"], "minimum": 1},
                             "kind": {"type": "object", "anyOf": [
                                 {"properties": {"a": {"type": "integer"}}, "required": ["a"]},
                                 {"properties": {"b": {"type": "string", "maxLength": 2}},
                                  "required": ["b"]}]}},
              "required": ["items", "tag", "score", "kind"], "additionalProperties": False}
    spec = S(json=schema)
    outs = LLM(model, tok, block_size=4, num_blocks=256).generate(
        ["hello", "fox", "a b"], SamplingParams(temperature=1.0, seed=2, max_tokens=160,
                                                structured_outputs=spec), use_tqdm=False)
    for out in outs:
        if out.outputs[0].finish_reason == "stop":
            assert in_language(spec, out.outputs[0].text)
    assert any(out.outputs[0].finish_reason == "stop" for out in outs)


def test_a_slow_compile_holds_up_no_other_constraint(monkeypatch):
    """One constraint compiling (a huge schema takes seconds) never makes another wait;
    callers of the same one wait for that one compile and share it."""
    import threading

    from hf_paged.engine.structured import Grammars

    model, tok = setup()
    grammars = LLMEngine(model, tok, block_size=4, num_blocks=16)._grammars()
    slow, cheap = S(regex="[a-z]+"), S(json_object=True)
    started, release = threading.Event(), threading.Event()
    compile_ = Grammars._compile

    def held(self, spec):
        if spec == slow:
            started.set()
            assert release.wait(30)
        return compile_(self, spec)

    monkeypatch.setattr(Grammars, "_compile", held)
    got = []
    threads = [threading.Thread(target=lambda: got.append(grammars.compile(slow)))
               for _ in range(2)]
    threads[0].start()
    assert started.wait(30)
    threads[1].start()
    done = threading.Thread(target=grammars.compile, args=(cheap,))
    done.start()
    done.join(30)
    assert not done.is_alive() and not got  # the cheap one ended while the slow one ran
    release.set()
    for t in threads:
        t.join(30)
    assert len(got) == 2 and got[0] is got[1] and grammars.compiles == 2


def test_a_special_token_never_stands_for_its_text():
    """A constraint spelling a special token's text ("<s>") gets that text from ordinary
    tokens, never from the special token (which the completion's text leaves out), however
    strongly the model favours it."""
    model, tok = setup()
    bos = tok.convert_tokens_to_ids("<s>")
    spec = S(regex=r"ab<s>cd|<s>x")
    outs = LLM(model, tok, block_size=4, num_blocks=256).generate(
        ["hello", "the fox"], SamplingParams(temperature=0, max_tokens=20, structured_outputs=spec,
                                           logit_bias={bos: 100.0}), use_tqdm=False)
    for out in outs:
        assert bos not in out.outputs[0].token_ids and in_language(spec, out.outputs[0].text)


def test_a_constraint_the_vocabulary_cannot_start_is_refused():
    """A WordPiece vocabulary of words and punctuation has no digit, brace or kana: such a
    constraint would fail its request at the first sample, so it is refused when added."""
    tok = make_punctuation_tokenizer("wordpiece", True)
    model = make_model("llama_gqa", vocab_size=len(tok) + 8, eos_token_id=EOS)
    engine = LLMEngine(model, tok, block_size=4, num_blocks=64)
    for bad in (S(regex="[0-9]+"), S(json_object=True), S(json=SCHEMA), S(choice=["日本"]),
                S(grammar='root ::= "{" "hello"')):
        with pytest.raises(InvalidRequestError, match="no token .* can start") as err:
            engine.add_request("bad", "hello world", SamplingParams(structured_outputs=bad))
        assert err.value.param == "structured_outputs"
    assert not engine.requests and engine.grammars.compiles == 5
    done = run_engine(engine, ["hello"], SamplingParams(max_tokens=6, structured_outputs=S(
        choice=["hello", "world", "日本"])))  # (one choice it can spell is enough)
    assert (done["0"].outputs[0].text, done["0"].outputs[0].finish_reason) in (
        ("hello", "stop"), ("world", "stop"))


@pytest.mark.parametrize("kwargs, message", [
    ({}, "exactly one"),
    ({"regex": "a", "choice": ["b"]}, "exactly one"),
    ({"choice": []}, "choice"),
    ({"choice": ["a", 3]}, "choice"),
    ({"regex": ""}, "regex"),
    ({"json": 5}, "json"),
    ({"json_object": "yes"}, "json_object must be true or false"),
])
def test_params_are_checked(kwargs, message):
    with pytest.raises(InvalidRequestError, match=message):
        S(**kwargs)
    with pytest.raises(InvalidRequestError, match="structured_outputs"):
        SamplingParams(structured_outputs={"jsn": {}})


def test_needs_a_tokenizer_and_names_the_extra(monkeypatch):
    model, tok = setup()
    engine = LLMEngine(model, None, block_size=4, num_blocks=64)
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        engine.add_request("a", [5, 6], SamplingParams(structured_outputs=S(regex="a+")))
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # as if the extra were not installed
    engine = LLMEngine(model, tok, block_size=4, num_blocks=64)
    with pytest.raises(InvalidRequestError, match=r"hf-paged\[structured\]"):
        engine.add_request("a", [5, 6], SamplingParams(structured_outputs=S(regex="a+")))
    assert not engine.requests


def _byte_token(tok, byte: int) -> int:
    """The byte-level BPE token of one byte (GPT-2's printable stand-ins for bytes)."""
    shown = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    if byte in shown:
        return tok.convert_tokens_to_ids(chr(byte))
    return tok.convert_tokens_to_ids(chr(256 + [b for b in range(256)
                                                 if b not in shown].index(byte)))


@pytest.mark.parametrize("constraint", [S(json={"type": "string", "maxLength": 1}),
                                        S(regex="x.")])
def test_no_surrogate_bytes_even_when_the_model_wants_them(constraint):
    """xgrammar's character classes take ED A0-BF xx, the UTF-8 form of a UTF-16
    surrogate, which is not UTF-8: its bytes decode to three replacement characters and the
    text broke maxLength. Biased towards exactly those bytes, the completion takes a real
    character instead (ED 80-9F xx)."""
    model, tok = setup()
    lead, second, third = (_byte_token(tok, b) for b in (0xED, 0xA7, 0xB9))
    start = tok.convert_tokens_to_ids('"' if constraint.json else "x")
    params = SamplingParams(temperature=0, max_tokens=10, structured_outputs=constraint,
                            logit_bias={start: 50.0, lead: 100.0, second: 90.0, third: 80.0})
    out = LLM(model, tok, block_size=4, num_blocks=64).generate(
        [[5, 6, 7]], params, use_tqdm=False)[0].outputs[0]
    assert lead in out.token_ids and out.finish_reason == "stop"  # (what the test is about)
    assert "\ufffd" not in out.text, out.text
    if constraint.json:
        jsonschema.validate(json.loads(out.text), constraint.json)
    else:
        assert re.fullmatch("x.", out.text), out.text


def test_the_surrogate_rule_follows_rollback():
    """The rule holds right after a token ending in ED, also after `allows` looked ahead,
    and no longer once the matcher stepped back over it (a rejected draft)."""
    from hf_paged.engine.structured import Grammars

    _, tok = setup()
    grammars = Grammars(tok, VOCAB, {EOS})
    spec = S(regex="(.)+")
    matcher = grammars.matcher(grammars.compile(spec), spec)
    lead, second = _byte_token(tok, 0xED), _byte_token(tok, 0xA7)

    def may(token):
        bits = torch.zeros(1, matcher.words, dtype=torch.int32)
        matcher.fill(bits, 0)
        return bool((bits[0, token // 32] >> (token % 32)) & 1)

    other = _byte_token(tok, 0xEA)  # (a lead that A7 may follow)
    assert matcher.accept(_byte_token(tok, ord("a"))) and matcher.accept(lead)
    assert not may(second) and may(_byte_token(tok, 0x9D))
    assert matcher.allows([_byte_token(tok, 0x9D)]) == 1 and not may(second)
    matcher.rollback(1)
    assert matcher.accept(other) and may(second)


@pytest.mark.parametrize("constraint", [
    S(regex=r"x|[\ud800-\udfff]"), S(regex=r"([\ud800-\udbff][\udc00-\udfff]|x)"),
    S(json={"type": "string", "pattern": r"^(x|[\ud800-\udfff])$"}),
    S(json='{"enum": ["\\ud800"]}'), S(grammar='root ::= "x" | [\\ud800-\\udfff]')])
def test_a_constraint_naming_surrogates_is_refused(constraint):
    """Surrogates are no characters: xgrammar matched them as invalid bytes, and with those
    masked, a model taking their first byte had no token left."""
    model, tok = setup()
    engine = LLMEngine(model, tok, block_size=4, num_blocks=64)
    with pytest.raises(InvalidRequestError, match="names UTF-16 surrogates"):
        engine.add_request("bad", [5, 6], SamplingParams(structured_outputs=constraint))
    assert not engine.requests
    # a character above U+FFFF written as itself (in JSON text too, as a pair) is served
    for schema in ({"enum": ["\U0001F600", "a"]}, '{"enum": ["\\ud83d\\ude00", "a"]}'):
        out = LLM(model, tok, block_size=4, num_blocks=64).generate(
            [[5, 6]], SamplingParams(temperature=0, max_tokens=12,
                                     structured_outputs=S(json=schema)), use_tqdm=False)
        assert out[0].outputs[0].text in ('"\U0001F600"', '"a"')
