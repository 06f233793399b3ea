"""The one route from a forward to the paged attention (ARCHITECTURE.md): the forward's
PagedForward arrives as the `paged_kv` argument, whoever calls the model, and nothing else
carries it."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from conftest import MODEL_KINDS, left_padded_batch, make_model
from hf_paged import HFPagedError, PagedCache
from hf_paged.hf.attention import paged_attention_forward
from hf_paged.hf.switch import paged_attention


def _decoder(model):
    return model.transformer if hasattr(model, "transformer") else model.model


@pytest.mark.parametrize("kind", MODEL_KINDS)
def test_the_decoder_stack_called_directly_matches_dynamic_cache(kind):
    """`model.model(...)` (below the head, as an accelerate hook captured before import
    would call it) plans its own forward: two padded turns equal a DynamicCache's."""
    model = make_model(kind)
    ids, mask = left_padded_batch([3, 9, 6], seed=2)
    more = torch.randint(3, 50, (3, 2), generator=torch.Generator().manual_seed(1))
    wide = torch.cat([mask, torch.ones(3, 2, dtype=mask.dtype)], 1)
    with torch.no_grad():
        ref_cache = DynamicCache(config=model.config)
        ref = [_decoder(model)(input_ids=ids, attention_mask=mask, past_key_values=ref_cache),
               _decoder(model)(input_ids=more, attention_mask=wide, past_key_values=ref_cache)]
        cache = PagedCache(model.config)
        with paged_attention(model):
            out = [_decoder(model)(input_ids=ids, attention_mask=mask, past_key_values=cache),
                   _decoder(model)(input_ids=more, attention_mask=wide, past_key_values=cache)]
    real = mask.bool()
    torch.testing.assert_close(out[0].last_hidden_state[real], ref[0].last_hidden_state[real],
                               rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out[1].last_hidden_state, ref[1].last_hidden_state,
                               rtol=1e-4, atol=1e-4)
    assert cache.memory_stats().tokens_stored == int(wide.sum())


def test_pool_keys_without_the_forward_are_an_error():
    """Pool views reaching the attention without `paged_kv` raise by name; they never fall
    through to SDPA."""
    model = make_model("llama_gqa")
    cache = PagedCache(model.config)
    ids, mask = left_padded_batch([4, 6], seed=3)
    with torch.no_grad(), paged_attention(model):
        model(input_ids=ids, attention_mask=mask, past_key_values=cache)
    k_cache, v_cache = cache.access.views(0)
    attention = model.model.layers[0].self_attn
    query = torch.randn(2, model.config.num_attention_heads, 1, k_cache.shape[-1])
    with pytest.raises(HFPagedError, match="paged_kv"):
        paged_attention_forward(attention, query, k_cache, v_cache, None)


def test_an_unprepared_forward_raises_before_storing_anything():
    """Transformers asks a cache for its mask sizes at the start of a model forward: on a
    PagedCache no hf-paged wrapper prepared, that is a named error, with nothing stored."""
    model = make_model("llama_gqa")
    cache = PagedCache(model.config)
    with pytest.raises(HFPagedError, match="without hf-paged preparing it"):
        cache.get_mask_sizes(3)
    assert cache.get_seq_length() == 0 and cache.pool is None
