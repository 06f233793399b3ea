"""Every architecture of the zoo (tests/zoo.py) on the paged cache against stock Transformers
(DynamicCache), token for token, in generate's modes and in the engine; and the named
refusals of the models the paged cache cannot serve."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers.generation.streamers import BaseStreamer

import hf_paged
from hf_paged import PagedCache
from hf_paged.hf.architectures import SUPPORTED_ARCHITECTURES, kv_spec, unsupported_reason
from hf_paged.hf.probe import route_reason
from conftest import assert_same, both, left_padded_batch
from zoo import NAMES, make_arch

GEN = dict(max_new_tokens=12, do_sample=False, return_dict_in_generate=True, eos_token_id=None)


@pytest.fixture(scope="module", params=NAMES)
def arch(request):
    return request.param, make_arch(request.param)


def paged_run(model, **kwargs):
    """A paged generate call that must not fall back to stock (no hf-paged warning)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = model.generate(cache_implementation="paged", **kwargs)
    notes = [str(w.message) for w in caught if "hf-paged" in str(w.message)]
    assert not notes, notes
    return out


def test_greedy_left_padded_batch(arch):
    name, model = arch
    ids, mask = left_padded_batch([5, 13, 9], seed=1)
    ref = model.generate(input_ids=ids, attention_mask=mask, **GEN)
    out = paged_run(model, input_ids=ids, attention_mask=mask, **GEN)
    assert isinstance(out.past_key_values, PagedCache), name
    assert_same(ref, out)
    assert len(set(out.sequences[:, ids.shape[1]:].flatten().tolist())) >= 3


@pytest.mark.parametrize("rows", [1, 3])
def test_a_row_of_padding_only(arch, rows):
    """A row whose mask is all zeros, alone (the pool holds no block when the first forward
    reads it) or beside real rows."""
    name, model = arch
    ids, mask = left_padded_batch([4, 7, 1][:rows], seed=4)
    ids[0], mask[0] = 0, 0
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                  eos_token_id=None, pad_token_id=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (Transformers' note on the padding)
        assert_same(model.generate(**kwargs),
                    model.generate(cache_implementation="paged", **kwargs))


def test_right_padding_longer_than_a_window(arch):
    """A row padded on the right by more than a sliding window: its last queries see no key
    within their window, and generate reads the last one's logits. Eager attention (Gemma 2's
    softcap) then averages the row's values uniformly; the paged cache must do the same."""
    name, model = arch
    ids, mask = left_padded_batch([15, 12], seed=6)
    mask[0, 5:] = 0
    ids[0, 5:] = 0
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                  eos_token_id=None, pad_token_id=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (Transformers' note on right padding)
        for extra in ({}, dict(num_beams=3, num_return_sequences=2)):
            assert_same(model.generate(**kwargs, **extra),
                        model.generate(cache_implementation="paged", **kwargs, **extra))


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "gpt_oss", "qwen2_sliding", "mixtral",
                                  "cohere2", "ministral", "starcoder2", "phimoe"])
def test_a_query_that_sees_no_key_follows_eager_attention(name):
    """The last column of a row padded on the right by more than the window sees no key in
    its sliding layers, and generate reads its logits. Eager attention averages the values
    its cache hands the layer (gpt-oss's sink takes all the weight: zeros), SDPA gives zeros;
    the paged cache follows the model's implementation whatever its block size, its pool's
    earlier contents (stale slots of an unrelated call) and the prefill's chunking."""
    model = make_arch(name)
    model.set_attn_implementation("eager")
    ids, mask = left_padded_batch([15, 12], seed=6)
    mask[0, 5:], ids[0, 5:] = 0, 0
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                  eos_token_id=None, pad_token_id=0, return_dict_in_generate=True,
                  output_scores=True)
    sized = dict(block_size=16, num_blocks=64)
    other, _ = left_padded_batch([40, 40, 40], seed=9)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (Transformers' note on right padding)
        ref, chunked = model.generate(**kwargs), model.generate(**kwargs, prefill_chunk_size=4)
        model.generate(input_ids=other, max_new_tokens=8, do_sample=False,
                       cache_implementation="paged", cache_config=sized)  # leaves its K/V
        runs = [(ref, dict(cache_config=dict(block_size=b))) for b in (1, 5, 16)]
        runs += [(ref, dict(cache_config=sized)), (chunked, dict(prefill_chunk_size=4))]
        for expected, extra in runs:
            out = model.generate(cache_implementation="paged", **kwargs, **extra)
            assert torch.equal(out.sequences, expected.sequences), extra
            for a, b in zip(out.scores, expected.scores):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        model.set_attn_implementation("sdpa" if name not in ("gemma2", "gpt_oss") else "eager")
        assert_same(model.generate(**kwargs),
                    model.generate(cache_implementation="paged", **kwargs))


def test_beam_search(arch):
    _, model = arch
    ids, mask = left_padded_batch([6, 10], seed=2)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, num_beams=3,
                  do_sample=False, num_return_sequences=2)
    assert_same(model.generate(**kwargs), paged_run(model, **kwargs))


def test_sampling_with_several_sequences(arch):
    _, model = arch
    ids, mask = left_padded_batch([7, 4], seed=3)
    ref, out = both(model, seed=11, input_ids=ids, attention_mask=mask, max_new_tokens=10,
                    do_sample=True, top_k=20, num_return_sequences=3)
    assert_same(ref, out)


def test_assisted_decoding_and_prompt_lookup(arch):
    _, model = arch
    ids, mask = left_padded_batch([14], seed=4)
    ids = torch.cat([ids, ids[:, -6:]], 1)  # repeats, so that prompt lookup proposes
    mask = torch.ones_like(ids)
    for extra in (dict(assistant_model=model), dict(prompt_lookup_num_tokens=3)):
        kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False,
                      **extra)
        assert_same(model.generate(**kwargs), paged_run(model, **kwargs))


def test_assistant_early_exit(arch):
    """Self-speculation from the model's first layer (`assistant_early_exit`): stock's
    tokens. Transformers lowers `num_hidden_layers` for the drafts, and a cache sized from
    `layer_types` (Qwen2, Qwen3, SmolLM3) refused them; the failed call then left the
    lowered depth behind (Transformers restores it only on success)."""
    name, model = arch
    ids, mask = left_padded_batch([12], seed=3)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                  assistant_early_exit=1)
    layers = model.config.num_hidden_layers
    try:
        ref = model.generate(**kwargs)
    except Exception:  # noqa: BLE001 (Falcon, GPT-NeoX: stock cannot exit early on them)
        model.config.num_hidden_layers = layers
        pytest.skip(f"stock Transformers cannot exit early on {name}")
    try:
        assert_same(ref, paged_run(model, **kwargs))
        assert model.config.num_hidden_layers == layers
    finally:
        model.config.num_hidden_layers = layers


class _Collect(BaseStreamer):
    def __init__(self):
        self.tokens = []

    def put(self, value):
        self.tokens.append(value.flatten().tolist())

    def end(self):
        self.tokens.append("end")


def test_streaming(arch):
    _, model = arch
    ids, mask = left_padded_batch([9], seed=5)
    ref, out = _Collect(), _Collect()
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                  eos_token_id=None)
    model.generate(**kwargs, streamer=ref)
    paged_run(model, **kwargs, streamer=out)
    assert out.tokens == ref.tokens and len(ref.tokens) == 10


def test_engine_greedy_with_chunked_prefill(arch):
    name, model = arch
    prompts = [left_padded_batch([n], seed=20 + n)[0][0].tolist() for n in (5, 23, 12)]
    llm = hf_paged.LLM(model, block_size=4, num_blocks=128, max_num_batched_tokens=8,
                       max_num_seqs=4)
    outs = llm.generate(prompts, hf_paged.SamplingParams(max_tokens=9, temperature=0.0))
    for prompt, got in zip(prompts, outs):
        ids = torch.tensor([prompt])
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=9,
                             do_sample=False)[0, len(prompt):].tolist()
        assert got.outputs[0].token_ids == ref, name


def test_zoo_covers_the_supported_list():
    classes = {make_arch(n).__class__.__name__ for n in NAMES}
    assert classes | {"LlamaForCausalLM", "MistralForCausalLM", "FalconForCausalLM"} \
        == set(SUPPORTED_ARCHITECTURES)


def test_layer_windows_follow_the_attention_modules(arch):
    """The windows read from the config are those each attention module passes."""
    name, model = arch
    spec = kv_spec(model.config)
    for module in model.modules():
        if hasattr(module, "layer_idx") and hasattr(module, "sliding_window") \
                and "Attention" in type(module).__name__:
            is_sliding = getattr(module, "is_sliding", module.sliding_window is not None)
            passed = module.sliding_window if is_sliding else None
            assert spec.windows[module.layer_idx] == passed, (name, module.layer_idx)


# -- refusals ---------------------------------------------------------------------------------
def _refused():
    import transformers as t

    small = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                 intermediate_size=64)
    yield "bypasses", t.BloomForCausalLM(t.BloomConfig(vocab_size=64, hidden_size=32,
                                                        n_layer=2, n_head=2))
    yield "recurrent", t.MambaForCausalLM(t.MambaConfig(vocab_size=64, hidden_size=32,
                                                         num_hidden_layers=2))
    yield "linear", t.Qwen3NextForCausalLM(t.Qwen3NextConfig(
        **small, num_key_value_heads=1, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
        num_experts=2, num_experts_per_tok=1, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, layer_types=["linear_attention", "full_attention"]))
    yield "encoder-decoder", t.T5ForConditionalGeneration(t.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=2))
    # Sliding and full layers of different head sizes (Gemma 4): no one pool shape.
    yield "per-layer KV shapes", t.Gemma4ForCausalLM(t.Gemma4TextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, global_head_dim=32,
        sliding_window=4, layer_types=["sliding_attention", "full_attention"],
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=64))
    # Found by the one-token probe: the decoder layer drops the forward's keywords...
    yield "keywords dropped", t.NemotronForCausalLM(t.NemotronConfig(**small,
                                                                     num_key_value_heads=1))
    # ... or the attention repeats its keys after the cache update.
    yield "keys changed", t.JetMoeForCausalLM(t.JetMoeConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_key_value_heads=2,
        kv_channels=8, intermediate_size=64, num_local_experts=2, num_experts_per_tok=1))
    # A BERT-style LM head not configured as a decoder attends both ways.
    yield "bidirectional", t.BertLMHeadModel(t.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64))
    # ... or splits its values in two (differential attention).
    yield "values changed", t.DiffLlamaForCausalLM(t.DiffLlamaConfig(**small,
                                                                     num_key_value_heads=2))
    # ... or computes on what the cache update returned (Doge's dt_proj reads the values).
    yield "computes on the update", t.DogeForCausalLM(t.DogeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1))
    # Transformers' eager Falcon adds ALiBi twice (its SDPA, as the paged attention, once).
    from conftest import make_model
    yield "eager ALiBi", make_model("falcon_alibi", attn_implementation="eager")


_WHY = {"bypasses": "does not declare that its attention runs on Transformers' attention",
        "recurrent": "recurrent state|state-space",
        "linear": "linear_attention layers",
        "encoder-decoder": "encoder-decoder",
        "per-layer KV shapes": "do not share one KV shape",
        "keywords dropped": "did not reach the attention",
        "keys changed": "changed its keys",
        "values changed": "changed its values",
        "bidirectional": "bidirectional",
        "computes on the update": "layer 0 of DogeForCausalLM failed after its cache update "
                                  "and before its attention",
        "eager ALiBi": "adds the ALiBi term twice.*attn_implementation='sdpa'"}


@pytest.mark.parametrize("kind", list(_WHY))
def test_unservable_models_are_refused_by_name(kind):
    import re

    model = dict(_refused())[kind].eval()
    reason = unsupported_reason(model) or route_reason(model)
    assert reason is not None and type(model).__name__ in reason
    assert re.search(_WHY[kind], reason), reason
    with pytest.raises(hf_paged.UnsupportedModelError, match=type(model).__name__):
        hf_paged.LLM(model)
    if unsupported_reason(model) is not None:
        with pytest.raises(hf_paged.UnsupportedModelError):
            hf_paged.prepare_model(model)
    if not model.config.is_encoder_decoder:  # generate falls back, saying why, same tokens
        ids = torch.randint(3, 60, (2, 6), generator=torch.Generator().manual_seed(0))
        ref = model.generate(ids, max_new_tokens=5, do_sample=False)
        with pytest.warns(UserWarning, match=re.escape(type(model).__name__)):
            out = model.generate(ids, max_new_tokens=5, do_sample=False,
                                 cache_implementation="paged", return_dict_in_generate=True)
        assert torch.equal(ref, out.sequences)
        assert not isinstance(out.past_key_values, PagedCache)


def test_a_refused_model_warns_once_per_call_with_an_assistant():
    """The fallback drops the paged settings from the call: the assistant's own generate
    calls (one per candidate) do not warn about them again."""
    model = dict(_refused())["bypasses"].eval()
    ids = torch.randint(3, 60, (1, 6), generator=torch.Generator().manual_seed(1))
    kwargs = dict(max_new_tokens=12, do_sample=False, assistant_model=model)
    ref = model.generate(ids, **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = model.generate(ids, **kwargs, cache_implementation="paged",
                             cache_config={"block_size": 4})
    ours = [str(w.message) for w in caught if str(w.message).startswith("hf-paged")]
    assert len(ours) == 1 and "BloomForCausalLM" in ours[0], ours
    assert torch.equal(ref, out)


def test_a_bert_style_decoder_is_served():
    """The same BERT-style model with is_decoder=True attends causally: served, stock's
    tokens."""
    import transformers as t

    torch.manual_seed(0)
    model = t.BertLMHeadModel(t.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                           num_attention_heads=2, intermediate_size=64,
                                           is_decoder=True)).eval()
    assert unsupported_reason(model) is None
    ids = torch.randint(3, 60, (2, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                         cache_implementation="paged")
    assert torch.equal(ref, out)


# -- layouts read from the config ---------------------------------------------------------------
def _ids(model, lens=(9, 5)):
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist() for n in lens]


def _stock_and_paged(model, prompts):
    """Per prompt: stock greedy, paged generate's and the engine's (12 tokens)."""
    stock, paged = [], []
    for p in prompts:
        ids = torch.tensor([p])
        kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                      eos_token_id=None)
        stock.append(model.generate(ids, **kwargs)[0, len(p):].tolist())
        paged.append(paged_run(model, inputs=ids, **kwargs)[0, len(p):].tolist())
    llm = hf_paged.LLM(model, block_size=4, num_blocks=64)
    engine = [o.outputs[0].token_ids for o in llm.generate(
        prompts, hf_paged.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        use_tqdm=False)]
    return stock, paged, engine


def test_the_probe_judges_each_kv_layout_of_a_class_apart():
    """One class, two layouts (DBRX with one KV head per query head, then grouped): the
    second is probed and served on its own layout, not on the first one's verdict."""
    mha = make_arch("dbrx", attn_config=dict(kv_n_heads=4, rope_theta=10000.0, clip_qkv=8.0))
    gqa = make_arch("dbrx")
    assert kv_spec(mha.config).num_kv_heads == 4 and kv_spec(gqa.config).num_kv_heads == 2
    for model in (mha, gqa):
        assert route_reason(model) is None
        stock, paged, engine = _stock_and_paged(model, _ids(model))
        assert paged == stock and engine == stock


def test_the_probe_leaves_the_state_the_models_forwards_left(monkeypatch):
    """Dynamic NTK: a 150-token forward grew the rotary base past 64 positions; the probe's
    one-token forward would reset it, and paged generate's tokens then differ from stock's
    on the same model with the same history."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_paged.hf import probe

    def model():
        torch.manual_seed(0)
        made = LlamaForCausalLM(LlamaConfig(
            vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            pad_token_id=0, rope_parameters={"rope_type": "dynamic", "factor": 4.0,
                                             "rope_theta": 10000.0})).eval()
        with torch.no_grad():
            made.lm_head.weight.mul_(8.0)
            made(torch.randint(3, 96, (1, 150), generator=torch.Generator().manual_seed(0)))
        return made

    stock, paged = model(), model()
    rotary = paged.model.rotary_emb
    grown = (rotary.inv_freq.clone(), rotary.max_seq_len_cached)
    monkeypatch.setattr(probe, "_checked", {})  # (probed anew in this process)
    assert route_reason(paged) is None
    assert torch.equal(rotary.inv_freq, grown[0]) and rotary.max_seq_len_cached == grown[1]
    ids = torch.randint(3, 96, (1, 80), generator=torch.Generator().manual_seed(1))
    kwargs = dict(max_new_tokens=20, do_sample=False, pad_token_id=0, eos_token_id=None)
    assert torch.equal(paged_run(paged, inputs=ids, **kwargs), stock.generate(ids, **kwargs))


def test_values_of_their_own_size_without_a_latent():
    """MiMo-V2-Flash's values are narrower than its keys (v_head_dim) with no latent KV: the
    pool holds each at its size. (Its real layer pattern, whose sliding layers have twice
    the KV heads, is refused: one pool holds one head count.)"""
    import transformers as t

    kwargs = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, v_head_dim=8,
                  n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                  n_group=1, topk_group=1, sliding_window=6, pad_token_id=0, eos_token_id=1,
                  bos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    full = t.MiMoV2FlashForCausalLM(t.MiMoV2FlashConfig(
        **kwargs, layer_types=["full_attention"] * 2)).eval()
    with torch.no_grad():
        full.lm_head.weight.mul_(8.0)
    spec = kv_spec(full.config)
    assert (spec.head_dim, spec.v_head_dim, spec.latent) == (16, 8, False)
    stock, paged, engine = _stock_and_paged(full, _ids(full))
    assert paged == stock and engine == stock
    mixed = t.MiMoV2FlashForCausalLM(t.MiMoV2FlashConfig(
        **kwargs, layer_types=["full_attention", "sliding_attention"])).eval()
    assert "MiMoV2FlashForCausalLM" in (route_reason(mixed) or "")
    with pytest.raises(hf_paged.UnsupportedModelError, match="MiMoV2FlashForCausalLM"):
        hf_paged.LLM(mixed)


def test_a_refused_cache_update_is_not_blamed_on_the_layer():
    """The probe's reason for a layer whose states the cache update refuses (a config
    saying 4 KV heads of layers computing 2) is the update's own error, not "computing on
    what the update returned"."""
    import transformers as t

    model = t.LlamaForCausalLM(t.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2)).eval()
    model.config.num_key_value_heads = 4
    reason = route_reason(model)
    assert "stores keys (1, 2, 1, 8)" in reason and "after its cache update" not in reason
