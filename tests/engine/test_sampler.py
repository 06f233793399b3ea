"""The engine's sampler against Transformers' own logits processors on the same logits, and
the request settings end to end (stop strings, stop token ids, min_tokens, ignore_eos,
logprobs, n)."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor, MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper,
)

from hf_paged import LLM, SamplingParams
from hf_paged.sampler import Sampler, SampleRow
from hf_paged.sampling_params import FALLBACKS
from conftest import EOS, make_tokenizer

VOCAB = 50


def params(**kw):
    return SamplingParams(**kw).resolved({})


def hf_scores(logits, tokens, p: SamplingParams, generated: int = 0, eos=EOS):
    """Transformers' processors, in generate's order, on one row."""
    ids = torch.tensor([tokens])
    scores = logits[None].clone()
    if p.repetition_penalty != 1.0:
        scores = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, scores)
    if p.min_tokens:
        prompt_len = len(tokens) - generated
        scores = MinNewTokensLengthLogitsProcessor(prompt_len, p.min_tokens, eos)(ids, scores)
    if p.temperature != 1.0:
        scores = TemperatureLogitsWarper(p.temperature)(ids, scores)
    if p.top_k not in (0, -1):
        scores = TopKLogitsWarper(p.top_k)(ids, scores)
    if p.top_p < 1.0:
        scores = TopPLogitsWarper(p.top_p)(ids, scores)
    if p.min_p:
        scores = MinPLogitsWarper(p.min_p)(ids, scores)
    return scores[0]


SETTINGS = [
    dict(temperature=0.7), dict(temperature=1.3, top_k=5), dict(top_p=0.8),
    dict(temperature=0.5, top_p=0.6, top_k=10), dict(min_p=0.1), dict(temperature=0.9, min_p=0.05),
    dict(repetition_penalty=1.5), dict(repetition_penalty=0.7, top_k=3),
    dict(repetition_penalty=1.2, temperature=0.8, top_p=0.9, min_p=0.02),
    dict(min_tokens=3, max_tokens=10), dict(top_k=1), dict(top_p=0.01),
]


def test_distributions_match_transformers_processors_row_by_row():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(len(SETTINGS), VOCAB, generator=g) * 3
    logits[:, 7] = logits[:, 8]  # a tie, kept by top-k as Transformers keeps it
    rows = []
    for i, kw in enumerate(SETTINGS):
        prompt = torch.randint(0, VOCAB, (6,), generator=g).tolist()
        output = torch.randint(0, VOCAB, (2,), generator=g).tolist()
        p = params(**kw)
        suppress = [EOS] if len(output) < p.min_tokens else None
        rows.append(SampleRow(p, prompt, output, suppress=suppress))
    sampler = Sampler()
    ours = sampler.warp(sampler.penalize(logits.clone(), rows), rows).softmax(-1)
    for i, row in enumerate(rows):
        ref = hf_scores(logits[i], row.prompt + row.output, row.params, len(row.output))
        torch.testing.assert_close(ours[i], ref.softmax(-1), rtol=1e-5, atol=1e-6,
                                   msg=f"settings {SETTINGS[i]}")


def test_presence_and_frequency_penalties_follow_openai():
    logits = torch.randn(2, VOCAB)
    output = [3, 3, 3, 9]
    rows = [SampleRow(params(presence_penalty=0.5, frequency_penalty=0.25), [1, 2], output),
            SampleRow(params(), [1, 2], output)]
    got = Sampler().penalize(logits.clone(), rows)
    expected = logits[0].clone()
    expected[3] -= 0.25 * 3 + 0.5
    expected[9] -= 0.25 * 1 + 0.5
    torch.testing.assert_close(got[0], expected)
    torch.testing.assert_close(got[1], logits[1])  # penalties are per row


def test_sampling_draws_from_the_distribution_and_seeds_repeat():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(20000, 1)
    rows = [SampleRow(params(temperature=1.0), [], [])] * 20000
    tokens = torch.tensor(Sampler()(logits, rows).tokens)
    freq = torch.bincount(tokens, minlength=4).float() / len(tokens)
    torch.testing.assert_close(freq, logits[0].softmax(-1), atol=0.015, rtol=0)
    seeded = [SampleRow(params(temperature=1.0), [], [], torch.Generator().manual_seed(3))
              for _ in range(2)]
    a = Sampler()(logits[:2] * 0, seeded).tokens
    seeded = [SampleRow(params(temperature=1.0), [], [], torch.Generator().manual_seed(3))]
    b = Sampler()(logits[:1] * 0, seeded).tokens
    assert a[0] == a[1] == b[0]


def test_defaults_come_from_the_generation_config():
    from transformers import GenerationConfig

    from hf_paged.sampling_params import generation_defaults

    config = GenerationConfig(temperature=0.6, top_p=0.9, max_new_tokens=40, do_sample=True)
    got = SamplingParams(top_p=0.5).resolved(generation_defaults(config))
    assert (got.temperature, got.top_p, got.max_tokens, got.top_k) == (0.6, 0.5, 40,
                                                                        FALLBACKS["top_k"])
    greedy = SamplingParams().resolved(generation_defaults(GenerationConfig(do_sample=False)))
    assert greedy.temperature == 0.0


@pytest.mark.parametrize("bad, match", [
    (dict(n=0), "n must be"), (dict(max_tokens=-1), "max_tokens"), (dict(temperature=-1),
                                                                    "temperature"),
    (dict(top_p=0), "top_p"), (dict(top_k=-2), "top_k"), (dict(logprobs=50), "logprobs"),
    (dict(stop=[""]), "stop"), (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    (dict(presence_penalty=3), "presence_penalty"), (dict(n=True), "n must be"),
])
def test_invalid_settings_are_named(bad, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**bad)


# -- end to end ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm():
    from test_engine import long_model

    return LLM(long_model("llama_gqa"), make_tokenizer(), block_size=4, num_blocks=200)


def stock(model, prompt_ids, **kw):
    out = model.generate(torch.tensor([prompt_ids]), do_sample=False, pad_token_id=0,
                         return_dict_in_generate=True, output_logits=True, **kw)
    return out


def test_stop_strings_stop_tokens_min_tokens_ignore_eos(llm):
    tok = llm.tokenizer
    model = llm.engine.model
    prompt = "w5 w6 w7 w8"
    ids = tok(prompt)["input_ids"]
    ref = stock(model, ids, max_new_tokens=12, eos_token_id=None).sequences[0, len(ids):].tolist()
    text = tok.decode(ref, skip_special_tokens=True)
    words = text.split()
    # stop string: the text ends before it, the tokens that made it are kept
    stop = " ".join(words[3:5])
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, stop=[stop],
                                              ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[:text.index(stop)]
    assert out.token_ids == ref[:5]
    # stop token id: included in token_ids, reported as the reason
    target = ref[4]
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12,
                                              stop_token_ids=[target], ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    first = ref.index(target)
    assert out.token_ids == ref[:first + 1] and out.stop_reason == target
    # the model's EOS ends a completion unless ignore_eos; min_tokens holds it back
    llm.engine.eos_ids = {target}
    try:
        out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
        assert out[0].outputs[0].token_ids == ref[:first + 1]
        assert out[0].outputs[0].finish_reason == "stop" and out[0].outputs[0].stop_reason is None
        long = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0]
        assert long.token_ids == ref and long.finish_reason == "length"
        held = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12,
                                                   min_tokens=first + 2), use_tqdm=False)
        ref_min = stock(model, ids, max_new_tokens=12, eos_token_id=target,
                        min_new_tokens=first + 2).sequences[0, len(ids):].tolist()
        assert held[0].outputs[0].token_ids == ref_min
        assert target not in held[0].outputs[0].token_ids[:first + 2]
    finally:
        llm.engine.eos_ids = {EOS}


def test_logprobs_are_the_model_distribution(llm):
    model = llm.engine.model
    ids = [5, 9, 13, 40]
    ref = stock(model, ids, max_new_tokens=5, eos_token_id=None)
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=5, logprobs=3,
                                             ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 5
    total = 0.0
    for step, (entry, token) in enumerate(zip(out.logprobs, out.token_ids)):
        expected = torch.log_softmax(ref.logits[step][0].float(), -1)
        top = expected.topk(3)
        assert set(top.indices.tolist()) | {token} == set(entry)
        for t, lp in entry.items():
            assert lp == pytest.approx(expected[t].item(), abs=1e-4)
        total += entry[token]
    assert out.cumulative_logprob == pytest.approx(total, abs=1e-4)


def test_penalized_greedy_matches_stock_generate(llm):
    model = llm.engine.model
    ids = [5, 9, 13, 40, 5, 9]
    ref = stock(model, ids, max_new_tokens=10, eos_token_id=None, repetition_penalty=1.8)
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                             repetition_penalty=1.8), use_tqdm=False)
    assert out[0].outputs[0].token_ids == ref.sequences[0, len(ids):].tolist()


def test_n_completions_differ_and_each_respects_the_settings(llm):
    out = llm.generate("w5 w6", SamplingParams(n=4, temperature=1.5, max_tokens=8, seed=11,
                                               ignore_eos=True), use_tqdm=False)[0]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert all(len(c.token_ids) == 8 for c in out.outputs)
