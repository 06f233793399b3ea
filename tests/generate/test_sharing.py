"""Copy-on-write sharing: beam search, parallel sampling, prefill once, reorder and crop."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st
from transformers import DynamicCache, LlamaConfig

from hf_paged import PagedCache
from hf_paged.kernels.reference import gather_kv
from conftest import assert_same, both, left_padded_batch, make_model

LENGTHS = [5, 19, 33]


@pytest.fixture(scope="module")
def batch():
    ids, mask = left_padded_batch(LENGTHS, seed=11)
    return {"input_ids": ids, "attention_mask": mask}


@pytest.mark.parametrize("num_beams", [2, 4, 8])
def test_beam_search_widths(model, batch, num_beams):
    assert_same(*both(model, **batch, max_new_tokens=10, num_beams=num_beams,
                      num_return_sequences=2, do_sample=False))


@pytest.mark.parametrize("early_stopping", [True, False, "never"])
def test_beam_search_stopping_and_length_penalty(model, batch, early_stopping):
    ref, out = both(model, **batch, max_new_tokens=12, num_beams=3, do_sample=False,
                    early_stopping=early_stopping, length_penalty=0.6,
                    return_dict_in_generate=True, output_scores=True)
    assert_same(ref, out)
    torch.testing.assert_close(ref.sequences_scores, out.sequences_scores, rtol=1e-4, atol=1e-4)
    for a, b in zip(ref.scores, out.scores):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_beam_sampling(model, batch):
    assert_same(*both(model, **batch, max_new_tokens=10, num_beams=3, do_sample=True,
                      top_k=10, seed=5))


def test_parallel_sampling(model, batch):
    assert_same(*both(model, **batch, max_new_tokens=10, do_sample=True,
                      num_return_sequences=4, seed=9))


def test_assisted_decoding_both_ways(model):
    assistant = make_model("llama_mha", seed=3)
    ids, _ = left_padded_batch([21], seed=4)
    assert_same(*both(model, input_ids=ids, max_new_tokens=16, do_sample=False,
                      assistant_model=assistant))
    assert_same(*both(model, input_ids=ids, max_new_tokens=16, do_sample=False,
                      prompt_lookup_num_tokens=3))


def test_prompt_is_prefilled_and_stored_once(llama, monkeypatch):
    ids, mask = left_padded_batch([40, 40], seed=2)
    rows_seen = []
    original = PagedCache.begin_forward

    def spy(self, rows, q_len, *args, **kwargs):
        rows_seen.append((rows, q_len))
        return original(self, rows, q_len, *args, **kwargs)

    monkeypatch.setattr(PagedCache, "begin_forward", spy)
    e, new, bs = 4, 6, 16
    out = llama.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                         min_new_tokens=new, do_sample=True, num_return_sequences=e,
                         cache_implementation="paged", return_dict_in_generate=True,
                         cache_config={"block_size": bs})
    assert rows_seen[0] == (2, 40)  # the prefill ran on the 2 distinct prompts only
    assert all(rows == 2 * e for rows, _ in rows_seen[1:])
    stats = out.past_key_values.memory_stats()
    prompt = 40
    assert stats.logical_tokens == 2 * e * (prompt + new - 1)
    # Each prompt is stored once; at most the partial last prompt block is copied per fork.
    assert stats.tokens_stored <= 2 * (prompt + e * (new - 1) + (e - 1) * (prompt % bs))
    assert stats.shared_blocks >= 2 * (prompt // bs)
    assert stats.unshared_kv_bytes > stats.kv_bytes_in_use


def test_beam_search_shares_blocks(llama, batch):
    out = llama.generate(**batch, max_new_tokens=12, num_beams=4, do_sample=False,
                         cache_implementation="paged", return_dict_in_generate=True)
    stats = out.past_key_values.memory_stats()
    assert stats.shared_blocks > 0
    assert stats.tokens_stored < stats.logical_tokens
    assert stats.kv_bytes_in_use < stats.unshared_kv_bytes


def _paged_logical(cache: PagedCache, layer: int):
    """Each row's K and V as a contiguous [R, Hkv, T, D] (T = cached tokens)."""
    k_cache, v_cache = cache.access.views(layer)
    bt = cache.device_table.table.long()
    seen = cache.get_seq_length()
    return (gather_kv(k_cache, bt)[:, :, :seen], gather_kv(v_cache, bt)[:, :, :seen])


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.integers(1, 3)),
        st.tuples(st.just("reorder"), st.lists(st.integers(0, 3), min_size=4, max_size=4)),
        st.tuples(st.just("crop"), st.integers(1, 3)),
    ),
    min_size=1, max_size=25,
)


@settings(max_examples=60, deadline=None)
@given(ops=OPS, prompt=st.integers(1, 9), block_size=st.sampled_from([1, 2, 4, 16]))
def test_reorder_and_crop_match_dynamic_cache(ops, prompt, block_size):
    """Random forks (beam_idx), appends and crops: every row's KV equals a DynamicCache's."""
    config = LlamaConfig(hidden_size=16, num_attention_heads=2, num_key_value_heads=1,
                         num_hidden_layers=2, vocab_size=8)
    rows, heads, dim = 4, 1, 8
    paged, ref = PagedCache(config, {"block_size": block_size}), DynamicCache(config=config)
    gen = torch.Generator().manual_seed(prompt)

    def append(q):
        for layer in range(2):
            k, v = torch.randn(2, rows, heads, q, dim, generator=gen)
            paged.update(k, v, layer)
            ref.update(k, v, layer)

    append(prompt)
    for op, arg in ops:
        if op == "append":
            append(arg)
        elif op == "reorder":
            idx = torch.tensor(arg)
            paged.reorder_cache(idx)
            ref.reorder_cache(idx)
        elif ref.get_seq_length() > arg:
            paged.crop(-arg)
            ref.crop(-arg)
        assert paged.get_seq_length() == ref.get_seq_length()
        for layer in range(2):
            k, v = _paged_logical(paged, layer)
            torch.testing.assert_close(k, ref.layers[layer].keys, rtol=0, atol=0)
            torch.testing.assert_close(v, ref.layers[layer].values, rtol=0, atol=0)
        held: dict[int, int] = {}
        for table in paged.tables.tables:
            for b in table:
                held[b] = held.get(b, 0) + 1
        pool = paged.pool.blocks
        assert all(pool.refcount(b) == n for b, n in held.items())
        assert pool.num_used == len(held)
    paged.reset()
    assert paged.pool.blocks.num_free == paged.pool.blocks.num_blocks


def test_sliding_window_releases_blocks_out_of_reach():
    model = make_model("mistral_sw")
    window, bs = model.config.sliding_window, 4
    ids, mask = left_padded_batch([3, 30, 50], seed=12)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=40, min_new_tokens=40,
                  do_sample=False)
    ref = model.generate(**kwargs)
    out = model.generate(**kwargs, cache_implementation="paged", return_dict_in_generate=True,
                         cache_config={"block_size": bs})
    assert_same(ref, out)
    stats = out.past_key_values.memory_stats()
    per_row = -(-(window - 1) // bs) + 2  # the window, plus partial blocks at both ends
    assert stats.blocks_in_use <= 3 * per_row
    assert stats.tokens_stored < stats.logical_tokens
    beams = dict(kwargs, num_beams=3, max_new_tokens=20, min_new_tokens=20)
    assert_same(model.generate(**beams),
                model.generate(**beams, cache_implementation="paged", cache_config={"block_size": bs}))


def test_crop_into_released_window_is_refused_unless_recording():
    from hf_paged import HFPagedError

    model = make_model("mistral_sw")
    ids, _ = left_padded_batch([30], seed=2)
    out = model.generate(input_ids=ids, max_new_tokens=10, cache_implementation="paged",
                         return_dict_in_generate=True, cache_config={"block_size": 4})
    cache = out.past_key_values
    seen = cache.get_seq_length()
    with pytest.raises(HFPagedError, match="activate_past_recording"):
        cache.crop(-20)
    assert cache.get_seq_length() == seen  # unchanged
    cache.crop(-1)  # within the window: fine
    assert cache.get_seq_length() == seen - 1


def test_sliding_window_assistant_rolls_back():
    """An assistant's cache records past states, so rejected candidates can be cropped."""
    main, assistant = make_model("llama_gqa"), make_model("mistral_sw", seed=3)
    assistant.generation_config.num_assistant_tokens = 6
    assistant.generation_config.num_assistant_tokens_schedule = "constant"
    assistant.generation_config.assistant_confidence_threshold = 0.0
    ids, _ = left_padded_batch([21], seed=4)
    kwargs = dict(input_ids=ids, max_new_tokens=24, do_sample=False, assistant_model=assistant)
    ref = main.generate(**kwargs)
    out = main.generate(**kwargs, cache_implementation="paged", cache_config={"block_size": 2})
    assert_same(ref, out)
