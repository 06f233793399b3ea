"""How hf-paged plugs into Transformers: pipelines, loading, unsupported models, disable()."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import (
    AutoModelForCausalLM, GenerationConfig, GenerationMixin, BloomConfig, BloomForCausalLM, pipeline,
)
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama import modeling_llama

import hf_paged
from hf_paged.kernels import cpu_ops
from conftest import assert_same, left_padded_batch, make_model

PROMPTS = ["w5 w6 w7", "w10 w11 w12 w13 w14 w15 w16 w17 w18", "w40", "w3 w9 w27 w81 w33"]


def texts(results):
    return [r[0]["generated_text"] for r in results]


@pytest.mark.parametrize("where", ["call", "construction"])
def test_batched_pipeline(llama, tokenizer, where):
    kwargs = dict(max_new_tokens=8, do_sample=False, batch_size=4)
    ref = pipeline("text-generation", model=llama, tokenizer=tokenizer)(PROMPTS, **kwargs)
    if where == "call":
        pipe = pipeline("text-generation", model=llama, tokenizer=tokenizer)
        out = pipe(PROMPTS, cache_implementation="paged", **kwargs)
    else:
        pipe = pipeline("text-generation", model=llama, tokenizer=tokenizer,
                        cache_implementation="paged")
        out = pipe(PROMPTS, **kwargs)
    assert texts(out) == texts(ref)
    assert all(len(t.split()) > len(p.split()) for t, p in zip(texts(out), PROMPTS))


def test_pipeline_really_uses_paged_cache(llama, tokenizer, monkeypatch):
    seen = []
    original = hf_paged.PagedCache.begin_forward

    def spy(self, *args, **kwargs):
        seen.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(hf_paged.PagedCache, "begin_forward", spy)
    pipe = pipeline("text-generation", model=llama, tokenizer=tokenizer)
    pipe(PROMPTS[:2], max_new_tokens=3, cache_implementation="paged", batch_size=2)
    assert seen


def test_from_pretrained_with_paged_attention(tmp_path):
    model = make_model("llama_gqa")
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="paged").eval()
    assert loaded.config._attn_implementation == "paged"
    ids, mask = left_padded_batch([3, 17, 30], seed=2)
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    # Stock cache with the paged attention's contiguous path, then the paged cache.
    plain = loaded.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    paged = loaded.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False,
                            cache_implementation="paged")
    assert torch.equal(ref, plain) and torch.equal(ref, paged)
    assert loaded.config._attn_implementation == "paged"


def test_unsupported_architecture_warns_and_keeps_stock_behaviour():
    """Bloom computes attention inline (not through the attention interface)."""
    torch.manual_seed(0)
    model = BloomForCausalLM(BloomConfig(vocab_size=64, hidden_size=32, n_layer=2, n_head=2,
                                         pad_token_id=0)).eval()
    ids = torch.randint(1, 64, (2, 7))
    ref = model.generate(ids, max_new_tokens=6, do_sample=False)
    with pytest.warns(UserWarning, match="BloomForCausalLM does not declare that its attention"):
        out = model.generate(ids, max_new_tokens=6, do_sample=False, cache_implementation="paged")
    assert torch.equal(ref, out)
    assert model.config._attn_implementation != "paged"


def test_disable_restores_stock_transformers(llama):
    wrapped = GenerationMixin.generate
    hf_paged.LLM(llama, max_num_seqs=2)  # (switches Llama's rotary application, hf/rotary.py)
    assert hasattr(modeling_llama.apply_rotary_pos_emb, "own") or not cpu_ops.available()
    try:
        hf_paged.disable()
        assert not hf_paged.is_enabled()
        assert "paged" not in ALL_ATTENTION_FUNCTIONS._global_mapping
        assert "paged" not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
        assert GenerationMixin.generate is not wrapped
        # (the engine's rotary switch is undone too)
        assert not hasattr(modeling_llama.apply_rotary_pos_emb, "own")
        # generate keeps only a notice for "paged" requests around Transformers' own.
        stock_generate = GenerationMixin.generate._hf_paged_notice
        assert "hf_paged" not in stock_generate.__code__.co_filename
        for name in ("_prefill", "_prepare_cache_for_generation",
                     "prepare_inputs_for_generation", "_prepare_generation_config"):
            assert "hf_paged" not in getattr(GenerationMixin, name).__code__.co_filename
        ids, _ = left_padded_batch([6], seed=1)
        # Stock generation still works, silently.
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert llama.generate(ids, max_new_tokens=3, do_sample=False).shape == (1, 9)
        # Asking for "paged" now says that hf-paged is off (Transformers ignores it here).
        config = GenerationConfig(cache_implementation="paged", max_new_tokens=3, do_sample=False)
        with pytest.warns(UserWarning, match=r"hf_paged\.enable\(\)") as record:
            out = llama.generate(ids, generation_config=config, return_dict_in_generate=True)
        assert record[0].filename == __file__
        assert not isinstance(out.past_key_values, hf_paged.PagedCache)
    finally:
        hf_paged.enable()
    assert hf_paged.is_enabled() and "paged" in ALL_ATTENTION_FUNCTIONS._global_mapping


def test_an_engine_keeps_serving_after_disable(llama):
    """disable() turns generate() back to stock; an engine (hf-paged's own API, which needs
    the paged attention) keeps serving with the same tokens, and generate stays stock."""
    from hf_paged import LLM, SamplingParams

    llm = LLM(llama, max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=6)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    want = [r.outputs[0].token_ids for r in llm.generate(prompts, params, use_tqdm=False)]
    ids, _ = left_padded_batch([6], seed=1)
    try:
        hf_paged.disable()
        got = [r.outputs[0].token_ids for r in llm.generate(prompts, params, use_tqdm=False)]
        assert got == want and all(len(t) == 6 for t in got)
        assert not hf_paged.is_enabled()
        with pytest.warns(UserWarning, match=r"hf_paged\.enable\(\)"):
            out = llama.generate(ids, return_dict_in_generate=True,
                                 generation_config=GenerationConfig(
                                     cache_implementation="paged", max_new_tokens=3,
                                     do_sample=False))
        assert not isinstance(out.past_key_values, hf_paged.PagedCache)
    finally:
        hf_paged.enable()
    stats = llm.engine.stats()
    assert (stats.blocks_used, stats.running, stats.waiting) == (0, 0, 0)


def test_user_cache_and_cache_implementation_conflict(llama):
    ids, _ = left_padded_batch([6], seed=1)
    from transformers import DynamicCache

    with pytest.raises(ValueError, match="cache_implementation"):
        llama.generate(ids, max_new_tokens=3, cache_implementation="paged",
                       past_key_values=DynamicCache(config=llama.config))


def test_use_cache_false_still_works(llama):
    ids, _ = left_padded_batch([6], seed=1)
    ref = llama.generate(ids, max_new_tokens=4, do_sample=False, use_cache=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = llama.generate(ids, max_new_tokens=4, do_sample=False, use_cache=False,
                             cache_implementation="paged")
    assert torch.equal(ref, out)


def test_generate_under_autocast_runs_stock_and_the_engine_ignores_it(llama):
    """torch.autocast computes a float32 model in bfloat16, which the paged attention does
    not follow (a padded batch raised a dtype error, a single prompt drifted): generate
    runs the call on Transformers' cache with a warning, a PagedCache passed in is refused
    by name, and the engine computes in the model's dtype, autocast or not."""
    ids, mask = left_padded_batch([5, 9], seed=4)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = llama.generate(**kwargs)
        with pytest.warns(UserWarning, match="torch.autocast is on"):
            out = llama.generate(**kwargs, cache_implementation="paged")
        with pytest.raises(hf_paged.HFPagedError, match="torch.autocast"):
            llama.generate(**kwargs, past_key_values=hf_paged.PagedCache(llama.config))
        own, llama.config._attn_implementation_internal = (
            llama.config._attn_implementation_internal, "paged")
        try:
            with pytest.raises(hf_paged.HFPagedError, match="torch.autocast"):
                llama(input_ids=ids, attention_mask=mask,
                      past_key_values=hf_paged.PagedCache(llama.config))
        finally:
            llama.config._attn_implementation_internal = own
    assert torch.equal(ref, out)
    llm = hf_paged.LLM(llama, block_size=4, num_blocks=64)
    params = hf_paged.SamplingParams(temperature=0, max_tokens=6, logprobs=1, ignore_eos=True)

    def logprobs():
        out = llm.generate([[5, 6, 7], [8, 9, 10, 11]], params, use_tqdm=False)
        return [[d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                for o in out]

    plain = logprobs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert logprobs() == plain


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_pool_follows_model_dtype(dtype):
    model = make_model("llama_gqa").to(dtype)
    ids, mask = left_padded_batch([5, 12], seed=2)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                         cache_implementation="paged", return_dict_in_generate=True)
    cache = out.past_key_values
    assert cache.pool.kv.dtype == dtype
    assert cache.memory_stats().bytes_per_token == 2 * 2 * 2 * 16 * 2


def test_falcon_from_pretrained_with_paged_attention(tmp_path):
    model = make_model("falcon_alibi")
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="paged").eval()
    ids, mask = left_padded_batch([3, 17], seed=2)
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    out = loaded.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                          cache_implementation="paged")
    assert torch.equal(ref, out)


@pytest.mark.parametrize("kind", ["llama_gqa", "falcon_mq"])
def test_concurrent_generate_calls_on_one_model(kind):
    """Threads generating on one model at once, paged and stock calls overlapping (they all
    meet at their first step): the attention switch is shared, the last call out restores it,
    and stock calls on the switched model still give stock results."""
    import threading

    from transformers import LogitsProcessor, LogitsProcessorList

    model = make_model(kind)
    ids, mask = left_padded_batch([6, 17], seed=4)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    ref = model.generate(**kwargs)
    before = model.config._attn_implementation
    meet = threading.Barrier(6, timeout=60)
    results, errors = [], []

    class MeetOnce(LogitsProcessor):
        def __init__(self):
            self.first = True

        def __call__(self, input_ids, scores):
            if self.first:
                self.first = False
                meet.wait()
            return scores

    def work(paged):
        try:
            extra = {"cache_implementation": "paged"} if paged else {}
            out = model.generate(**kwargs, **extra,
                                 logits_processor=LogitsProcessorList([MeetOnce()]))
            results.append(torch.equal(out, ref))
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=work, args=(i % 2 == 0,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and results == [True] * 6
    assert model.config._attn_implementation == before


@pytest.mark.parametrize("kind", ["falcon_mq", "falcon_alibi", "falcon_new"])
def test_stock_falcon_forward_when_switched_mid_layer(kind):
    """A paged call on another thread may switch the shared config after a stock Falcon
    attention has chosen its path and before Transformers reads the name again: the stock
    forward must still give stock logits (it took the eager branch with an SDPA mask)."""
    from hf_paged.hf.switch import release_paged_attention, use_paged_attention

    model = make_model(kind)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model(ids).logits
    entries: list = []

    def switch_once(module, args):
        if not entries:
            use_paged_attention(model, entries)

    attention = model.transformer.h[0].self_attention
    hook = attention.query_key_value.register_forward_pre_hook(switch_once)
    try:
        with torch.no_grad():
            out = model(ids).logits
    finally:
        hook.remove()
        release_paged_attention(entries)
    assert entries, "the switch did not happen inside the forward"
    torch.testing.assert_close(out, ref)


@pytest.mark.parametrize("name, implementation", [
    ("gemma2", "eager"), ("gpt_oss", "eager"), ("llama_gqa", "eager"), ("llama_gqa", "sdpa"),
    ("qwen2_sliding", "eager")])
@pytest.mark.parametrize("switched", ["for the mask", "for the attention"])
def test_a_stock_forward_is_stock_whichever_name_it_reads(name, implementation, switched):
    """A paged call on another thread switches the shared config to "paged" and back at any
    time: a stock forward that builds its mask under one name and runs its attention under
    the other must give the logits of the model's own implementation, bit for bit (an
    eager model's additive mask read as SDPA's boolean one, or no causal mask at all,
    changed them)."""
    from zoo import make_arch
    from hf_paged.hf.switch import release_paged_attention, use_paged_attention

    model = make_model(name) if name.startswith("llama") else make_arch(name)
    model.config._attn_implementation_internal = implementation
    ids, mask = left_padded_batch([5, 11], seed=4)
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask).logits
    entries: list = []
    switches = []

    def on(*_):
        use_paged_attention(model, entries)
        switches.append(True)

    def off(*_):
        release_paged_attention(entries)
        entries.clear()

    # on before the mask and off before the first layer, or on from the first layer to the end
    first, layer = (on, off) if switched == "for the mask" else (None, on)
    hooks = [model.model.layers[0].register_forward_pre_hook(layer),
             model.model.register_forward_pre_hook(first) if first else
             model.model.register_forward_hook(off)]
    try:
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask).logits
    finally:
        for hook in hooks:
            hook.remove()
        off()
    assert switches, "the switch did not happen inside the forward"
    assert model.config._attn_implementation == implementation
    assert torch.equal(out, ref)


def test_sized_pool_with_the_model_assisting_itself(llama):
    ids, mask = left_padded_batch([9], seed=5)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    ref = llama.generate(**kwargs, assistant_model=llama)
    for cache_config in ({"num_blocks": 64, "block_size": 4}, {"max_kv_bytes": 2**20}):
        out = llama.generate(**kwargs, assistant_model=llama, cache_implementation="paged",
                             cache_config=cache_config)
        assert_same(ref, out)


@pytest.mark.parametrize("kind", ["llama_gqa", "mistral_sw", "falcon_mq", "falcon_alibi"])
def test_paged_attention_model_with_other_caches(kind):
    """attn_implementation="paged" on Transformers' own caches gives Transformers' SDPA
    results, StaticCache and left padding included (Falcon, which picks its branch by name,
    takes its SDPA branch: its eager one adds ALiBi twice)."""
    stock = make_model(kind)
    paged = make_model(kind)
    paged.config._attn_implementation_internal = "paged"
    ids, mask = left_padded_batch([5, 9], seed=1)
    # Falcon-RW alibi with a StaticCache fails in Transformers itself, whatever the attention.
    for implementation in ("dynamic",) if kind == "falcon_alibi" else ("dynamic", "static"):
        kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                      cache_implementation=implementation, return_dict_in_generate=True,
                      output_logits=True)
        ref, out = stock.generate(**kwargs), paged.generate(**kwargs)
        assert_same(ref, out)
        torch.testing.assert_close(out.logits[0], ref.logits[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["llama_gqa", "falcon_mq", "falcon_new"])
def test_direct_forward_with_paged_cache(kind):
    """model(...) on a PagedCache: left padding is taken from the mask, and a model whose
    attention is not 'paged' gets a clear error instead of a shape error inside SDPA (or,
    for Falcon, pad tokens stored as real ones)."""
    from hf_paged import HFPagedError, PagedCache

    stock = make_model(kind)
    ids, mask = left_padded_batch([4, 9], seed=3)
    with pytest.raises(HFPagedError, match="attn_implementation='paged'"):
        stock(input_ids=ids, attention_mask=mask, past_key_values=PagedCache(stock.config))
    ref = stock(input_ids=ids, attention_mask=mask).logits
    stock.config._attn_implementation_internal = "paged"
    cache = PagedCache(stock.config)
    out = stock(input_ids=ids, attention_mask=mask, past_key_values=cache).logits
    real = mask.bool()
    torch.testing.assert_close(out[real], ref[real], rtol=1e-4, atol=1e-4)
    assert cache.memory_stats().tokens_stored == int(mask.sum())
