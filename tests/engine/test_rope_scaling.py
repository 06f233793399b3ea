"""Rotary embeddings whose frequencies follow a forward's length (hf/rope.py): LongRoPE, on
Phi-3 (whose generate computes a sequence anew at the switch) and on a Llama, and dynamic
NTK. Stock `generate` of each request alone is the reference, by tokens and by the
log-probability of every token: these tiny models' tokens seldom flip, but a token given
another request's frequencies moves its log-probabilities by 1e-3 to 1e-2.

The prompts cross the length where the frequencies change (24) in every way: short prompts
that stay short, short ones whose decoding crosses it, long ones, and a long one sharing its
first blocks with a short one (the prefix cache must not hand it short K/V)."""

from __future__ import annotations

import copy
import pickle
import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_paged
from hf_paged import LLM, SamplingParams
from hf_paged.engine import graphs as graphs_module
from hf_paged.generate.cache import PagedCache
from hf_paged.hf.rope import length_dependent, token_rope, use_token_rope
from conftest import VOCAB, sharpen_and_check
from zoo import make_arch

LIMIT = 24  # original_max_position_embeddings (LongRoPE), max_position_embeddings (dynamic)
NEW = 12


def longrope(half: int) -> dict:
    return dict(rope_type="longrope", rope_theta=100.0, original_max_position_embeddings=LIMIT,
                short_factor=[1.0 + 0.1 * i for i in range(half)],
                long_factor=[0.05 * (i + 1) for i in range(half)])


def phi3_longrope():
    return make_arch("phi3", rope_parameters=dict(longrope(4), partial_rotary_factor=0.5),
                     max_position_embeddings=96, original_max_position_embeddings=LIMIT)


def phimoe_longrope():
    rope = dict(longrope(8), short_mscale=1.0, long_mscale=1.0)  # (PhiMoE's config needs them)
    return make_arch("phimoe", rope_parameters=rope, max_position_embeddings=96)


def llama_longrope():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=96, rope_parameters=longrope(8),
                         tie_word_embeddings=False)
    return sharpen_and_check(LlamaForCausalLM(config), "llama_longrope")


def qwen2_dynamic():
    return make_arch("qwen2", rope_parameters=dict(rope_type="dynamic", rope_theta=100.0,
                                                   factor=4.0), max_position_embeddings=LIMIT)


MODELS = {"phi3_longrope": phi3_longrope, "phimoe_longrope": phimoe_longrope,
          "llama_longrope": llama_longrope, "qwen2_dynamic": qwen2_dynamic}
_built: dict = {}
_stock: dict = {}


def model_of(name: str):
    if name not in _built:
        _built[name] = MODELS[name]()
    return _built[name]


def prompts() -> list[list[int]]:
    rng = random.Random(0)
    shared = [rng.randrange(3, VOCAB) for _ in range(16)]
    lengths = (5, 12, 30, 8, 40, 20)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths] + [
        shared + [5, 6, 7, 8], shared + [rng.randrange(3, VOCAB) for _ in range(14)]]


def stock(name: str, prompt: list[int]) -> tuple[list[int], list[float]]:
    """Stock greedy tokens of the prompt alone, and each one's log-probability, on the
    model as fresh (dynamic NTK keeps the longest length its forwards have seen)."""
    key = (name, tuple(prompt))
    if key not in _stock:
        model = model_of(name)
        rotary = model.model.rotary_emb
        if "dynamic" in rotary.rope_type:
            rotary.register_buffer("inv_freq", rotary.original_inv_freq.clone(), False)
            rotary.max_seq_len_cached = rotary.original_max_seq_len
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                                 do_sample=False, output_logits=True, pad_token_id=0,
                                 eos_token_id=None, return_dict_in_generate=True)
        tokens = out.sequences[0, len(prompt):].tolist()
        _stock[key] = tokens, [torch.log_softmax(step[0].float(), -1)[t].item()
                               for step, t in zip(out.logits, tokens)]
    return _stock[key]


def assert_stock(name: str, outs, given) -> None:
    for out, prompt in zip(outs, given):
        tokens, logprobs = stock(name, prompt)
        completion = out.outputs[0]
        assert completion.token_ids == tokens, (len(prompt), completion.token_ids, tokens)
        got = [next(iter(step.values())).logprob for step in completion.logprobs]
        assert got == pytest.approx(logprobs, abs=1e-4), len(prompt)


OPTIONS = {
    "plain": {},
    "chunked": dict(max_num_batched_tokens=16),
    "async": dict(async_scheduling=True),
    "tight_swap": dict(num_blocks=24, max_num_seqs=4, preemption_mode="swap",
                       admission_headroom=0),
    "tight_recompute_async": dict(num_blocks=24, max_num_seqs=4, admission_headroom=0,
                                  async_scheduling=True),
    "ngram": dict(speculative_config=dict(method="ngram", num_speculative_tokens=3,
                                          prompt_lookup_min=1, prompt_lookup_max=3)),
    "compiled": dict(compile="aot_eager"),
    "graphs": dict(cuda_graphs=True, max_num_seqs=8),  # (aten traces on CPU: `traced`)
}


@pytest.mark.parametrize("name,option", [
    (name, option) for name in MODELS for option in OPTIONS
    if not (option == "compiled" and name in ("llama_longrope", "phimoe_longrope"))])
    # (Phi-3's compiled run covers LongRoPE)
def test_each_request_gets_the_frequencies_of_its_own_length(name, option, monkeypatch):
    """All prompts in one call, then each alone on the same engine (prefix-cache hits on
    the blocks of the first call): stock tokens and log-probabilities every time."""
    if option == "graphs":
        monkeypatch.setattr(graphs_module, "capture_for", lambda device: graphs_module.TracedGraph)
    model = model_of(name)
    extra = dict(max_model_len=96) if name == "qwen2_dynamic" else {}
    llm = LLM(model, block_size=4, **{"num_blocks": 200, **OPTIONS[option]}, **extra)
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=0)
    given = prompts()
    assert_stock(name, llm.generate(given, params, use_tqdm=False), given)
    for prompt in reversed(given):
        assert_stock(name, llm.generate([prompt], params, use_tqdm=False), [prompt])
    assert llm.stats().blocks_used == 0
    assert llm.engine.runner.compile_error is None
    if option == "graphs":
        assert llm.engine.runner.graphs.replays > 0


def test_parallel_samples_and_seeds_match_across_engines():
    """n > 1 with seeds: the same completions batched with a long request as alone."""
    model = model_of("phi3_longrope")
    given = prompts()
    params = SamplingParams(temperature=0.9, n=3, seed=7, max_tokens=NEW, ignore_eos=True)
    together = LLM(model, block_size=4, num_blocks=200).generate(given, params, use_tqdm=False)
    alone = LLM(model, block_size=4, num_blocks=200, enable_prefix_caching=False)
    for out, prompt in zip(together, given):
        expected = alone.generate([prompt], params, use_tqdm=False)[0]
        assert [c.token_ids for c in out.outputs] == [c.token_ids for c in expected.outputs]


LAYOUT_ARCHS = ["qwen2", "qwen3", "gemma2", "phi3", "gpt_oss", "cohere2", "gpt_neox", "phi",
                "glm4", "deepseek_v3", "olmo2"]


@pytest.mark.parametrize("arch,kind", [  # (Phi-3's config takes no dynamic NTK)
    (arch, kind) for arch in LAYOUT_ARCHS for kind in ("longrope", "dynamic")
    if (arch, kind) != ("phi3", "dynamic")])
def test_per_token_frequencies_are_the_class_own_for_one_length(arch, kind):
    """Every token at one length: the switched rotary gives the class's own cos and sin
    (LongRoPE bit for bit; dynamic NTK's grown base to a float's rounding), on classes that
    lay their angles out as halves (Llama), pairs (Cohere) or once (gpt-oss)."""
    half = next(m for m in make_arch(arch).modules()
                if hasattr(m, "original_inv_freq")).original_inv_freq.shape[0]
    rope = longrope(half) if kind == "longrope" else dict(rope_type="dynamic", rope_theta=100.0,
                                                          factor=4.0)
    base = make_arch(arch).config.rope_parameters
    if "partial_rotary_factor" in base:
        rope["partial_rotary_factor"] = base["partial_rotary_factor"]
    extra = dict(original_max_position_embeddings=LIMIT) if arch == "phi3" else {}
    model = make_arch(arch, rope_parameters=rope, max_position_embeddings=LIMIT if
                      kind == "dynamic" else 96, **extra)
    (rotary,) = use_token_rope(model)
    x = torch.zeros(1, 1, 8)
    for n in (10, 40):  # short, long
        positions = torch.arange(n)[None]
        with torch.no_grad(), token_rope(torch.full((n,), n)):
            got = rotary(x, positions)
        with torch.no_grad():
            expected = rotary(x, positions)  # (outside: the class's own forward)
        for a, b in zip(got, expected):
            if kind == "longrope":
                assert torch.equal(a, b), (arch, n)
            else:
                torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_the_switched_rotary_leaves_stock_generate_and_copies_alone():
    """Outside the engine's forwards the class's own forward runs (stock generate gives the
    tokens of an untouched copy); pickled or copied, the module is of its own class."""
    model = model_of("llama_longrope")
    untouched = copy.deepcopy(model)
    LLM(model, block_size=4, num_blocks=64)
    rotary = model.model.rotary_emb
    assert type(rotary).__name__ == "PerTokenLlamaRotaryEmbedding" and length_dependent(rotary)
    assert type(untouched.model.rotary_emb).__name__ == "LlamaRotaryEmbedding"
    for clone in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        assert type(clone.model.rotary_emb).__name__ == "LlamaRotaryEmbedding"
    ids = torch.tensor([prompts()[4]])
    for other in (untouched, model):
        out = other.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                             eos_token_id=None, attention_mask=torch.ones_like(ids))
        if other is untouched:
            expected = out
    assert torch.equal(out, expected)


def test_per_layer_type_length_dependent_frequencies_are_refused_by_name():
    model = make_arch("gemma2")
    rotary = model.model.rotary_emb
    rotary.rope_type = {"full_attention": "dynamic", "sliding_attention": "default"}
    with pytest.raises(hf_paged.UnsupportedModelError, match="per layer type"):
        LLM(model, block_size=4, num_blocks=64)


@pytest.mark.parametrize("name,mode", [
    (name, mode) for name in ("phi3_longrope", "phimoe_longrope")
    for mode in ("greedy", "beams", "sampled", "prompt_lookup", "guidance", "long_negative")
    # (stock's sliding-window DynamicCache cannot roll back a prompt lookup's drafts)
    if (name, mode) != ("phimoe_longrope", "prompt_lookup")])
def test_phi3_generate_stays_paged_past_the_switch(name, mode):
    """Phi-3's (and PhiMoE's) generate drops its cache to compute the sequences anew once
    they grow past the switch (and for a prompt past it): the paged generate empties and
    refills its PagedCache there, with stock's tokens, rather than going on with a
    DynamicCache. Only there: classifier-free guidance's forwards without a cache were
    handed the call's PagedCache too, emptying it (the next step's mask then did not fit),
    and so was its first one on a negative prompt past the switch."""
    model = model_of(name)
    rng = random.Random(1)
    ids = torch.tensor([[rng.randrange(3, VOCAB) for _ in range(20)] for _ in range(3)])
    mask = torch.ones_like(ids)
    mask[0, :5] = mask[1, :2] = 0
    kwargs = dict(max_new_tokens=10, pad_token_id=0, eos_token_id=None, do_sample=False,
                  attention_mask=mask, return_dict_in_generate=True)
    if mode == "beams":
        kwargs["num_beams"] = 3
    elif mode == "sampled":
        kwargs.update(do_sample=True, num_return_sequences=2)
    elif mode == "prompt_lookup":
        ids, kwargs["attention_mask"] = ids[:1], None
        kwargs["prompt_lookup_num_tokens"] = 3
    elif mode == "guidance":
        kwargs["guidance_scale"] = 1.5
    elif mode == "long_negative":
        ids, kwargs["attention_mask"] = ids[:1], None
        kwargs.update(guidance_scale=1.5, negative_prompt_ids=torch.arange(3, 33)[None])
    outs = []
    for implementation in (None, "paged"):
        torch.manual_seed(0)
        with torch.no_grad():
            outs.append(model.generate(ids, cache_implementation=implementation, **kwargs))
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    assert isinstance(outs[1].past_key_values, PagedCache)
    long_prompt = torch.tensor([prompts()[4]])
    with torch.no_grad():
        out = model.generate(long_prompt, cache_implementation="paged", max_new_tokens=4,
                             do_sample=False, pad_token_id=0, eos_token_id=None,
                             return_dict_in_generate=True)
    assert isinstance(out.past_key_values, PagedCache)


def test_a_rotary_module_put_in_place_while_serving_is_switched():
    """The engine looks at the model's modules before admitting requests: a length-dependent
    rotary embedding put in place of a plain one between calls gets per-token frequencies
    from the next call on (stock tokens and log-probabilities, with decode graphs too)."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    model = copy.deepcopy(model_of("llama_longrope"))
    scaled = model.model.rotary_emb
    plain = copy.deepcopy(model.config)
    plain.rope_parameters = dict(rope_type="default", rope_theta=100.0)
    model.model.rotary_emb = LlamaRotaryEmbedding(plain)
    llm = LLM(model, block_size=4, num_blocks=200)
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=0)
    given = prompts()
    llm.generate(given, params, use_tqdm=False)
    assert not llm.engine.runner.rope
    model.model.rotary_emb = scaled
    _built["llama_longrope_put_back"] = model
    assert_stock("llama_longrope_put_back", llm.generate(given, params, use_tqdm=False), given)
