"""Falcon's ALiBi as Transformers computes it: `build_alibi_tensor` rounds the slope, the
key position and their product to bfloat16, so from 256 tokens on (and for slopes that are
not powers of two, earlier) the bias is not slope * t. The paged paths reproduce that
rounding, and their tokens equal stock `generate` past it."""

from __future__ import annotations

import random

import pytest
import torch
from transformers.models.falcon.modeling_falcon import build_alibi_tensor

import hf_paged
from hf_paged import LLM, SamplingParams
from hf_paged.hf.falcon import alibi_slopes
from hf_paged.kernels import reference
from conftest import PAD, VOCAB, make_model


@pytest.mark.parametrize("heads", [4, 6, 12, 32, 71])
def test_the_bias_equals_transformers_own_builder(heads):
    positions = 2048
    stock = build_alibi_tensor(torch.ones(1, positions, dtype=torch.long), heads,
                               torch.float32)[:, 0, :]  # [H, T]
    ours = reference.alibi_bias(alibi_slopes(heads)[:, None], torch.arange(positions), 1.0)
    assert torch.equal(ours, stock)
    assert not torch.equal(alibi_slopes(heads)[:, None] * torch.arange(positions), stock)


@pytest.fixture(scope="module")
def falcon():
    return make_model("falcon_alibi")


def stock_greedy(model, prompt, n):
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                         do_sample=False, eos_token_id=None, pad_token_id=PAD)
    return out[0, len(prompt):].tolist()


def long_prompts():
    rng = random.Random(3)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (300, 420, 250)]


def test_engine_past_256_tokens_equals_stock_logprob_for_logprob(falcon):
    """Tokens, and the top log-probabilities of every step to float32 tolerance."""
    prompts = long_prompts()
    stock = []
    for p in prompts:
        ids = torch.tensor([p])
        out = falcon.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24,
                              do_sample=False, eos_token_id=None, pad_token_id=PAD,
                              output_logits=True, return_dict_in_generate=True)
        stock.append((out.sequences[0, len(p):].tolist(),
                      [torch.log_softmax(x[0].float(), -1) for x in out.logits]))
    llm = LLM(falcon, block_size=16, num_blocks=128, max_num_batched_tokens=256)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                logprobs=3), use_tqdm=False)
    for out, (tokens, logprobs) in zip(outs, stock):
        assert out.outputs[0].token_ids == tokens
        for step, ref in zip(out.outputs[0].logprobs, logprobs):
            ids = sorted(step)
            torch.testing.assert_close(torch.tensor([step[i] for i in ids]), ref[ids],
                                       rtol=1e-4, atol=1e-4)


def test_generate_past_256_tokens_equals_stock_logit_for_logit(falcon):
    """Tokens, and every step's logits to float32 tolerance (unrounded ALiBi moves them by
    about 1e-2 here: more than the tolerance, less than most argmax margins)."""
    prompts = long_prompts()[:2]
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    starts = torch.tensor([width - len(p) for p in prompts])
    mask = (torch.arange(width)[None, :] >= starts[:, None]).long()
    kwargs = dict(attention_mask=mask, max_new_tokens=24, do_sample=False, eos_token_id=None,
                  pad_token_id=PAD, output_logits=True, return_dict_in_generate=True)
    stock = falcon.generate(ids, **kwargs)
    paged = falcon.generate(ids, cache_implementation="paged", **kwargs)
    assert paged.sequences.tolist() == stock.sequences.tolist()
    torch.testing.assert_close(torch.stack(paged.logits), torch.stack(stock.logits),
                               rtol=1e-4, atol=1e-4)


def test_an_eager_alibi_falcon_sharing_a_config_that_ran_paged_is_still_refused():
    """`_from_config(config, attn_implementation="eager")` sets the shared config to eager
    in place. A paged call on the first model must not leave its "sdpa" remembered for the
    second: Transformers' eager Falcon adds ALiBi twice, so that one runs stock."""
    sdpa = make_model("falcon_alibi")
    ids = torch.randint(3, 60, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :4], ids[0, :4] = 0, PAD
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
              eos_token_id=None, pad_token_id=PAD)
    sdpa.generate(**kw, cache_implementation="paged")
    eager = type(sdpa)._from_config(sdpa.config, attn_implementation="eager")
    eager.load_state_dict(sdpa.state_dict())
    eager.eval()
    assert eager.config is sdpa.config and sdpa.config._attn_implementation == "eager"
    ref = eager.generate(**kw)
    with pytest.warns(UserWarning, match="adds the ALiBi term twice"):
        out = eager.generate(**kw, cache_implementation="paged", return_dict_in_generate=True)
    assert not isinstance(out.past_key_values, hf_paged.PagedCache)
    assert torch.equal(out.sequences, ref)
