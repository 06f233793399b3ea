"""Per-request token settings: `logit_bias`, `allowed_token_ids` and `bad_words` against
Transformers' own processors (row by row) and stock `generate` (end to end, sync, async and
speculative, in a batch with requests that do not use them); `truncate_prompt_tokens`;
`skip_special_tokens`, `include_stop_str_in_output` and `detokenize` on the text, decoded
once, followed token by token and streamed; delta and final-only outputs against the
cumulative ones; bad values named, the engine going on."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
import torch
from transformers.generation.logits_process import (
    PrefixConstrainedLogitsProcessor, RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from hf_paged import LLM, AsyncLLM, LLMEngine, RequestOutputKind, SamplingParams
from hf_paged.errors import InvalidRequestError
from hf_paged.sampler import Sampler, SampleRow, bad_word_ids
from conftest import BOS, EOS, VOCAB, make_tokenizer
from test_engine import long_model, run_engine
from test_sampler import hf_scores
from test_speculative import NGRAM, repetitive_prompts


def resolved(**kw):
    return SamplingParams(**kw).resolved({})


def reference_scores(logits, tokens, p: SamplingParams, generated: int):
    """Transformers' processors on one row: sequence bias, then the rest in generate's
    order (vLLM's too), the allowed tokens as a prefix constraint."""
    ids = torch.tensor([tokens])
    scores = logits[None].clone()
    if p.logit_bias:
        bias = {(t,): b for t, b in p.logit_bias.items()}
        scores = SequenceBiasLogitsProcessor(sequence_bias=bias)(ids, scores)
    if p.allowed_token_ids is not None:
        allowed = p.allowed_token_ids
        scores = PrefixConstrainedLogitsProcessor(lambda batch, seq: allowed, 1)(ids, scores)
    if p.greedy:  # (the sampler leaves a greedy row's penalized logits as they are)
        p = replace(p, temperature=1.0)
    return hf_scores(scores[0], tokens, p, generated)


ROWS = [
    dict(logit_bias={3: 2.5, 7: -1.0, 20: 100.0}, temperature=0),
    dict(logit_bias={3: 1.5, 9: -3.0}, repetition_penalty=1.6, temperature=0.8),
    dict(allowed_token_ids=[4, 8, 15, 16, 23, 42], temperature=1.2, top_k=3),
    dict(allowed_token_ids=[5, 6], logit_bias={6: 0.5, 30: 50.0}, temperature=0),
    dict(allowed_token_ids=[2, 11, 12], repetition_penalty=0.7, top_p=0.8),
    dict(temperature=0.9),  # no token settings: untouched by its neighbours'
]


def test_bias_and_allowed_tokens_match_transformers_processors_row_by_row():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(len(ROWS), 50, generator=g) * 3
    rows = []
    for kw in ROWS:
        prompt = torch.randint(0, 50, (5,), generator=g).tolist()
        rows.append(SampleRow(resolved(**kw), prompt, [3, 11]))
    sampler = Sampler()
    penalized = sampler.penalize(logits.clone(), rows)
    ours = sampler.warp(penalized, rows).softmax(-1)
    for i, row in enumerate(rows):
        ref = reference_scores(logits[i], row.prompt + row.output, row.params, 2)
        torch.testing.assert_close(ours[i], ref.softmax(-1), rtol=1e-5, atol=1e-6,
                                   msg=f"settings {ROWS[i]}")
        if row.params.allowed_token_ids is not None:
            outside = torch.ones(50, dtype=torch.bool)
            outside[row.params.allowed_token_ids] = False
            assert torch.isneginf(penalized[i][outside]).all()
    tokens = sampler(logits, rows).tokens
    assert tokens[0] == 20 and tokens[3] == 6  # a bias decides greedy rows too
    assert tokens[2] in ROWS[2]["allowed_token_ids"]


def stock(model, prompt, max_tokens, **kw):
    ids = torch.tensor([prompt])
    out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False, eos_token_id=None,
                         pad_token_id=0, attention_mask=torch.ones_like(ids), **kw)
    return out[0, len(prompt):].tolist()


def stock_kwargs(params: SamplingParams) -> dict:
    kw = {}
    if params.logit_bias:
        kw["sequence_bias"] = {(t,): b for t, b in params.logit_bias.items()}
    if params.allowed_token_ids is not None:
        allowed = params.allowed_token_ids
        kw["prefix_allowed_tokens_fn"] = lambda batch, seq: allowed
    if params.repetition_penalty not in (None, 1.0):
        kw["repetition_penalty"] = params.repetition_penalty
    return kw


@pytest.mark.parametrize("mode", ["sync", "async", "speculative"])
def test_greedy_with_bias_and_allowed_tokens_equals_stock_generate(mode):
    model = long_model("llama_gqa")
    prompts = repetitive_prompts(3, 8)
    plain = stock(model, prompts[0], 12)
    settings = [
        dict(),
        dict(logit_bias={plain[0]: -100.0, plain[3]: 4.0, 17: 1.5}),
        dict(logit_bias={5: 2.0, 6: -2.0}, repetition_penalty=1.4),
        dict(allowed_token_ids=sorted({plain[1], plain[2], 9, 10, 33, 47})),
        dict(allowed_token_ids=list(range(3, 60, 4)), logit_bias={7: 3.0, 8: 9.0}),
        dict(allowed_token_ids=[41]),  # one token: every step takes it
    ]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                             **settings[i % len(settings)]) for i in range(len(prompts))]
    options = dict(block_size=4, num_blocks=120, max_num_seqs=4)
    if mode == "async":
        options["async_scheduling"] = True
    if mode == "speculative":
        options["speculative_config"] = NGRAM
    done = run_engine(LLMEngine(model, **options), prompts, params)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        got = done[str(i)].outputs[0].token_ids
        assert got == stock(model, prompt, 12, **stock_kwargs(p)), (i, settings[i % 6])
    assert done["5"].outputs[0].token_ids == [41] * 12
    assert plain[0] not in done["1"].outputs[0].token_ids[:1]


def test_seeded_sampling_keeps_to_the_allowed_tokens_and_the_batch_does_not_matter():
    model = long_model("llama_gqa")
    llm = LLM(model, block_size=4, num_blocks=200)
    allowed = [4, 9, 16, 25, 36]
    p = SamplingParams(temperature=1.5, max_tokens=30, seed=7, ignore_eos=True,
                       allowed_token_ids=allowed, logit_bias={9: -100.0, 16: 2.0})
    others = [SamplingParams(temperature=1.0, max_tokens=20, seed=i, ignore_eos=True)
              for i in range(3)]
    alone = llm.generate([[5, 6, 7]], p, use_tqdm=False)[0].outputs[0].token_ids
    batch = llm.generate([[8, 9], [5, 6, 7], [3] * 9, [10]], [others[0], p, *others[1:]],
                         use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    assert set(alone) <= set(allowed) - {9} and 16 in alone
    assert any(set(o.outputs[0].token_ids) - set(allowed) for o in batch[:1] + batch[2:])


@pytest.mark.parametrize("mode", ["sync", "async", "speculative"])
def test_bad_words_are_never_generated_as_stock_generate_bans_them(mode):
    model = long_model("llama_gqa")
    tok = make_tokenizer()
    prompts = [p for p in repetitive_prompts(4, 12)]
    plains = [stock(model, p, 10) for p in prompts]
    words, ids = [], []
    for prompt, plain in zip(prompts, plains):
        # one word of one token, one of two (the prompt does not end with its first)
        j = next((j for j in range(1, 9) if plain[j] != prompt[-1]), None)
        pair = [] if j is None else [[plain[j], plain[j + 1]]]
        words.append([" ".join(tok.convert_ids_to_tokens(w)) for w in [[plain[0]]] + pair])
        ids.append([[plain[0]]] + pair)
    options = dict(block_size=4, num_blocks=120, max_num_seqs=5)
    if mode == "async":
        options["async_scheduling"] = True
    if mode == "speculative":
        options["speculative_config"] = NGRAM
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, bad_words=w)
              for w in words]
    params[-1] = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)  # a neighbour
    done = run_engine(LLMEngine(model, tok, **options), prompts, params)
    for i, prompt in enumerate(prompts):
        got = done[str(i)].outputs[0].token_ids
        if i == len(prompts) - 1:
            assert got == plains[i]
            continue
        assert got == stock(model, prompt, 10, bad_words_ids=ids[i]), i
        assert got[0] != plains[i][0]
        pairs = set(zip(got, got[1:]))
        assert all(tuple(word) not in pairs for word in ids[i][1:])


def test_a_bad_word_is_banned_after_its_first_tokens_only():
    tok = make_tokenizer()
    words = bad_word_ids(["w7 w8 w9", " w4"], tok, VOCAB)
    assert words == [[7, 8, 9], [4]]  # (a word-level tokenizer: a space changes nothing)
    logits = torch.zeros(3, VOCAB)
    p = resolved(bad_words=["w7 w8 w9", " w4"])
    rows = [SampleRow(p, [7, 8], [], bad_words=words), SampleRow(p, [], [5, 7, 8], bad_words=words),
            SampleRow(p, [], [8, 7, 8, 3], bad_words=words)]
    out = Sampler().penalize(logits.clone(), rows)
    assert torch.isneginf(out).nonzero().tolist() == [[0, 4], [1, 4], [1, 9], [2, 4]]


def test_truncated_prompts_keep_their_last_tokens():
    model = long_model("llama_gqa")
    llm = LLM(model, block_size=4, num_blocks=200)
    prompt = repetitive_prompts(5, 1)[0] + list(range(3, 40))
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                truncate_prompt_tokens=9), use_tqdm=False)[0]
    assert out.prompt_token_ids == prompt[-9:]
    assert out.outputs[0].token_ids == stock(model, prompt[-9:], 6)


def test_no_text_without_detokenize():
    llm = LLM(long_model("llama_gqa"), make_tokenizer(), block_size=4, num_blocks=200)
    out = llm.generate("w5 w6", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True,
                                               detokenize=False), use_tqdm=False)[0].outputs[0]
    assert out.text == "" and len(out.token_ids) == 5
    with pytest.raises(InvalidRequestError, match="detokenize"):
        SamplingParams(stop=["w5"], detokenize=False)


@pytest.mark.parametrize("bad, field", [
    (dict(logit_bias={"5": 1.0}), "logit_bias"), (dict(logit_bias={5: float("nan")}), "logit_bias"),
    (dict(logit_bias={True: 1.0}), "logit_bias"), (dict(logit_bias=[5]), "logit_bias"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[1.5]), "allowed_token_ids"),
    (dict(skip_special_tokens="no"), "skip_special_tokens"),
    (dict(include_stop_str_in_output=1), "include_stop_str_in_output"),
    (dict(bad_words=["w5", ""]), "bad_words"), (dict(bad_words=[5]), "bad_words"),
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
    (dict(detokenize=None), "detokenize"),
])
def test_bad_token_settings_are_named(bad, field):
    with pytest.raises(InvalidRequestError, match=field) as err:
        SamplingParams(**bad)
    assert err.value.param == field


def test_token_ids_outside_the_vocabulary_are_refused_and_the_engine_goes_on():
    llm = LLM(long_model("llama_gqa"), block_size=4, num_blocks=200)
    for bad, field in ((dict(logit_bias={VOCAB: 1.0}), "logit_bias"),
                       (dict(allowed_token_ids=[3, -1]), "allowed_token_ids"),
                       (dict(bad_words=["w5"]), "bad_words")):  # (no tokenizer)
        with pytest.raises(InvalidRequestError, match=field):
            llm.generate([[5, 6]], SamplingParams(max_tokens=3, **bad), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate([[5, 6]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                       use_tqdm=False)
    assert out[0].outputs[0].token_ids == stock(llm.engine.model, [5, 6], 3)


# -- text ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm():
    return LLM(long_model("llama_gqa"), make_tokenizer(), block_size=4, num_blocks=300)


def texts(llm, prompt, params: SamplingParams):
    """The completion's text decoded once, followed token by token (a stop string that never
    matches), and streamed by AsyncLLM: (output, the three texts)."""
    out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    followed = llm.generate(prompt, SamplingParams(**{**vars_of(params),
                                                      "stop": params.stop + ["never"]}),
                            use_tqdm=False)[0].outputs[0]
    assert followed.token_ids == out.token_ids

    async def stream():
        engine = AsyncLLM(llm.engine.model, llm.tokenizer, block_size=4, num_blocks=300)
        try:
            text = ""
            async for step in engine.generate(prompt, params, "s"):
                assert step.outputs[0].text.startswith(text)  # a stream only appends
                text = step.outputs[0].text
            return text
        finally:
            engine.shutdown()

    return out, (out.text, followed.text, asyncio.run(stream()))


def vars_of(params: SamplingParams) -> dict:
    from hf_paged.sampling_params import PARAM_NAMES

    return {name: getattr(params, name) for name in PARAM_NAMES}


def test_special_tokens_stay_in_the_text_when_asked(llm):
    tok = llm.tokenizer
    base = dict(temperature=0, max_tokens=10, ignore_eos=True, repetition_penalty=50.0,
                allowed_token_ids=[BOS, EOS, 5, 6, 7], logit_bias={BOS: 1.0, EOS: 1.0})
    for skip in (True, False):
        out, got = texts(llm, "w5 w6", SamplingParams(skip_special_tokens=skip, **base))
        assert {BOS, EOS} & set(out.token_ids), out.token_ids  # the test is about them
        assert got == (tok.decode(out.token_ids, skip_special_tokens=skip),) * 3
        assert ("</s>" in got[0] or "<s>" in got[0]) != skip


def test_stop_strings_and_stop_tokens_kept_in_the_text_when_asked(llm):
    tok = llm.tokenizer
    prompt = "w5 w6 w7 w8"
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    words = free.text.split()
    stop = " ".join(words[3:5])
    cut = free.text[:free.text.index(stop)]
    for include in (False, True):
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop],
                                include_stop_str_in_output=include)
        out, got = texts(llm, prompt, params)
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert got == ((cut + stop) if include else cut,) * 3
    # Stop strings completed by one token: the one that ends first wins, of two ending
    # together the first listed (what vLLM finds when the text comes a character at a time).
    word = words[3]
    assert len(word) > 1
    for stops in ([word, word[:-1]], [word[:-1], word]):
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=stops,
                                include_stop_str_in_output=True)
        out, got = texts(llm, prompt, params)
        assert out.stop_reason == word[:-1] and got == (cut + word[:-1],) * 3
    for stops in ([word, word[1:]], [word[1:], word]):
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=stops,
                                include_stop_str_in_output=True)
        out, got = texts(llm, prompt, params)
        assert out.stop_reason == stops[0] and got == (cut + word,) * 3
    # a stop token's text (as an EOS's) is left out unless asked for
    target = free.token_ids[4]
    first = free.token_ids.index(target)
    for include in (False, True):
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                stop_token_ids=[target], include_stop_str_in_output=include)
        out, got = texts(llm, prompt, params)
        assert out.token_ids == free.token_ids[:first + 1] and out.stop_reason == target
        kept = out.token_ids if include else out.token_ids[:-1]
        assert got == (tok.decode(kept, skip_special_tokens=True),) * 3
        assert got[0].endswith(tok.decode([target])) == include
    # the model's EOS, with special tokens shown
    params = SamplingParams(temperature=0, max_tokens=12, skip_special_tokens=False,
                            allowed_token_ids=[EOS, 5], logit_bias={EOS: 5.0})
    for include in (False, True):
        params = SamplingParams(**{**vars_of(params), "include_stop_str_in_output": include})
        out, got = texts(llm, prompt, params)
        assert out.token_ids[-1] == EOS and out.finish_reason == "stop"
        assert got == (tok.decode(out.token_ids[:len(out.token_ids) - (not include)],
                                  skip_special_tokens=False),) * 3
        assert got[0].endswith("</s>") == include


# -- output kinds ----------------------------------------------------------------------------------
def collect(llm, prompt, params: SamplingParams) -> list:
    async def run():
        engine = AsyncLLM(llm.engine.model, llm.tokenizer, block_size=4, num_blocks=300)
        try:
            return [out async for out in engine.generate(prompt, params)]
        finally:
            engine.shutdown()

    return asyncio.run(run())


def test_delta_and_final_only_outputs_add_up_to_the_cumulative_ones(llm):
    prompt = "w5 w6 w7 w8"
    base = vars_of(SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=12, logprobs=2,
                                  prompt_logprobs=1, ignore_eos=True, stop=["w9 w9"]))
    whole = collect(llm, prompt, SamplingParams(**base))
    deltas = collect(llm, prompt, SamplingParams(**{**base, "output_kind": "delta"}))
    final = collect(llm, prompt, SamplingParams(**{**base, "output_kind": RequestOutputKind
                                                   .FINAL_ONLY}))
    assert len(whole) > 2 and len(deltas) == len(whole)
    assert len(final) == 1 and final[0].outputs == whole[-1].outputs and final[0].finished
    assert deltas[0].prompt_logprobs == whole[-1].prompt_logprobs
    assert all(d.prompt_logprobs is None for d in deltas[1:])
    for c in whole[-1].outputs:
        parts = [p for d in deltas for p in d.outputs if p.index == c.index]
        assert "".join(p.text for p in parts) == c.text
        assert [t for p in parts for t in p.token_ids] == c.token_ids
        assert [e for p in parts for e in p.logprobs] == c.logprobs
        assert parts[-1].finish_reason == c.finish_reason and parts[-1].cumulative_logprob == \
            c.cumulative_logprob
        assert all(p.token_ids or p.text or p.finished for p in parts)  # nothing empty sent
    # LLM.generate returns whole requests whatever the kind
    kinds = [llm.generate(prompt, SamplingParams(**{**base, "output_kind": kind}),
                          use_tqdm=False)[0].outputs for kind in RequestOutputKind]
    assert kinds[0] == kinds[1] == kinds[2] == whole[-1].outputs


def test_engine_steps_follow_the_output_kind():
    model = long_model("llama_gqa")
    engine = LLMEngine(model, block_size=4, num_blocks=100)
    kinds = {"c": "cumulative", "d": "delta", "f": "final_only"}
    for rid, kind in kinds.items():
        engine.add_request(rid, [5, 6, 7], SamplingParams(temperature=0, max_tokens=5,
                                                           ignore_eos=True, output_kind=kind))
    seen = {rid: [] for rid in kinds}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    assert [len(seen[r]) for r in "cdf"] == [5, 5, 1]
    tokens = seen["c"][-1].outputs[0].token_ids
    assert [d.outputs[0].token_ids for d in seen["d"]] == [[t] for t in tokens]
    assert seen["f"][0].outputs[0].token_ids == tokens
    with pytest.raises(InvalidRequestError, match="output_kind"):
        SamplingParams(output_kind="deltas")


def test_bad_words_keep_the_min_tokens_mask():
    llm = LLM(long_model("llama_gqa"), make_tokenizer(), block_size=4, num_blocks=100)
    base = dict(temperature=0, max_tokens=12, min_tokens=8, logit_bias={EOS: 50.0})
    plain = llm.generate([[5, 6, 7]], SamplingParams(**base), use_tqdm=False)[0].outputs[0]
    banned = llm.generate([[5, 6, 7]], SamplingParams(**base, bad_words=["w7"]),
                          use_tqdm=False)[0].outputs[0]
    assert len(plain.token_ids) == len(banned.token_ids) == 9  # EOS right after min_tokens
    assert banned.token_ids[-1] == EOS and 7 not in banned.token_ids


def test_bad_words_the_model_cannot_generate_are_refused():
    tok = make_tokenizer()
    tok.add_tokens(["zz1", "zz2", "zz3"])  # ids past the model's vocabulary
    llm = LLM(long_model("llama_gqa"), tok, block_size=4, num_blocks=100)
    with pytest.raises(InvalidRequestError, match="bad_words"):
        llm.generate([[5, 6]], SamplingParams(max_tokens=3, bad_words=["w5 zz3"]),
                     use_tqdm=False)
    out = llm.generate([[5, 6]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True,
                                                bad_words=["w9"]), use_tqdm=False)
    assert 9 not in out[0].outputs[0].token_ids


def test_stop_strings_wait_for_min_tokens_and_are_found_in_a_stop_tokens_text(llm):
    prompt = "w5 w6 w7 w8"
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    words = free.text.split()
    j = next(j for j in range(1, 6) if words[j] not in words[:j] + words[j + 1:])
    for min_tokens, reason in ((0, "stop"), (j + 1, "length")):  # (vLLM: output > min_tokens)
        out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                  stop=[words[j]], min_tokens=min_tokens),
                           use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == reason
        assert out.text == (free.text[:free.text.index(words[j])] if reason == "stop"
                            else free.text)
    # a stop token whose own (kept) text completes a stop string: the string is the reason
    pair = f"{words[j - 1]} {words[j]}"
    out = llm.generate(prompt, SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, stop=[pair],
        stop_token_ids=[free.token_ids[j]], include_stop_str_in_output=True),
        use_tqdm=False)[0].outputs[0]
    assert out.stop_reason == pair and out.text == free.text[:free.text.index(pair) + len(pair)]


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_out_before_min_tokens_never_ends_it_later(llm, include):
    """A stop string wholly in the text of the first min_tokens tokens is not matched once
    stop strings count (vLLM's rule), however long the request's other stop strings are, so
    that a stream, which may already have shown what follows it, equals the final text."""
    prompt = "w5 w6 w7 w8"
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    words = free.text.split()
    j = next(j for j in range(1, 6) if words[j] not in words[:j] + words[j + 1:])
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, min_tokens=j + 2,
                            stop=[words[j], "\x00" * 12], include_stop_str_in_output=include)
    final = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    assert final.finish_reason == "length" and final.text == free.text
    engine = llm.engine
    engine.add_request("d", prompt, replace(params, output_kind=RequestOutputKind.DELTA))
    shown = ""
    while engine.has_unfinished_requests():
        shown += "".join(c.text for out in engine.step() for c in out.outputs)
    assert shown == final.text


@pytest.mark.parametrize("value, kind", [(0, "cumulative"), (1, "delta"), (2, "final_only"),
                                         (RequestOutputKind.DELTA, "delta")])
def test_output_kinds_take_vllms_values(value, kind):
    assert SamplingParams(output_kind=value).output_kind is RequestOutputKind(kind)


def test_numpy_ids_are_token_ids_and_biases_past_float32_are_refused():
    import numpy as np

    p = SamplingParams(logit_bias={np.int64(5): 1.5}, allowed_token_ids=[np.int32(7)])
    assert p.logit_bias == {5: 1.5} and p.allowed_token_ids == [7]
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        SamplingParams(logit_bias={5: 1e39})


def test_deltas_not_delivered_to_a_slow_reader_come_with_its_last_output():
    model = long_model("llama_gqa")

    async def run(kind):
        engine = AsyncLLM(model, block_size=4, num_blocks=400, max_unread_outputs=3)
        try:
            stream = engine.add([5, 6, 7], SamplingParams(temperature=0, max_tokens=1300,
                                                          ignore_eos=True, output_kind=kind))
            # The reader takes nothing: after the grace its request is aborted.
            for _ in range(1000):
                if stream.unread >= 3 and not engine.engine.requests:
                    break
                await asyncio.sleep(0.01)
            return [out async for out in stream], engine.engine.output.generation_tokens
        finally:
            engine.shutdown()

    (*_, whole), _ = asyncio.run(run("cumulative"))
    deltas, generated = asyncio.run(run("delta"))
    assert whole.outputs[0].finish_reason == "abort"
    assert deltas[-1].outputs[0].finish_reason == "abort"
    tokens = [t for out in deltas for c in out.outputs for t in c.token_ids]
    assert len(tokens) == generated > 3  # every token generated reached the reader
    assert tokens == stock(model, [5, 6, 7], generated)


def test_settings_that_leave_no_token_fail_their_request_alone():
    llm = LLM(long_model("llama_gqa"), make_tokenizer(), block_size=4, num_blocks=100)
    plain = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    empty = SamplingParams(temperature=0, max_tokens=6, allowed_token_ids=[5], bad_words=["w5"])
    outs = llm.generate([[5, 6, 7], [8, 9], [5, 6, 7]], [plain, empty, plain], use_tqdm=False)
    assert outs[1].outputs[0].finish_reason == "error" and "not finite" in outs[1].error
    assert outs[0].outputs[0].token_ids == outs[2].outputs[0].token_ids == \
        stock(llm.engine.model, [5, 6, 7], 6)
