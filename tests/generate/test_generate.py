"""Paged generation is token-identical to Transformers' DynamicCache (float32, CPU)."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import (
    GenerationConfig, LogitsProcessor, LogitsProcessorList, StoppingCriteria,
    StoppingCriteriaList, TextStreamer,
)

from hf_paged import HFPagedError, PagedCache
from conftest import EOS, assert_continues, assert_same, both, left_padded_batch

LENGTHS = [1, 9, 23, 47, 71, 100]  # left-padded batch of 6, lengths 1..100


@pytest.fixture(scope="module")
def batch():
    ids, mask = left_padded_batch(LENGTHS, seed=1)
    return {"input_ids": ids, "attention_mask": mask}


def test_greedy_left_padded(model, batch):
    assert_same(*both(model, **batch, max_new_tokens=24, do_sample=False))


def test_greedy_single_prompt_without_mask(model):
    ids, _ = left_padded_batch([30], seed=2)
    assert_same(*both(model, input_ids=ids, max_new_tokens=20, do_sample=False))


def test_sampling_fixed_seed(model, batch):
    assert_same(*both(model, **batch, max_new_tokens=16, do_sample=True, top_k=20, seed=7))


def test_sampling_num_return_sequences(model, batch):
    assert_same(*both(model, **batch, max_new_tokens=12, do_sample=True,
                      num_return_sequences=3, seed=3))


@pytest.mark.parametrize("num_beams", [2, 4])
def test_beam_search(model, batch, num_beams):
    assert_same(*both(model, **batch, max_new_tokens=12, num_beams=num_beams, do_sample=False,
                      num_return_sequences=2))


def test_scores_close(model, batch):
    ref, out = both(model, **batch, max_new_tokens=10, do_sample=False,
                    return_dict_in_generate=True, output_scores=True, output_logits=True)
    assert_same(ref, out)
    for a, b in zip(ref.scores, out.scores):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    for a, b in zip(ref.logits, out.logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert isinstance(out.past_key_values, PagedCache)


def test_streamer(model, tokenizer, batch, capsys):
    ids = batch["input_ids"][3:4]
    ref, out = both(model, input_ids=ids, max_new_tokens=10, do_sample=False,
                    streamer=TextStreamer(tokenizer))
    assert_same(ref, out)
    printed = capsys.readouterr().out.strip().splitlines()
    assert len(printed) == 2 and printed[0] == printed[1]  # same text streamed both times


class StopAfter(StoppingCriteria):
    """Stops a row once it has produced `limit` tokens equal to or above `token`."""

    def __init__(self, prompt_len, token, limit):
        self.prompt_len, self.token, self.limit = prompt_len, token, limit

    def __call__(self, input_ids, scores, **kwargs):
        return (input_ids[:, self.prompt_len:] >= self.token).sum(-1) >= self.limit


def test_stopping_criteria_and_logits_processor(model, batch):
    class Ban(LogitsProcessor):
        def __call__(self, input_ids, scores):
            scores[:, 10:20] = -float("inf")
            return scores

    width = batch["input_ids"].shape[1]
    kwargs = dict(**batch, max_new_tokens=30, do_sample=False,
                  stopping_criteria=StoppingCriteriaList([StopAfter(width, 50, 3)]),
                  logits_processor=LogitsProcessorList([Ban()]))
    ref, out = both(model, **kwargs)
    assert_same(ref, out)
    assert not ((out[:, width:] >= 10) & (out[:, width:] < 20)).any()


@pytest.mark.parametrize("mode", [dict(do_sample=False), dict(num_beams=3, do_sample=False),
                                  dict(do_sample=True, num_return_sequences=2, top_k=50)])
def test_stop_strings(mode):
    """`stop_strings` (matched on decoded text, across token boundaries) ends rows at the
    same token as on the DynamicCache, in greedy, beam and sampling modes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from conftest import make_byte_tokenizer

    tok = make_byte_tokenizer(300)
    tok.padding_side = "left"
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=len(tok), pad_token_id=0, eos_token_id=1)).eval()
    enc = tok(["the quick", "héllo wörld café"], return_tensors="pt", padding=True)
    width, new = enc.input_ids.shape[1], 30
    # Stop strings the model does write: a piece of each row's greedy text, mid-way.
    free = model.generate(**enc, max_new_tokens=new, do_sample=False)
    stops = [text[6:9] for text in tok.batch_decode(free[:, width + 4:],
                                                    skip_special_tokens=True)]
    assert all(len(s) == 3 for s in stops)
    for seed in range(2):
        ref, out = both(model, seed=seed, **enc, max_new_tokens=new, stop_strings=stops,
                        tokenizer=tok, **mode)
        assert_same(ref, out)
        if not mode.get("do_sample") and mode.get("num_beams", 1) == 1:
            assert out.shape[1] < width + new  # a stop string ended the call early


def test_eos_finishes_rows_early(model, batch):
    # Force some rows to hit EOS early by making EOS likely for them.
    class PushEos(LogitsProcessor):
        def __call__(self, input_ids, scores):
            scores[::2, EOS] += 1e3 * (input_ids.shape[1] % 5 == 0)
            return scores

    ref, out = both(model, **batch, max_new_tokens=20, do_sample=False,
                    logits_processor=LogitsProcessorList([PushEos()]))
    assert_same(ref, out)
    assert (out == EOS).any()


def test_generation_config_route(model, batch):
    ref = model.generate(**batch, max_new_tokens=10, do_sample=False)
    config = GenerationConfig(cache_implementation="paged", max_new_tokens=10, do_sample=False,
                              return_dict_in_generate=True)
    out = model.generate(**batch, generation_config=config)
    assert_same(ref, out)
    assert isinstance(out.past_key_values, PagedCache)


def test_model_generation_config_route(model, batch):
    ref = model.generate(**batch, max_new_tokens=8, do_sample=False)
    previous = model.generation_config.cache_implementation
    model.generation_config.cache_implementation = "paged"
    try:
        out = model.generate(**batch, max_new_tokens=8, do_sample=False,
                             return_dict_in_generate=True)
    finally:
        model.generation_config.cache_implementation = previous
    assert_same(ref, out)
    assert isinstance(out.past_key_values, PagedCache)


def test_attention_implementation_restored(model, batch):
    before = model.config._attn_implementation
    model.generate(**batch, max_new_tokens=3, cache_implementation="paged")
    assert model.config._attn_implementation == before


def assert_paged_is_stock(model, ids, mask, max_new_tokens):
    """Paged greedy generate of a left-padded batch, with no fallback to Transformers'
    cache, equals stock generate."""
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                  do_sample=False)
    ref = model.generate(**kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = model.generate(**kwargs, cache_implementation="paged")
    assert torch.equal(out, ref)


@pytest.mark.parametrize("kind", ["llama_gqa", "falcon_new"])
def test_a_layer_copied_with_its_own_config_runs_paged(kind):
    """A decoder layer put in place of another as a deep copy (layer surgery) holds a copy
    of the config: the switch reaches it too, so it attends on the paged cache (not SDPA
    over the pool), the output equals stock generate, and both configs are restored."""
    import copy

    from conftest import make_model

    model = make_model(kind)
    layers = model.model.layers if hasattr(model, "model") else model.transformer.h
    layers[1] = copy.deepcopy(layers[0])  # (layer 0's weights, run as layer 1)
    copied = getattr(layers[1], "self_attn", None) or layers[1].self_attention
    copied.layer_idx = 1
    assert_paged_is_stock(model, *left_padded_batch([5, 11], seed=2), 8)
    assert copied.config is not model.config
    assert model.config._attn_implementation == copied.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("arch", ["gemma2", "gpt_oss", "deepseek_v3", "qwen2_sliding"])
def test_a_retrained_copy_of_a_layer_put_in_its_place_runs_paged(arch):
    """Layer surgery on models with per-layer windows, sinks, soft-capping and latent KV: a
    deep copy of layer 1, its weights changed, in place of it. Paged generate on a padded
    batch and the engine give stock tokens."""
    import copy

    from hf_paged import LLM, SamplingParams
    from test_engine import stock_greedy
    from zoo import make_arch

    model = make_arch(arch)
    layer = copy.deepcopy(model.model.layers[1])
    with torch.no_grad():
        for p in layer.parameters():
            p.mul_(1.2)
    model.model.layers[1] = layer
    ids, mask = left_padded_batch([5, 11], seed=3)
    ids = ids % model.config.vocab_size
    assert_paged_is_stock(model, ids, mask, 6)
    prompts = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
    outs = LLM(model, block_size=4, num_blocks=64).generate(
        prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [stock_greedy(model, p, 6) for p in prompts]


@pytest.mark.parametrize("kind", ["llama_gqa", "falcon_alibi"])
def test_a_model_with_its_first_layer_removed_runs_paged(kind):
    """Layers removed from a model (pruning) leave the others their `layer_idx`: the
    forward's first layer, whichever it is, takes the slots of all. Paged generate and the
    engine give the tokens of the same model with its layers numbered anew (stock
    Transformers does not: its DynamicCache reads the past length from layer 0, which no
    longer runs)."""
    import copy

    from conftest import make_model
    from hf_paged import LLM, SamplingParams

    model = make_model(kind)
    layers = model.model.layers if hasattr(model, "model") else model.transformer.h
    del layers[0]
    renumbered = copy.deepcopy(model)
    kept = renumbered.model.layers if hasattr(renumbered, "model") else renumbered.transformer.h
    for i, module in [(i, m) for i, layer in enumerate(kept) for m in layer.modules()]:
        if "layer_idx" in module.__dict__:
            module.layer_idx = i
    renumbered.config.num_hidden_layers = len(kept)
    ids, mask = left_padded_batch([6, 13], seed=7)
    for options in (dict(do_sample=False), dict(num_beams=3, do_sample=False)):
        ref = renumbered.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8,
                                  **options)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8,
                             cache_implementation="paged", **options)
        assert torch.equal(out, ref), options
    prompts = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
    outs = LLM(model, block_size=4, num_blocks=64).generate(
        prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    for prompt, o in zip(prompts, outs):
        ref = renumbered.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)
        assert o.outputs[0].token_ids == ref[0, len(prompt):].tolist()


@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode])
def test_grad_modes_and_pool_reuse(llama, batch, context):
    cache_config = {"num_blocks": 64, "block_size": 8}
    ref = llama.generate(**batch, max_new_tokens=8, do_sample=False)
    # The sized pool is made under one mode and reused under the other.
    other = torch.inference_mode if context is torch.no_grad else torch.no_grad
    with other():
        llama.generate(**batch, max_new_tokens=8, cache_implementation="paged",
                       cache_config=cache_config)
    with context():
        out = llama.generate(**batch, max_new_tokens=8, cache_implementation="paged",
                             cache_config=cache_config)
    assert_same(ref, out)


def test_sliding_window_shorter_than_sequence():
    from conftest import make_model

    model = make_model("mistral_sw")
    assert model.config.sliding_window < 40
    ids, mask = left_padded_batch([3, 40, 60], seed=5)
    assert_same(*both(model, input_ids=ids, attention_mask=mask, max_new_tokens=30,
                      do_sample=False))


def test_inputs_embeds(llama, batch):
    embeds = llama.get_input_embeddings()(batch["input_ids"])
    ref, out = both(llama, inputs_embeds=embeds, attention_mask=batch["attention_mask"],
                    max_new_tokens=8, do_sample=False)
    assert_same(ref, out)


def test_chunked_prefill(model, batch):
    assert_same(*both(model, **batch, max_new_tokens=8, do_sample=False, prefill_chunk_size=16))


def test_single_new_token_and_explicit_head_dim():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=24, pad_token_id=0)).eval()
    ids, mask = left_padded_batch([3, 30, 11], seed=6)
    for new in (1, 9):
        assert_same(*both(model, input_ids=ids, attention_mask=mask, max_new_tokens=new,
                          do_sample=False))


def test_continue_from_returned_cache(llama):
    """A second generate call continues from the PagedCache the first one returned."""
    ids, mask = left_padded_batch([12, 20], seed=8)
    first = llama.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                           cache_implementation="paged", return_dict_in_generate=True)
    assert_continues(llama, first, mask, first.past_key_values, new_tokens=6)


@pytest.mark.parametrize("extra", [dict(prefill_chunk_size=5),
                                   dict(output_hidden_states=True, return_dict_in_generate=True),
                                   {}])
def test_mask_zeros_between_real_tokens(model, extra):
    """Zeros inside a prompt's mask (not only left padding) are hidden slots: stored, never
    attended, so sliding windows count them as Transformers does."""
    ids, mask = left_padded_batch([12, 20, 5], seed=8)
    mask[:2, -6:-4] = 0
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, **extra)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no fallback to the stock cache
        assert_same(*both(model, **kwargs))


def test_mask_zeros_on_direct_forward(model):
    ids, mask = left_padded_batch([12, 20, 5], seed=8)
    mask[:2, -6:-4] = 0
    ref = model(input_ids=ids, attention_mask=mask).logits
    own = model.config._attn_implementation_internal
    model.config._attn_implementation_internal = "paged"
    try:
        cache = PagedCache(model.config)
        out = model(input_ids=ids, attention_mask=mask, past_key_values=cache).logits
    finally:
        model.config._attn_implementation_internal = own
    real = mask.cumsum(1) > 0  # every column from a row's first real token on
    torch.testing.assert_close(out[real], ref[real], rtol=1e-4, atol=1e-4)
    assert cache.memory_stats().tokens_stored == int(real.sum())


def test_continue_with_padded_turn(llama):
    """A continuation whose new columns hold pad tokens between real ones (a row padded after
    its answer, then a new turn) matches DynamicCache's continuation."""
    from conftest import PAD

    ids, mask = left_padded_batch([12, 20], seed=8)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                  return_dict_in_generate=True)
    first_ref, first = both(llama, **kwargs)
    turn = torch.randint(3, 96, (2, 4), generator=torch.Generator().manual_seed(0))
    ids2 = torch.cat([first.sequences, torch.full((2, 2), PAD), turn], 1)
    ones, zeros = torch.ones(2, 9, dtype=mask.dtype), torch.zeros(2, 2, dtype=mask.dtype)
    mask2 = torch.cat([mask, ones[:, :5], zeros, ones[:, :4]], 1)
    kwargs = dict(input_ids=ids2, attention_mask=mask2, max_new_tokens=6, do_sample=False)
    ref = llama.generate(**kwargs, past_key_values=first_ref.past_key_values)
    out = llama.generate(**kwargs, past_key_values=first.past_key_values)
    assert isinstance(first.past_key_values, PagedCache)
    assert_same(ref, out)
    # left padding is not stored; the 2 pads per row after real tokens are (hidden slots);
    # the last token of each row is never fed back
    stored = int((mask2.cumsum(1) > 0).sum()) + 2 * 6 - 2
    assert first.past_key_values.memory_stats().tokens_stored == stored


def test_user_position_ids_on_left_padded_batch(llama):
    ids, mask = left_padded_batch([5, 9], seed=1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0) * 3 + 2  # strided, offset
    ref, out = both(llama, input_ids=ids, attention_mask=mask, position_ids=positions,
                    max_new_tokens=8, do_sample=False, return_dict_in_generate=True,
                    output_logits=True)
    assert_same(ref, out)
    torch.testing.assert_close(out.logits[0], ref.logits[0], rtol=1e-4, atol=1e-4)


def test_output_attentions_falls_back_to_stock_with_a_warning(model):
    ids, mask = left_padded_batch([4, 9], seed=2)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False,
                  output_attentions=True, return_dict_in_generate=True)
    ref = model.generate(**kwargs)
    with pytest.warns(UserWarning, match="output_attentions") as record:
        out = model.generate(**kwargs, cache_implementation="paged")
    assert record[0].filename == __file__  # points at the caller, not at library internals
    assert_same(ref, out)
    assert [[a.shape for a in step] for step in out.attentions] == \
        [[a.shape for a in step] for step in ref.attentions]


def test_an_output_attentions_call_leaves_later_paged_calls_sharing_their_prompts():
    """A call with output_attentions=True runs on Transformers' cache and leaves its
    output-capturing hooks on the model for good; later paged calls still prefill each
    prompt once and share its blocks among the beams."""
    from conftest import PAD, VOCAB, make_model

    model = make_model("llama_gqa", seed=3)
    ids = torch.randint(3, VOCAB, (2, 40), generator=torch.Generator().manual_seed(0))
    beam = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                num_beams=4, do_sample=False, pad_token_id=PAD, cache_implementation="paged",
                cache_config={"block_size": 4}, return_dict_in_generate=True)
    before = model.generate(**beam)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.generate(input_ids=ids[:1, :5], attention_mask=torch.ones(1, 5, dtype=torch.long),
                       max_new_tokens=2, pad_token_id=PAD, cache_implementation="paged",
                       output_attentions=True, return_dict_in_generate=True)
    assert any(m._forward_hooks for m in model.modules())  # Transformers' recorders stay
    after = model.generate(**beam)
    assert torch.equal(after.sequences, before.sequences)
    assert (after.past_key_values.memory_stats().peak_blocks_in_use
            == before.past_key_values.memory_stats().peak_blocks_in_use)
