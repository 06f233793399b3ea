"""PagedCache on its own: storage, accounting, sizing, errors and direct use."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import hf_paged
from hf_paged import KVCacheExhaustedError, PagedCache, PagedCacheConfig
from conftest import assert_same, both, grown_mask, left_padded_batch, make_model

LENGTHS = [1, 9, 23, 47, 71, 100]


@pytest.fixture(scope="module")
def batch():
    ids, mask = left_padded_batch(LENGTHS, seed=1)
    return {"input_ids": ids, "attention_mask": mask}


def paged_generate(model, batch, new_tokens=8, **kw):
    return model.generate(**batch, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                          do_sample=False, cache_implementation="paged",
                          return_dict_in_generate=True, **kw)


def test_pad_tokens_are_not_stored(llama, batch):
    new = 8
    out = paged_generate(llama, batch, new)
    stats = out.past_key_values.memory_stats()
    real = sum(LENGTHS) + len(LENGTHS) * (new - 1)  # the last token is never fed back
    assert stats.tokens_stored == stats.logical_tokens == real
    bs = stats.block_size
    assert stats.blocks_in_use == sum(-(-(n + new - 1) // bs) for n in LENGTHS)
    assert stats.utilization == pytest.approx(real / (stats.blocks_in_use * bs))
    cfg = llama.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    assert stats.bytes_per_token == cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * 4
    assert stats.pool_bytes == stats.num_blocks * bs * stats.bytes_per_token
    assert stats.shared_blocks == 0


def test_unsized_pool_stays_close_to_need(llama, batch):
    stats = paged_generate(llama, batch, 40).past_key_values.memory_stats()
    assert stats.pool_bytes <= 1.25 * stats.blocks_in_use * stats.block_size * stats.bytes_per_token
    assert stats.peak_blocks_in_use == stats.blocks_in_use


@pytest.mark.parametrize("block_size", [1, 3, 16, 64])
def test_any_block_size(llama, batch, block_size):
    ref = llama.generate(**batch, max_new_tokens=10, do_sample=False)
    out = paged_generate(llama, batch, 10, cache_config={"block_size": block_size})
    assert torch.equal(ref, out.sequences)
    assert out.past_key_values.memory_stats().block_size == block_size


def test_sized_pool_is_reused_and_unsized_calls_are_not_limited(batch):
    model = make_model("llama_gqa")
    sized = {"num_blocks": 40, "block_size": 8}
    a = paged_generate(model, batch, 4, cache_config=sized).past_key_values
    pool, held = a.pool, a.memory_stats().blocks_in_use
    assert pool.blocks.num_used == held
    del a  # a dropped cache gives its blocks back to the shared pool
    assert pool.blocks.num_used == 0
    b = paged_generate(model, batch, 4, cache_config=sized).past_key_values
    assert b.pool is pool and b.memory_stats().num_blocks == 40
    # An unsized call needs more than 40 blocks of 8 and must not be held to the earlier cap.
    c = paged_generate(model, batch, 60).past_key_values
    assert c.pool is not b.pool and c.memory_stats().blocks_in_use > 40 // 2
    # max_kv_bytes is converted to whole blocks.
    per_block = b.memory_stats().bytes_per_token * 8
    d = paged_generate(model, batch, 4, cache_config={"max_kv_bytes": per_block * 50 + 7,
                                                      "block_size": 8}).past_key_values
    assert d.memory_stats().num_blocks == 50


def test_exhaustion_is_actionable_and_leaves_cache_consistent(batch):
    model = make_model("llama_gqa")
    small = {"num_blocks": 12, "block_size": 4}
    with pytest.raises(KVCacheExhaustedError) as err:
        paged_generate(model, batch, 30, cache_config=small)
    e = err.value
    assert e.needed > e.free and e.num_blocks == 12 and e.block_size == 4
    assert "num_blocks" in str(e) and str(e.needed) in str(e)
    # The pool is intact: a later call that fits runs and matches the reference.
    ids, mask = batch["input_ids"][:2, -9:], batch["attention_mask"][:2, -9:]
    ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    out = paged_generate(model, {"input_ids": ids, "attention_mask": mask}, 5, cache_config=small)
    assert torch.equal(ref, out.sequences)
    cache = out.past_key_values
    cache.reset()
    assert cache.memory_stats().blocks_in_use == 0
    assert cache.pool.blocks.num_free == 12


def test_a_first_forward_short_of_blocks_leaves_the_cache_uninitialized():
    """A prefill the pool cannot hold fixes no batch size: the cache takes another batch
    next, and a boolean row mask selects rows as DynamicCache's does."""
    model = make_model("llama_gqa")
    cache = PagedCache(model.config, {"num_blocks": 6, "block_size": 4})
    ids = torch.randint(3, 60, (3, 12), generator=torch.Generator().manual_seed(1))
    logits = []
    try:
        with torch.no_grad():
            model.set_attn_implementation("paged")
            with pytest.raises(KVCacheExhaustedError):
                model(input_ids=ids, past_key_values=cache)
            assert not cache.is_initialized and cache.get_seq_length() == 0
            for implementation, past in (("paged", cache), ("sdpa", DynamicCache())):
                model.set_attn_implementation(implementation)
                model(input_ids=ids[:2, :9], past_key_values=past)
                past.batch_select_indices(torch.tensor([False, True]))
                logits.append(model(input_ids=ids[1:2, 9:10], past_key_values=past).logits)
    finally:
        model.set_attn_implementation("sdpa")
    torch.testing.assert_close(logits[0], logits[1], atol=1e-5, rtol=1e-5)


def test_exhaustion_mid_decode_does_not_corrupt_other_rows():
    model = make_model("llama_gqa")
    ids, mask = left_padded_batch([5, 6], seed=3)
    cache = PagedCache(model.config, {"num_blocks": 4, "block_size": 4})
    with pytest.raises(KVCacheExhaustedError):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False,
                       past_key_values=cache)
    tables = [list(t) for t in cache.tables.tables]
    lengths = list(cache.tables.lengths)
    held = sorted(b for t in tables for b in t)
    assert len(held) == len(set(held)) == cache.pool.blocks.num_used
    assert all(len(t) == -(-n // 4) for t, n in zip(tables, lengths))


@pytest.mark.parametrize("bad, match", [
    ({"block_size": 0}, "block_size"),
    ({"block_size": -3}, "block_size"),
    ({"block_size": "16"}, "block_size"),
    ({"block_size": True}, "block_size"),
    ({"num_blocks": 0}, "num_blocks"),
    ({"max_kv_bytes": -1}, "max_kv_bytes"),
    ({"num_blocks": 8, "max_kv_bytes": 10**6}, "not both"),
    ({"backend": "cuda-magic"}, "backend"),
    ({"blocksize": 16}, "unknown setting"),
])
def test_invalid_settings_are_named(llama, batch, bad, match):
    with pytest.raises(ValueError, match=match) as err:
        paged_generate(llama, batch, 2, cache_config=bad)
    value = next(iter(bad.values()))
    assert repr(value) in str(err.value) or match in ("unknown setting",)


def test_max_kv_bytes_below_one_block(llama, batch):
    with pytest.raises(ValueError, match="max_kv_bytes"):
        paged_generate(llama, batch, 2, cache_config={"max_kv_bytes": 10})


def test_config_object_roundtrip():
    cfg = PagedCacheConfig.from_any({"block_size": 8, "num_blocks": 10})
    assert cfg.is_sized and PagedCacheConfig.from_any(cfg) is cfg
    assert not PagedCacheConfig.from_any(None).is_sized
    with pytest.raises(ValueError, match="dict"):
        PagedCacheConfig.from_any([("block_size", 8)])


@pytest.mark.parametrize("kind", ["llama_gqa", "mistral_sw"])
def test_direct_forward_matches_dynamic_cache(kind):
    """A PagedCache passed by hand to forward() (no generate) gives the same logits."""
    model = make_model(kind)
    ids, mask = left_padded_batch([4, 13, 20], seed=9)
    ref_cache, cache = DynamicCache(config=model.config), PagedCache(model.config, {"block_size": 4})
    ref_model = model
    model.set_attn_implementation("paged")
    try:
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            cache.expect_forward(mask)
            out = model(input_ids=ids, attention_mask=mask, position_ids=positions,
                        past_key_values=cache)
            model.set_attn_implementation("sdpa")
            ref = ref_model(input_ids=ids, attention_mask=mask, position_ids=positions,
                            past_key_values=ref_cache)
            valid = mask.bool()
            torch.testing.assert_close(out.logits[valid], ref.logits[valid], rtol=1e-4, atol=1e-4)
            step_ids = ref.logits[:, -1].argmax(-1, keepdim=True)
            for _ in range(3):
                mask = torch.cat([mask, torch.ones_like(step_ids)], 1)
                positions = positions[:, -1:] + 1
                model.set_attn_implementation("sdpa")
                ref = ref_model(input_ids=step_ids, attention_mask=mask, position_ids=positions,
                                past_key_values=ref_cache)
                model.set_attn_implementation("paged")
                out = model(input_ids=step_ids, attention_mask=mask, position_ids=positions,
                            past_key_values=cache)
                torch.testing.assert_close(out.logits, ref.logits, rtol=1e-4, atol=1e-4)
                step_ids = ref.logits[:, -1].argmax(-1, keepdim=True)
    finally:
        model.set_attn_implementation("sdpa")
    assert cache.get_seq_length() == ref_cache.get_seq_length()


@pytest.mark.parametrize("kind, kv_heads", [("falcon_mq", 1), ("falcon_new", 2), ("falcon_alibi", 4)])
def test_falcon_stores_unique_kv_heads_only(kind, kv_heads, batch):
    model = make_model(kind)
    cache = paged_generate(model, batch, 3).past_key_values
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    assert cache.pool.kv.shape[-2:] == (kv_heads, head_dim)
    assert cache.memory_stats().bytes_per_token == cfg.num_hidden_layers * 2 * kv_heads * head_dim * 4


def test_cache_started_in_inference_mode_continues_under_no_grad(llama):
    ids, mask = left_padded_batch([12, 20], seed=8)
    with torch.inference_mode():
        first = llama.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5,
                               do_sample=False, cache_implementation="paged",
                               return_dict_in_generate=True)
    seq = first.sequences
    ext = grown_mask(mask, seq.shape[1])
    ref = llama.generate(input_ids=seq, attention_mask=ext, max_new_tokens=4, do_sample=False)
    with torch.no_grad():
        out = llama.generate(input_ids=seq, attention_mask=ext, max_new_tokens=4,
                             do_sample=False, past_key_values=first.past_key_values)
    assert torch.equal(ref, out)


def test_one_column_prefill_chunks_skip_padding(model):
    ids, mask = left_padded_batch([2, 6], seed=1)
    for chunk in (1, 3):
        assert_same(*both(model, input_ids=ids, attention_mask=mask, max_new_tokens=6,
                          do_sample=False, prefill_chunk_size=chunk))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cache_made_by_hand_takes_dtype_from_the_model(dtype):
    model = make_model("llama_gqa").to(dtype)
    ids, mask = left_padded_batch([5, 9], seed=2)
    cache = PagedCache(model.config)
    assert cache.memory_stats().blocks_in_use == 0 and cache.batch_size == 0
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, past_key_values=cache)
    assert cache.pool.kv.dtype == dtype and cache.memory_stats().tokens_stored > 0


def test_forward_with_grad_enabled_works_and_backward_says_why():
    """A forward with grad on gives the stock logits; backward through it raises a named
    error instead of gradients that silently miss the key/value paths."""
    from hf_paged import BackwardNotSupportedError

    model = make_model("llama_gqa")
    ids, mask = left_padded_batch([4, 9], seed=1)
    ref = model(input_ids=ids, attention_mask=mask).logits
    cache = PagedCache(model.config)
    model.set_attn_implementation("paged")
    try:
        out = model(input_ids=ids, attention_mask=mask, past_key_values=cache)
        with pytest.raises(BackwardNotSupportedError, match="torch.no_grad"):
            out.logits[mask.bool()].sum().backward()
    finally:
        model.set_attn_implementation("sdpa")
    assert out.logits.requires_grad and not cache.pool.kv.requires_grad
    real = mask.bool()
    torch.testing.assert_close(out.logits[real], ref[real], rtol=1e-4, atol=1e-4)


def test_pool_dtype_other_than_the_model():
    """A cache made by hand with a lower-precision pool stores K/V in it; attention runs in
    the pool's dtype and returns the model's."""
    model = make_model("llama_gqa")
    ids, mask = left_padded_batch([4, 9], seed=1)
    cache = PagedCache(model.config, dtype=torch.bfloat16)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                         past_key_values=cache, return_dict_in_generate=True, output_logits=True)
    ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                         return_dict_in_generate=True, output_logits=True)
    assert cache.pool.kv.dtype == torch.bfloat16 and out.logits[0].dtype == torch.float32
    torch.testing.assert_close(out.logits[0], ref.logits[0], rtol=0.05, atol=0.05)


def test_crop_past_the_start_empties_like_dynamic_cache(llama):
    from transformers import DynamicCache

    ids, _ = left_padded_batch([6], seed=2)
    cache, ref = PagedCache(llama.config), DynamicCache()
    for c in (cache, ref):
        c.crop(-1)  # empty: nothing to do
        llama.generate(input_ids=ids, max_new_tokens=3, past_key_values=c, do_sample=False)
        c.crop(-100)
    assert cache.get_seq_length() == ref.get_seq_length() == 0
    assert cache.memory_stats().tokens_stored == 0


def test_unallocatable_pool_is_a_named_error(llama):
    from hf_paged import KVPoolAllocationError

    ids, _ = left_padded_batch([6], seed=2)
    with pytest.raises(KVPoolAllocationError, match="num_blocks"):
        llama.generate(input_ids=ids, max_new_tokens=2, cache_implementation="paged",
                       cache_config={"num_blocks": 10**12})
    out = llama.generate(input_ids=ids, max_new_tokens=2, cache_implementation="paged")
    assert out.shape == (1, 8)


def test_falcon_flash_attention_class_is_patched_too():
    from transformers.models.falcon.modeling_falcon import FalconFlashAttention2

    model = make_model("falcon_new")
    ids, mask = left_padded_batch([5, 12], seed=2)
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    for block in model.transformer.h:  # as if loaded with flash_attention_2
        block.self_attention.__class__ = FalconFlashAttention2
    out = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                         cache_implementation="paged")
    assert torch.equal(ref, out)


def test_step_failing_for_blocks_can_be_retried_as_announced(monkeypatch):
    """A forward that fails for lack of blocks leaves the cache as it was, the padding it was
    told about included: retrying the same forward gives the stock result."""
    from hf_paged import KVCacheExhaustedError
    from hf_paged.kv_pool import KVPool

    model = make_model("llama_gqa")
    ids, mask = left_padded_batch([4, 9], seed=1)
    ref = model(input_ids=ids, attention_mask=mask).logits
    cache = PagedCache(model.config)
    real_ensure_free = KVPool.ensure_free
    calls = []

    def fail_once(self, needed, limit=None, held=None):
        calls.append(needed)
        if len(calls) == 1:
            raise KVCacheExhaustedError(needed, 0, 0, cache.block_size)
        return real_ensure_free(self, needed, limit, held)

    monkeypatch.setattr(KVPool, "ensure_free", fail_once)
    model.set_attn_implementation("paged")
    try:
        with torch.no_grad():
            cache.expect_forward(mask)
            with pytest.raises(KVCacheExhaustedError):
                model(input_ids=ids, past_key_values=cache)
            assert cache.get_seq_length() == 0 and cache.memory_stats().tokens_stored == 0
            out = model(input_ids=ids, past_key_values=cache).logits  # no mask given again
    finally:
        model.set_attn_implementation("sdpa")
    real = mask.bool()
    torch.testing.assert_close(out[real], ref[real], rtol=1e-4, atol=1e-4)
    assert cache.memory_stats().tokens_stored == int(mask.sum())


@pytest.mark.parametrize("kind", ["llama_gqa", "mistral_sw"])
def test_crop_into_a_forward_with_inner_padding(kind):
    """Masked columns are hidden slots, so crop removes exactly the columns it is asked to,
    padded ones included; generation continues as on a cropped DynamicCache."""
    from conftest import PAD

    model = make_model(kind)
    ids, mask = left_padded_batch([5, 8], seed=2)
    caches = [DynamicCache(config=model.config), PagedCache(model.config)]
    firsts = []
    for cache in caches:
        cache.activate_past_recording()  # a sliding window would otherwise forbid the crop
        firsts.append(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3,
                                     do_sample=False, past_key_values=cache))
    assert_same(*firsts)
    ids2 = torch.cat([firsts[0], torch.full((2, 2), PAD), ids[:, -2:]], 1)
    mask2 = torch.cat([mask, torch.ones(2, 3, dtype=mask.dtype),
                       torch.zeros(2, 2, dtype=mask.dtype), torch.ones(2, 2, dtype=mask.dtype)], 1)
    for cache in caches:
        model.generate(input_ids=ids2, attention_mask=mask2, max_new_tokens=4,
                       past_key_values=cache)
        cache.crop(-7)  # into the padded turn: 3 generated, 2 real, then 2 padding columns
    assert caches[0].get_seq_length() == caches[1].get_seq_length() == ids2.shape[1] - 4
    keep = caches[0].get_seq_length()
    ids3 = torch.cat([ids2[:, :keep], torch.tensor([[50, 51], [52, 53]])], 1)
    mask3 = torch.cat([mask2[:, :keep], torch.ones(2, 2, dtype=mask.dtype)], 1)
    outs = [model.generate(input_ids=ids3, attention_mask=mask3, max_new_tokens=5,
                           do_sample=False, past_key_values=c) for c in caches]
    assert_same(*outs)


@pytest.mark.parametrize("value", ["numpy", "tensor"])
def test_integral_block_size_of_other_types(llama, batch, value):
    import numpy as np

    block_size = np.int64(8) if value == "numpy" else torch.tensor(8)
    ref = llama.generate(**batch, max_new_tokens=4, do_sample=False)
    out = paged_generate(llama, batch, 4, cache_config={"block_size": block_size,
                                                        "num_blocks": np.int32(200)})
    assert torch.equal(ref, out.sequences)
    stats = out.past_key_values.memory_stats()
    assert stats.block_size == 8 and stats.num_blocks == 200


def test_huge_block_size_is_bounded_by_the_call(llama):
    """A 14-token call with block_size=10**6 gets blocks no longer than it can use."""
    ids, mask = left_padded_batch([6, 9], seed=3)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    ref = llama.generate(**kwargs)
    out = llama.generate(**kwargs, cache_implementation="paged", return_dict_in_generate=True,
                         cache_config={"block_size": 10**6})
    assert torch.equal(ref, out.sequences)
    stats = out.past_key_values.memory_stats()
    assert stats.block_size == 16  # the call holds at most 13 tokens per row
    assert stats.pool_bytes <= 2 * 16 * stats.bytes_per_token


@pytest.mark.parametrize("bad", ["layer past the last", "negative layer", "values of other tokens",
                                 "values of other rows", "integer states", "three dims",
                                 "other heads"])
def test_bad_updates_by_hand_are_named_and_change_nothing(llama, bad):
    """`update` called by hand: a layer_idx past the model's raised IndexError, keys and
    values of different rows or tokens a RuntimeError from the write, and integer states
    were stored. A refused layer-0 update also left its slots taken, so a retry stored at
    twice the length."""
    cfg = llama.config
    heads, dim = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    k, v = torch.randn(1, heads, 3, dim), torch.randn(1, heads, 3, dim)
    call = {"layer past the last": lambda: (k, v, cfg.num_hidden_layers),
            "negative layer": lambda: (k, v, -1),
            "values of other tokens": lambda: (k, torch.randn(1, heads, 4, dim), 0),
            "values of other rows": lambda: (k, torch.randn(2, heads, 3, dim), 0),
            "integer states": lambda: (k.long(), v.long(), 0),
            "three dims": lambda: (k[0], v[0], 0),
            "other heads": lambda: (torch.randn(1, heads + 1, 3, dim),) * 2 + (0,)}[bad]
    cache = PagedCache(cfg, {"num_blocks": 8, "block_size": 4})
    with pytest.raises(hf_paged.HFPagedError, match="layer_idx|Layer 0 stores"):
        cache.update(*call())
    for layer in range(cfg.num_hidden_layers):  # the same cache then takes a good update
        k_cache, _ = cache.update(k, v, layer)
    assert cache.get_seq_length() == 3 and cache.memory_stats().tokens_stored == 3
    slots = cache.device_table.table[0, 0].item() * 4 + torch.arange(3)
    assert torch.equal(k_cache.reshape(-1, heads, dim)[slots], k[0].transpose(0, 1))


def test_a_cache_made_for_fewer_layers_is_named(llama, batch):
    """A cache of another config's layer count: a named error (it was an IndexError from the
    pool's views), as for other heads or head dims."""
    shallow = make_model("llama_gqa", num_hidden_layers=llama.config.num_hidden_layers - 1)
    with pytest.raises(hf_paged.HFPagedError, match="holds 1 layer: the cache was made for "
                                                    "another model config"):
        llama.generate(**batch, max_new_tokens=3, past_key_values=PagedCache(shallow.config))
