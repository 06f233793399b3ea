"""Prompt log-probabilities in the engine against the log-softmax of one stock forward over
the whole prompt (DynamicCache-free, float32, CPU): across chunked prefill, prefix-cache
hits, preemption both ways, n > 1, async scheduling and requests that want none next to
them."""

from __future__ import annotations

import math
import random

import pytest
import torch

from hf_paged import LLM, LLMEngine, SamplingParams
from conftest import VOCAB, make_model
from test_engine import run_engine

KINDS = ["llama_gqa", "mistral_sw", "falcon_alibi"]
_models: dict = {}


def model_of(kind):
    if kind not in _models:
        _models[kind] = make_model(kind, sliding_window=24, max_position_embeddings=512)
    return _models[kind]


def stock_prompt_logprobs(model, prompt, k):
    """Per prompt token: None, then {its id: lp} and the k most likely ids at its position."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    out = [None]
    for p in range(len(prompt) - 1):
        entry = {}
        if k:
            top = lp[p].topk(k)
            entry = dict(zip(top.indices.tolist(), top.values.tolist()))
        entry[prompt[p + 1]] = lp[p, prompt[p + 1]].item()
        out.append(entry)
    return out


def assert_close(got, want, tol=1e-4):
    assert len(got) == len(want)
    assert got[0] is None and want[0] is None
    for p, (g, w) in enumerate(zip(got[1:], want[1:]), 1):
        assert g.keys() == w.keys(), (p, g, w)
        for t in w:
            assert math.isclose(g[t], w[t], abs_tol=tol), (p, t, g[t], w[t])


def prompts(seed, count, lo=2, hi=60, shared=None):
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        own = [rng.randrange(3, VOCAB) for _ in range(rng.randint(lo, hi))]
        out.append((shared or []) + own if shared else own)
    return out


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("budget", [7, 2048])
def test_prompt_logprobs_equal_stock(kind, budget):
    """Chunked (7 tokens a step) or whole prompts, mixed with requests that want none."""
    model = model_of(kind)
    ps = prompts(1, 6)
    llm = LLM(model, block_size=4, num_blocks=256, max_num_seqs=4,
              max_num_batched_tokens=budget)
    params = [SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=i % 3 if i % 2 == 0
                             else None) for i in range(len(ps))]
    outs = llm.generate(ps, params, use_tqdm=False)
    for prompt, p, out in zip(ps, params, outs):
        assert out.error is None
        if p.prompt_logprobs is None:
            assert out.prompt_logprobs is None
        else:
            assert_close(out.prompt_logprobs, stock_prompt_logprobs(model, prompt,
                                                                    p.prompt_logprobs))


def test_prefix_cache_hit_keeps_prompt_logprobs():
    """A prompt whose blocks are cached: a request wanting prompt logprobs computes them
    anyway (no hit covers them); one that wants none still hits."""
    model = model_of("llama_gqa")
    shared = prompts(2, 1, 40, 40)[0]
    llm = LLM(model, block_size=4, num_blocks=256, max_num_seqs=4)
    greedy = SamplingParams(temperature=0, max_tokens=2)
    llm.generate([shared + [5]], greedy, use_tqdm=False)  # caches the shared blocks
    out = llm.generate([shared + [7, 8]], SamplingParams(temperature=0, max_tokens=2,
                                                         prompt_logprobs=2), use_tqdm=False)[0]
    assert out.num_cached_tokens == 0
    assert_close(out.prompt_logprobs, stock_prompt_logprobs(model, shared + [7, 8], 2))
    hit = llm.generate([shared + [9]], greedy, use_tqdm=False)[0]
    assert hit.num_cached_tokens >= 36


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_prompt_logprobs_through_preemption(mode):
    """A pool too small for every request at once: sequences are preempted mid-prompt or
    mid-output and come back; their prompt logprobs stay equal to stock, and their tokens
    to the run without preemption."""
    model = model_of("llama_gqa")
    ps = prompts(3, 8, 20, 50)
    params = SamplingParams(temperature=0, max_tokens=12, prompt_logprobs=1, ignore_eos=True)
    roomy = LLM(model, block_size=4, num_blocks=512, max_num_seqs=8)
    ref = roomy.generate(ps, params, use_tqdm=False)
    engine = LLMEngine(model, block_size=4, num_blocks=30, max_num_seqs=8,
                       max_num_batched_tokens=16, preemption_mode=mode, admission_headroom=0)
    done = run_engine(engine, ps, params)
    assert engine.stats().num_preemptions > 0
    for i, p in enumerate(ps):
        out = done[str(i)]
        assert out.outputs[0].token_ids == ref[i].outputs[0].token_ids
        assert_close(out.prompt_logprobs, stock_prompt_logprobs(model, p, 1))


def test_prompt_logprobs_with_n_and_async():
    model = model_of("llama_gqa")
    ps = prompts(4, 4)
    params = SamplingParams(n=3, temperature=0.8, seed=5, max_tokens=4, prompt_logprobs=4)
    for async_scheduling in (False, True):
        llm = LLM(model, block_size=4, num_blocks=256, max_num_seqs=8, max_num_batched_tokens=9,
                  async_scheduling=async_scheduling)
        for prompt, out in zip(ps, llm.generate(ps, params, use_tqdm=False)):
            assert len(out.outputs) == 3
            assert_close(out.prompt_logprobs, stock_prompt_logprobs(model, prompt, 4))


def test_one_token_prompt_and_range():
    model = model_of("llama_gqa")
    llm = LLM(model, block_size=4, num_blocks=64)
    out = llm.generate([[9]], SamplingParams(max_tokens=2, prompt_logprobs=3),
                       use_tqdm=False)[0]
    assert out.prompt_logprobs == [None]
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)


def test_nan_prompt_logits_fail_that_request_alone():
    """A request whose prompt logits are NaN ends with an error; the others do not."""
    model = make_model("llama_gqa", seed=3)
    poison = VOCAB - 1
    with torch.no_grad():
        model.get_input_embeddings().weight[poison] = float("nan")
    ps = [[t for t in p if t != poison] for p in prompts(5, 4, 5, 20)]
    ps[1] = ps[1][:3] + [poison] + ps[1][3:]
    llm = LLM(model, block_size=4, num_blocks=128)
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=1)
    outs = llm.generate(ps, params, use_tqdm=False)
    assert outs[1].error is not None
    for i in (0, 2, 3):
        assert outs[i].error is None
        assert_close(outs[i].prompt_logprobs, stock_prompt_logprobs(model, ps[i], 1))
