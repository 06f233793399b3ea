"""Masks beyond left padding, against Transformers' DynamicCache (float32, CPU): zeros after
real tokens, masks that change between calls, all-padding rows, right padding, 4D masks, and
the assistant masks of assisted decoding."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import DynamicCache, MistralConfig, MistralForCausalLM

from hf_paged import HFPagedError, PagedCache
from conftest import (
    PAD, VOCAB, _common, assert_same, both, grown_mask, left_padded_batch, make_model,
)


def paged_attention(model):
    """Context manager: the model runs with attn_implementation='paged' inside."""
    class _Switch:
        def __enter__(self):
            self.own = model.config._attn_implementation_internal
            model.config._attn_implementation_internal = "paged"

        def __exit__(self, *exc):
            model.config._attn_implementation_internal = self.own

    return _Switch()


def first_turn(model, lengths, seed=8, **kwargs):
    """(stock output, paged output) of a first generate call that returns its cache."""
    ids, mask = left_padded_batch(lengths, seed=seed)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
              return_dict_in_generate=True, **kwargs)
    ref, out = both(model, **kw)
    assert_same(ref, out)
    return ids, mask, ref, out


def continue_both(model, ref, out, ids2, mask2, **kwargs):
    kw = dict(input_ids=ids2, attention_mask=mask2, max_new_tokens=6, do_sample=False,
              return_dict_in_generate=True, output_logits=True, **kwargs)
    a = model.generate(**kw, past_key_values=ref.past_key_values)
    b = model.generate(**kw, past_key_values=out.past_key_values)
    assert isinstance(out.past_key_values, PagedCache)
    assert_same(a, b)
    torch.testing.assert_close(b.logits[0], a.logits[0], rtol=1e-4, atol=1e-4)
    return a, b


def test_continuation_masks_one_new_column_of_one_row(model):
    """A one-token turn whose column is padding for one row: that row must not attend to it."""
    ids, mask, ref, out = first_turn(model, [6, 11])
    seq = ref.sequences
    new = torch.tensor([[PAD], [17]])
    mask2 = torch.cat([grown_mask(mask, seq.shape[1]), torch.tensor([[0], [1]])], 1)
    continue_both(model, ref, out, torch.cat([seq, new], 1), mask2)


def test_continuation_masks_cached_columns(model):
    """`mask = sequences != pad` after a row stopped early, then a new turn: columns that were
    real when cached are masked from now on, as DynamicCache masks them."""
    ids, mask, ref, out = first_turn(model, [6, 11])
    seq = ref.sequences.clone()
    seq[0, -3:] = PAD  # as if row 0 had stopped 3 tokens early and generate padded it
    turn = torch.randint(3, VOCAB, (2, 3), generator=torch.Generator().manual_seed(1))
    ids2 = torch.cat([seq, turn], 1)
    continue_both(model, ref, out, ids2, (ids2 != PAD).long())


def test_masked_cached_column_can_be_shown_again(llama):
    """A cached column hidden by one call and shown by the next: the slot was kept."""
    ids, mask, ref, out = first_turn(llama, [6, 11])
    seq = ref.sequences
    mask_a = grown_mask(mask, seq.shape[1])
    mask_a[1, -2] = 0
    turn = torch.tensor([[40], [41]])
    a, b = continue_both(llama, ref, out, torch.cat([seq, turn], 1),
                         torch.cat([mask_a, torch.ones(2, 1, dtype=mask.dtype)], 1))
    seq2 = a.sequences
    mask_b = grown_mask(mask_a, seq2.shape[1])
    mask_b[1, -9] = 1  # shown again
    continue_both(llama, a, b, torch.cat([seq2, turn], 1),
                  torch.cat([mask_b, torch.ones(2, 1, dtype=mask.dtype)], 1))


def test_unmasking_skipped_left_padding_is_a_clear_error(llama):
    ids, mask, ref, out = first_turn(llama, [6, 11])
    cache = out.past_key_values
    seq = out.sequences
    seen, stored = cache.get_seq_length(), cache.memory_stats().tokens_stored
    full = torch.ones(2, seq.shape[1] + 1, dtype=mask.dtype)  # says the left padding is real
    # (Transformers drops a mask of all ones: the message says so, not only "no mask")
    with pytest.raises(HFPagedError, match="all ones, which Transformers drops.*did not store"):
        llama.generate(input_ids=torch.cat([seq, seq[:, -1:]], 1), attention_mask=full,
                       max_new_tokens=2, past_key_values=cache)
    assert cache.get_seq_length() == seen and cache.memory_stats().tokens_stored == stored


@pytest.mark.parametrize("mode", [dict(), dict(num_beams=3), dict(do_sample=True),
                                  dict(num_return_sequences=2, do_sample=True)])
@pytest.mark.parametrize("lengths", [[0, 0], [0, 7], [5, 0, 3]])
def test_all_padding_rows(model, mode, lengths):
    ids, mask = left_padded_batch([max(n, 1) for n in lengths], seed=4)
    for row, n in enumerate(lengths):
        if n == 0:
            ids[row], mask[row] = PAD, 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Transformers warns about right padding here
        assert_same(*both(model, input_ids=ids, attention_mask=mask, max_new_tokens=5, **mode))


@pytest.mark.parametrize("mode", [dict(), dict(num_beams=3), dict(do_sample=True)])
def test_right_padding_matches_stock(model, mode):
    """A row whose last column is padding takes its logits there, as Transformers does."""
    ids, mask = left_padded_batch([9, 9, 9], seed=5)
    ids[1, -3:], mask[1, -3:] = PAD, 0  # right-padded
    ids[2, :2], mask[2, :2] = PAD, 0  # left-padded
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert_same(*both(model, input_ids=ids, attention_mask=mask, max_new_tokens=6, **mode))


def test_empty_turn_in_batched_continuation(model):
    """One row gets a new turn, the other none (its new columns are all padding)."""
    ids, mask, ref, out = first_turn(model, [6, 11])
    seq = ref.sequences
    turn = torch.tensor([[PAD, PAD, PAD], [30, 31, 32]])
    mask2 = torch.cat([grown_mask(mask, seq.shape[1]), (turn != PAD).long()], 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        continue_both(model, ref, out, torch.cat([seq, turn], 1), mask2)


def test_wider_mask_than_input_is_rejected(llama):
    ids, mask = left_padded_batch([4, 6], seed=1)
    wide = torch.cat([torch.ones(2, 3, dtype=mask.dtype), mask], 1)
    cache = PagedCache(llama.config)
    with paged_attention(llama), pytest.raises(ValueError, match=r"\[2, 6\]"):
        llama(input_ids=ids, attention_mask=wide, past_key_values=cache)
    assert cache.get_seq_length() == 0


def long_window_mistral():
    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(**_common(
        num_attention_heads=4, num_key_value_heads=2, sliding_window=4096)))
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model.eval()


def block_diagonal(lengths, dtype=torch.bool):
    """4D mask [1, 1, L, L]: causal inside each packed sequence, nothing across them."""
    total = sum(lengths)
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    allowed = (seq[:, None] == seq[None, :]) & torch.ones(total, total, dtype=torch.bool).tril()
    if dtype == torch.bool:
        return allowed[None, None]
    return torch.zeros(total, total).masked_fill(~allowed, torch.finfo(dtype).min)[None, None]


@pytest.mark.parametrize("kind", ["llama_gqa", "mistral", "falcon_mq", "falcon_new"])
@pytest.mark.parametrize("dtype", [torch.bool, torch.float32])
def test_4d_mask_on_direct_forward_is_honoured(kind, dtype):
    """Two sequences packed in one row with a block-diagonal 4D mask, then one more token
    with its own 4D mask: the logits are DynamicCache's. (Mistral with a window shorter
    than the sequence fails on DynamicCache itself with a 4D mask.)"""
    model = long_window_mistral() if kind == "mistral" else make_model(kind)
    ids = torch.randint(3, VOCAB, (1, 11), generator=torch.Generator().manual_seed(2))
    lengths = [5, 6]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    mask = block_diagonal(lengths, dtype)
    nxt = torch.tensor([[7]])
    step = torch.zeros(1, 1, 1, 12, dtype=torch.bool)
    step[..., 5:] = True  # continues the second sequence
    if dtype != torch.bool:
        step = torch.zeros(1, 1, 1, 12).masked_fill(~step, torch.finfo(dtype).min)
    with torch.no_grad():
        dyn = DynamicCache(config=model.config)
        ref = model(input_ids=ids, attention_mask=mask, position_ids=positions,
                    past_key_values=dyn).logits
        ref2 = model(input_ids=nxt, attention_mask=step, position_ids=torch.tensor([[6]]),
                     past_key_values=dyn).logits
        with paged_attention(model):
            cache = PagedCache(model.config)
            out = model(input_ids=ids, attention_mask=mask, position_ids=positions,
                        past_key_values=cache).logits
            out2 = model(input_ids=nxt, attention_mask=step, position_ids=torch.tensor([[6]]),
                         past_key_values=cache).logits
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out2, ref2, rtol=1e-4, atol=1e-4)
    plain = model(input_ids=ids, position_ids=positions).logits  # proof the mask mattered
    assert (plain - ref).abs().max() > 1e-2


def test_a_4d_mask_hiding_every_key_of_a_query_gives_what_it_gave_before_a_generate():
    """A direct forward on an eager model its owner set to "paged", with a bool 4D mask
    whose last query sees nothing: that query's output is SDPA's zeros (the model, as set,
    has no other implementation), before and after a paged generate (whose switch
    remembers the model's eager attention while it runs) alike."""
    model = make_model("llama_gqa")
    model.set_attn_implementation("eager")
    ids = torch.randint(3, VOCAB, (1, 5), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    mask[4] = False

    def direct():
        with paged_attention(model), torch.no_grad():
            return model(input_ids=ids, attention_mask=mask[None, None],
                         past_key_values=PagedCache(model.config)).logits

    before = direct()
    model.generate(ids, max_new_tokens=1, cache_implementation="paged", pad_token_id=PAD)
    torch.testing.assert_close(direct(), before, rtol=0, atol=0)


def test_4d_mask_of_the_wrong_size_is_named(llama):
    ids = torch.randint(3, VOCAB, (1, 6))
    with paged_attention(llama), pytest.raises(ValueError, match="4D attention mask"):
        llama(input_ids=ids, attention_mask=block_diagonal([3, 4]),
              past_key_values=PagedCache(llama.config))


def pad_emitting_setup(main, prompt_len=10, seed=3):
    """A prompt and a pad_token_id that the main model emits while generating: assisted
    decoding then gives the assistant a mask with a zero after real tokens."""
    ids = torch.randint(3, VOCAB, (1, prompt_len), generator=torch.Generator().manual_seed(seed))
    plain = main.generate(input_ids=ids, max_new_tokens=12, do_sample=False)
    new = plain[0, prompt_len:].tolist()
    pad = next(t for t in new[2:] if t not in ids[0].tolist() and t != new[0])
    return ids, pad


@pytest.mark.parametrize("assistant_kind", ["llama_mha", "mistral_sw", "falcon_alibi", "self"])
def test_assistant_sees_emitted_pad_token(assistant_kind):
    main = make_model("llama_gqa")
    assistant = main if assistant_kind == "self" else make_model(assistant_kind, seed=3)
    ids, pad = pad_emitting_setup(main)
    kwargs = dict(input_ids=ids, max_new_tokens=16, do_sample=False, pad_token_id=pad,
                  assistant_model=assistant)
    ref = main.generate(**kwargs)
    assert pad in ref[0, ids.shape[1]:].tolist()
    out = main.generate(**kwargs, cache_implementation="paged", cache_config={"block_size": 2})
    assert_same(ref, out)


def test_assistant_pad_token_with_sampling():
    """Speculative sampling reads the assistant's logits: they must be stock's too."""
    main, assistant = make_model("llama_gqa"), make_model("mistral_sw", seed=3)
    ids, pad = pad_emitting_setup(main)
    assert_same(*both(main, seed=5, input_ids=ids, max_new_tokens=16, do_sample=True,
                      pad_token_id=pad, assistant_model=assistant))


@pytest.mark.parametrize("assist", [dict(prompt_lookup_num_tokens=3), "assistant"])
def test_long_sliding_window_assisted_decoding(assist):
    """Mistral-7B's window (4096) with a 20-token prompt: nothing was released, crop works."""
    model = long_window_mistral()
    if assist == "assistant":
        assist = dict(assistant_model=make_model("mistral_sw", seed=4))
    ids = torch.randint(3, VOCAB, (1, 20), generator=torch.Generator().manual_seed(6))
    ids[0, 10:15] = ids[0, 2:7]  # something for prompt lookup to find
    assert_same(*both(model, input_ids=ids, max_new_tokens=12, do_sample=False, **assist))


def test_crop_on_long_sliding_window_cache():
    model = long_window_mistral()
    ids = torch.randint(3, VOCAB, (1, 20), generator=torch.Generator().manual_seed(6))
    out = model.generate(input_ids=ids, max_new_tokens=4, cache_implementation="paged",
                         return_dict_in_generate=True)
    cache = out.past_key_values
    seen = cache.get_seq_length()
    cache.crop(-1)
    assert cache.get_seq_length() == seen - 1
    assert cache.memory_stats().tokens_stored == seen - 1


@pytest.mark.parametrize("kind", ["gemma2", "gpt_oss", "qwen2", "phi3", "phimoe"])
def test_guidance_with_a_negative_prompt_on_eager_attention_models(kind):
    """Classifier-free guidance runs the model on the negative prompt with a cache of its own
    inside a paged generate. Where a layer's softcap or sinks need the model's eager attention,
    a prompt of several tokens must still attend causally (SDPA's mask function hands eager
    attention None for a causal square). Phi-3's forwards without a cache took the call's
    PagedCache (as at its LongRoPE switch), which broke the next step."""
    from zoo import make_arch

    model = make_arch(kind)
    ids = torch.randint(3, VOCAB, (1, 8), generator=torch.Generator().manual_seed(0))
    kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
              do_sample=False, pad_token_id=PAD, guidance_scale=3.0,
              negative_prompt_ids=torch.tensor([[5, 6, 7, 9]]),
              negative_prompt_attention_mask=torch.ones(1, 4, dtype=torch.long))
    assert_same(*both(model, **kw))


@pytest.mark.parametrize("block_size", [5, 16])
def test_a_padding_query_that_sees_no_key_under_softcap_gives_no_nan(block_size):
    """Gemma 2 (soft-capping: the reference's explicit softmax) continuing a batch whose
    mask hides a run of cached tokens, then a padding token of the new turn: in its sliding
    window that query sees no key. Transformers' eager attention averages there; -inf
    scores gave NaN, which reached every row through masked (zero-weight) values."""
    from zoo import make_arch

    model = make_arch("gemma2")
    ids, mask = left_padded_batch([40, 12, 60], seed=4)
    tail = torch.randint(3, VOCAB, (3, 9), generator=torch.Generator().manual_seed(1))
    tail[1, 1:] = PAD  # a run of pads, attended in the first turn, hidden in the second
    first = torch.cat([ids, tail], 1)
    first_mask = torch.cat([mask, torch.ones(3, 9, dtype=torch.long)], 1)
    turn = torch.randint(3, VOCAB, (3, 6), generator=torch.Generator().manual_seed(2))
    second = torch.cat([first, turn], 1)
    outs = []
    for paged in (False, True):
        extra = dict(cache_implementation="paged", cache_config={"block_size": block_size})
        one = model.generate(input_ids=first[:, :-1], attention_mask=first_mask[:, :-1],
                             max_new_tokens=1, do_sample=False, pad_token_id=PAD,
                             return_dict_in_generate=True, **(extra if paged else {}))
        two = model.generate(input_ids=second, attention_mask=(second != PAD).long(),
                             past_key_values=one.past_key_values, max_new_tokens=3,
                             do_sample=False, pad_token_id=PAD, return_dict_in_generate=True,
                             output_logits=True)
        assert not any(torch.isnan(x).any() for x in two.logits)
        outs.append(two)
    assert_same(outs[0], outs[1])
    torch.testing.assert_close(torch.stack(outs[1].logits), torch.stack(outs[0].logits),
                               rtol=1e-4, atol=1e-4)
