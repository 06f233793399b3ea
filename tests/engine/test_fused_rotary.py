"""The engine's rotary switch (hf/rotary.py): Llama's `apply_rotary_pos_emb` in one pass of
the CPU kernel inside the engine's forwards, with Transformers' values bit for bit; its own
ops everywhere else (other threads, autograd, other dtypes and layouts)."""

from __future__ import annotations

import sys
import threading

import pytest
import torch
from transformers.models.llama import modeling_llama

from conftest import make_model
from hf_paged import LLM, SamplingParams
from hf_paged.hf import rotary
from hf_paged.hf.register import switch_rotary
from hf_paged.kernels import cpu_ops
from test_engine import random_prompts, stock_greedy
from zoo import make_arch

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="no CPU kernels here")


def switched_llama_function():
    """Llama's module function, switched (as an engine on a Llama model leaves it)."""
    assert switch_rotary(make_model("llama_gqa"), CPU) is rotary.fused_rotary
    function = modeling_llama.apply_rotary_pos_emb
    assert function.own is not None
    return function, function.own


def inputs(batch, tokens, heads, kv_heads, dim, layout="engine", scale=1.0, seed=0):
    """q [B, Hq, N, D], k [B, Hk, N, D] as an attention layer makes them, cos and sin
    [B, N, D] (random: the kernel must not assume cos^2 + sin^2 = 1)."""
    g = torch.Generator().manual_seed(seed)
    def states(h):
        x = torch.randn(batch, tokens, h * dim, generator=g) * scale
        if layout == "engine":  # a projection's rows, viewed per head
            return x.view(batch, tokens, h, dim).transpose(1, 2)
        if layout == "contiguous":
            return x.view(batch, tokens, h, dim).transpose(1, 2).contiguous()
        # a slice of a wider head (partial rotary): strided rows, contiguous last dim
        wide = torch.randn(batch, h, tokens, dim * 2, generator=g) * scale
        return wide[..., :dim]
    cos, sin = (torch.randn(batch, tokens, dim, generator=g) for _ in range(2))
    return states(heads), states(kv_heads), cos, sin


@pytest.mark.parametrize("batch,tokens,heads,kv_heads,dim,layout", [
    (1, 64, 4, 2, 16, "engine"),      # a decode step of 64 rows
    (1, 1, 8, 1, 128, "engine"),      # one row, multi-query
    (1, 1500, 4, 4, 64, "engine"),    # a prefill: the kernel's threads
    (3, 7, 4, 2, 16, "contiguous"),   # a padded generate batch
    (2, 5, 4, 2, 8, "strided"),       # partial rotary's slice of each head
])
def test_switched_function_equals_transformers_bit_for_bit(batch, tokens, heads, kv_heads, dim,
                                                           layout):
    function, own = switched_llama_function()
    for scale in (1.0, 1e4, 1e-20):
        q, k, cos, sin = inputs(batch, tokens, heads, kv_heads, dim, layout, scale)
        with torch.inference_mode():
            expected = own(q, k, cos, sin)
            with rotary.fused_rotary():
                got = function(q, k, cos, sin)
        for e, g in zip(expected, got):
            assert g.shape == e.shape and g.stride() == e.stride() or tokens == 1
            assert torch.equal(g, e)


def test_non_finite_values_follow_transformers():
    function, own = switched_llama_function()
    q, k, cos, sin = inputs(1, 4, 2, 2, 8)
    q[0, 0, 0, 0], q[0, 1, 2, 5], k[0, 1, 3, 1], cos[0, 2, 3] = float("inf"), float("nan"), \
        -float("inf"), float("inf")
    with torch.inference_mode(), rotary.fused_rotary():
        got = function(q, k, cos, sin)
    for e, g in zip(own(q, k, cos, sin), got):
        assert torch.equal(e.isnan(), g.isnan())
        assert torch.equal(e.nan_to_num(0.0), g.nan_to_num(0.0))


def counting(monkeypatch) -> list:
    """The shapes of the queries the kernel rotates from now on (not those it declines)."""
    calls = []
    kernel = cpu_ops.rotary()

    def counted(*args):
        out = kernel(*args)
        if out is not None:
            calls.append(args[0].shape)
        return out

    monkeypatch.setattr(rotary, "_kernel", counted)
    return calls


def test_transformers_ops_run_what_the_kernel_does_not_take(monkeypatch):
    function, own = switched_llama_function()
    calls = counting(monkeypatch)
    q, k, cos, sin = inputs(1, 3, 4, 2, 8)
    with rotary.fused_rotary():
        with torch.inference_mode():  # other dtypes, odd dims, other broadcasts
            half = [t.to(torch.bfloat16) for t in (q, k, cos, sin)]
            assert all(torch.equal(a, b) for a, b in zip(function(*half), own(*half)))
            odd = [t[..., :7] for t in (q, k, cos, sin)]
            assert all(torch.equal(a, b) for a, b in zip(function(*odd), own(*odd)))
            nhd = (q.transpose(1, 2), k.transpose(1, 2), cos, sin)  # [B, N, H, D] layouts
            assert all(torch.equal(a, b) for a, b in zip(function(*nhd, unsqueeze_dim=2),
                                                         own(*nhd, unsqueeze_dim=2)))
        assert not calls
        q.requires_grad_(True)  # autograd: Transformers' ops, with their gradients
        q_out, _ = function(q, k, cos, sin)
        q_out.sum().backward()
        assert q.grad is not None and not calls
    with torch.inference_mode():
        function(q.detach(), k, cos, sin)  # outside the switch
    assert not calls


def test_the_switch_belongs_to_the_thread_that_sets_it(monkeypatch):
    function, own = switched_llama_function()
    calls = counting(monkeypatch)
    q, k, cos, sin = inputs(1, 3, 4, 2, 8)
    started, done = threading.Event(), threading.Event()
    seen = []

    def other():
        started.wait(10)
        with torch.inference_mode():
            function(q, k, cos, sin)
        seen.append(len(calls))
        done.set()

    thread = threading.Thread(target=other)
    thread.start()
    with torch.inference_mode(), rotary.fused_rotary():
        started.set()
        assert done.wait(10)
        assert seen == [0]
        function(q, k, cos, sin)
    thread.join()
    assert len(calls) == 1


def test_only_modules_with_llamas_function_are_switched():
    for name in ("qwen2", "gemma", "gemma3"):  # copies of Llama's function
        model = make_arch(name)
        assert switch_rotary(model, CPU) is rotary.fused_rotary
        assert sys.modules[type(model).__module__].apply_rotary_pos_emb.own is not None
    for name in ("phi3", "gpt_oss", "glm4"):  # their own rotary arithmetic
        model = make_arch(name)
        assert switch_rotary(model, CPU) is not rotary.fused_rotary
        assert not hasattr(sys.modules[type(model).__module__].apply_rotary_pos_emb, "own")


def logprobs_of(llm, prompts):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
    return [(o.outputs[0].token_ids, [sorted(d.items()) for d in o.outputs[0].logprobs])
            for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("kind", ["llama_gqa", "mistral_sw", "falcon_new", "qwen3"])
def test_engine_forwards_take_the_kernel_with_the_same_logprobs(kind, monkeypatch):
    model = make_model(kind) if kind != "qwen3" else make_arch(kind)
    prompts = random_prompts(3, 5, 2, 20)
    stock = [stock_greedy(model, p, 6) for p in prompts]
    calls = counting(monkeypatch)
    fused = logprobs_of(LLM(model, block_size=4, num_blocks=96), prompts)
    assert len(calls) >= 2 * model.config.num_hidden_layers  # a prefill and decodes, per layer
    assert [tokens for tokens, _ in fused] == stock
    calls.clear()
    monkeypatch.setattr(rotary, "_kernel", None)  # as where the CPU kernels cannot be had:
    monkeypatch.setattr(cpu_ops, "rotary", lambda: None)  # Transformers' ops
    assert logprobs_of(LLM(model, block_size=4, num_blocks=96), prompts) == fused  # bit for bit
    assert not calls
