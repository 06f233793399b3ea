"""The engine's linear switch (hf/linear.py): a float32 CPU model's large linear layers run
through oneDNN in the engine's forwards, on the engine's thread only; stock generate, other
threads and other compiles of the model run them as torch does. Tokens stay those of stock
generate (the two libraries differ by float32 rounding)."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import make_model
from hf_paged import LLM, SamplingParams
from hf_paged.hf.linear import (OneDNNFalconLinear, OneDNNLinear, onednn_linears,
                                use_onednn_linears)
from hf_paged.kernels import cpu_linear
from test_compile import fresh_dynamo, run  # noqa: F401 (an autouse fixture)
from test_engine import random_prompts, stock_greedy
from zoo import make_arch

pytestmark = pytest.mark.skipif(not cpu_linear.available(),
                                reason="this torch build has no oneDNN")


def wide_llama():
    """Hidden 768: the q/o projections and the MLP pass the size bar; k/v (2 of 4 heads)
    and the LM head (96 tokens) do not."""
    return make_model("llama_gqa", hidden_size=768, intermediate_size=1024)


def greedy(llm, prompts, max_tokens=12):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def counting(monkeypatch) -> list:
    calls = []
    kernel = cpu_linear._onednn
    monkeypatch.setattr(cpu_linear, "_onednn", lambda *a: calls.append(a[1].shape) or kernel(*a))
    return calls


def test_large_layers_run_through_onednn_in_engine_forwards_only(monkeypatch):
    model = wide_llama()
    ids = torch.tensor([random_prompts(0, 1, 9, 9)[0]])
    with torch.no_grad():
        before = model(ids).logits
    prompts = random_prompts(1, 5, 2, 30)
    stock = [stock_greedy(model, p, 12) for p in prompts]
    calls = counting(monkeypatch)
    llm = LLM(model, block_size=4, num_blocks=64)
    layer = model.model.layers[0]
    switched = [layer.self_attn.q_proj, layer.self_attn.o_proj, layer.mlp.gate_proj,
                layer.mlp.up_proj, layer.mlp.down_proj]
    assert all(type(m) is OneDNNLinear for m in switched)
    assert type(layer.self_attn.k_proj) is type(model.lm_head) is nn.Linear
    assert greedy(llm, prompts) == stock
    assert len(calls) >= 10 and {tuple(s) for s in calls} >= {(1024, 768), (768, 768)}
    calls.clear()
    with torch.no_grad():  # outside the engine: torch's own kernels, bit for bit
        assert torch.equal(model(ids).logits, before)
    assert [stock_greedy(model, p, 12) for p in prompts[:2]] == stock[:2]
    assert not calls
    assert greedy(LLM(model, block_size=4, num_blocks=64, onednn_linear=False), prompts) == stock
    assert not calls


def test_the_switch_belongs_to_the_thread_that_sets_it():
    torch.manual_seed(0)
    layer = nn.Linear(1024, 512)
    assert use_onednn_linears(layer) == 1 and type(layer) is OneDNNLinear
    x = torch.randn(5, 1024)
    seen = {}
    started, done = threading.Event(), threading.Event()

    def other():
        started.wait(10)
        seen["other"] = layer(x)
        done.set()

    thread = threading.Thread(target=other)
    thread.start()
    with torch.no_grad(), onednn_linears():
        started.set()
        done.wait(10)
        inside = layer(x)
    with onednn_linears():  # recording gradients: torch's path, which has a backward
        layer(x).sum().backward()
    assert layer.weight.grad is not None
    thread.join(10)
    with torch.no_grad():
        assert torch.equal(seen["other"], F.linear(x, layer.weight, layer.bias))
        assert torch.equal(inside, cpu_linear._onednn(x, layer.weight, layer.bias))
        assert torch.allclose(inside, layer(x), rtol=1e-5, atol=1e-5)


def test_small_cast_and_subclassed_layers_are_left_alone():
    class Own(nn.Linear):
        pass

    model = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(256, 256),
                          nn.Linear(1024, 1024).to(torch.bfloat16), Own(1024, 1024))
    assert use_onednn_linears(model) == 1
    assert [type(m) for m in model] == [OneDNNLinear, nn.Linear, nn.Linear, Own]
    assert use_onednn_linears(model) == 1  # (again: nothing more)
    model[0].to(torch.bfloat16)  # cast since: torch's path inside the switch too
    x = torch.randn(3, 1024, dtype=torch.bfloat16)
    with torch.no_grad(), onednn_linears():
        assert torch.equal(model[0](x), F.linear(x, model[0].weight, model[0].bias))


@pytest.mark.parametrize("odd", ["strided bias", "scalar bias", "bias of one", "strided weight"])
def test_a_bias_or_weight_of_another_layout_takes_torchs_path(odd):
    """oneDNN's op reads any bias as N contiguous values (a bias of every other element
    gave errors of 3, a 0-d one garbage)."""
    torch.manual_seed(0)
    layer = nn.Linear(1024, 512)
    use_onednn_linears(layer)
    if odd == "strided weight":
        layer.weight = nn.Parameter(torch.randn(1024, 1024)[::2])
    else:
        bias = {"strided bias": torch.randn(1024)[::2], "scalar bias": torch.tensor(0.5),
                "bias of one": torch.tensor([0.5])}[odd]
        layer.bias = nn.Parameter(bias)
    x = torch.randn(4, 1024)
    with torch.no_grad(), onednn_linears():
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
        with pytest.raises(RuntimeError, match="cannot be multiplied"):
            layer(torch.randn(4, 1000))


def test_the_option_is_checked():
    with pytest.raises(ValueError, match="onednn_linear must be True or False; got 'yes'"):
        LLM(make_model("llama_gqa"), num_blocks=8, onednn_linear="yes")


@pytest.mark.parametrize("name", ["qwen3", "gemma2", "phi3", "gpt_neox", "starcoder2",
                                  "gpt_oss", "qwen2_moe", "deepseek_v3", "falcon_mq",
                                  "falcon_new"])
def test_every_layer_through_onednn_gives_stocks_tokens(name, monkeypatch):
    """With no size bar every plain linear layer of these architectures (fused QKV and
    biases, Falcon's own linear class, MoE routers and shared experts, latent projections)
    runs through oneDNN."""
    monkeypatch.setattr(cpu_linear, "MIN_WEIGHT_ELEMENTS", 0)
    model = make_model(name) if name.startswith("falcon") else make_arch(name)
    prompts = random_prompts(4, 6, 1, 40)
    stock = [stock_greedy(model, p, 10) for p in prompts]
    calls = counting(monkeypatch)
    llm = LLM(model, block_size=4, num_blocks=80, max_num_batched_tokens=32)
    if name.startswith("falcon"):
        layer = model.transformer.h[0]
        assert type(layer.self_attention.query_key_value) is OneDNNFalconLinear
        assert type(layer.mlp.dense_4h_to_h) is OneDNNFalconLinear
    assert greedy(llm, prompts, 10) == stock
    assert calls


_captured: list = []


@torch._dynamo.register_backend(name="hf_paged_test_onednn")
def _capture(gm, example_inputs):
    _captured.append(gm)
    return gm.forward


@pytest.mark.parametrize("kind", ["mistral_sw", pytest.param("falcon_new", marks=pytest.mark.slow)])
def test_a_compiled_forward_records_onednns_op_and_equals_eager(kind, monkeypatch):
    monkeypatch.setattr(cpu_linear, "MIN_WEIGHT_ELEMENTS", 0)
    model = make_model(kind)
    _captured.clear()
    eager, _ = run(model, False, count=6)
    compiled, _ = run(model, "hf_paged_test_onednn", count=6)
    assert compiled == eager
    op = torch.ops.hf_paged.onednn_linear.default
    targets = [{n.target for n in gm.graph.nodes} for gm in _captured]
    assert targets and all(op in t and not t & {F.linear, torch._C._nn.linear} for t in targets)


def test_compiled_engines_of_one_model_keep_their_own_option(monkeypatch):
    """The option was not part of what a compiled entry point is keyed by: an engine with
    onednn_linear=False replayed the oneDNN graphs another engine on the model had traced
    (and the other way round), running the layers its option had turned off."""
    monkeypatch.setattr(cpu_linear, "MIN_WEIGHT_ELEMENTS", 0)
    model = make_model("llama_gqa")
    op = torch.ops.hf_paged.onednn_linear.default
    tokens = []
    for onednn in (True, False, True):
        _captured.clear()
        tokens.append(run(model, "hf_paged_test_onednn", count=4, onednn_linear=onednn)[0])
        traced = [any(n.target is op for n in gm.graph.nodes) for gm in _captured]
        assert traced == [onednn] * len(traced) and (traced or onednn)
    assert tokens[0] == tokens[1] == tokens[2]


@pytest.mark.slow
def test_inductor_runs_onednns_op_with_eagers_tokens(monkeypatch):
    monkeypatch.setattr(cpu_linear, "MIN_WEIGHT_ELEMENTS", 0)
    model = make_model("llama_gqa")
    eager, _ = run(model, False)
    compiled, _ = run(model, True)
    assert compiled == eager
