"""Packed prefill: run a left-padded prompt batch without computing its pad tokens.

Transformers' prefill runs the model on the padded [B, L] batch. With a paged cache,
each row's real tokens can instead go back to back in one [1, N] row (N = real tokens),
with per-row positions; the cache's metadata keeps the rows apart in attention. Logits
are taken at each row's last token, so generate sees the usual [B, 1, V].
"""

from __future__ import annotations

import torch

from .cache import PagedCache

# model_kwargs keys the packed forward knows how to honour; anything else takes the stock path.
_PACKABLE_KWARGS = {"attention_mask", "position_ids", "use_cache", "past_key_values",
                    "logits_to_keep", "cache_position"}


def can_pack(input_ids: torch.Tensor, generation_config, model_kwargs: dict) -> bool:
    cache = model_kwargs.get("past_key_values")
    mask = model_kwargs.get("attention_mask")
    return (
        isinstance(cache, PagedCache)
        and cache.get_seq_length() == 0
        and mask is not None
        and mask.dim() == 2
        and mask.shape == input_ids.shape
        and input_ids.shape[0] > 1
        and generation_config.prefill_chunk_size is None
        and not generation_config.output_attentions
        and not generation_config.output_hidden_states
        and model_kwargs.get("logits_to_keep", 1) == 1
        and set(model_kwargs) <= _PACKABLE_KWARGS
    )


def packed_prefill(model, input_ids: torch.Tensor, model_kwargs: dict):
    """The prefill forward on real tokens only; returns outputs with logits [B, 1, V].

    input_ids, attention_mask: [B, L], left-padded.
    """
    mask = model_kwargs["attention_mask"].bool()
    counts = mask.sum(1)
    counts_list = counts.tolist()
    if min(counts_list) == 0 or min(counts_list) == input_ids.shape[1]:
        return None  # an empty row, or no padding at all: nothing to gain
    cache: PagedCache = model_kwargs["past_key_values"]
    tokens = input_ids[mask].unsqueeze(0)  # [1, N], row-major
    positions = (mask.long().cumsum(1) - 1)[mask].unsqueeze(0)  # [1, N], 0.. per row
    last = counts.cumsum(0) - 1  # [B] index of each row's last token in the pack
    cache.expect_packed(counts_list, input_ids.shape[1])
    outputs = model(
        input_ids=tokens.to(model.device), position_ids=positions.to(model.device),
        past_key_values=cache, use_cache=True, logits_to_keep=last.to(model.device),
        return_dict=True,
    )
    outputs.logits = outputs.logits.transpose(0, 1)  # [1, B, V] -> [B, 1, V]
    return outputs
