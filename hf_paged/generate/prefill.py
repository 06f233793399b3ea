"""Prefill on the paged cache: each distinct prompt once, and without its pad tokens.

Transformers' prefill runs the model on the padded [B*E, L] batch, E being the
expansion of beam search / num_return_sequences (its rows repeat each prompt E times).
With a paged cache we instead

- run only the B distinct prompts and then fork each row E times: the E copies share
  the prompt's blocks (refcounted, copy-on-write), and E-1 prefills are skipped;
- pack a left-padded batch: the real tokens of all rows go back to back in one [1, N]
  row with per-row positions, the cache's metadata keeping rows apart in attention.
  A mask with zeros after real tokens is not packed: those columns become hidden slots.

Logits are taken at each row's last token, so generate sees the usual [B*E, 1, V].
"""

from __future__ import annotations

import torch

from .cache import PagedCache
from .plan import PLAN_KWARG, StepPlan, inner_padding
from ..distributed.placement import input_device, logits_index_device

# model_kwargs keys these forwards know how to honour; anything else takes the stock path.
_HANDLED_KWARGS = {"attention_mask", "position_ids", "use_cache", "past_key_values",
                   "logits_to_keep", "cache_position"}


def expansion(generation_config, rows: int) -> int:
    """How many consecutive rows of the batch repeat each prompt."""
    e = max(generation_config.num_beams or 1, generation_config.num_return_sequences or 1)
    return e if e > 1 and rows % e == 0 else 1


def applies(input_ids: torch.Tensor, generation_config, model_kwargs: dict) -> bool:
    """True when this module's prefill can stand in for generate's."""
    cache = model_kwargs.get("past_key_values")
    mask = model_kwargs.get("attention_mask")
    return (
        isinstance(cache, PagedCache)
        and cache.get_seq_length() == 0
        and input_ids.dim() == 2
        and (mask is None or (mask.dim() == 2 and mask.shape == input_ids.shape))
        and generation_config.prefill_chunk_size is None
        and not generation_config.output_attentions
        and not generation_config.output_hidden_states
        and model_kwargs.get("logits_to_keep", 1) == 1
        and set(model_kwargs) <= _HANDLED_KWARGS
    )


def paged_prefill(model, input_ids: torch.Tensor, generation_config, model_kwargs: dict):
    """The prefill forward; returns None where generate's own prefill is just as good.

    input_ids, attention_mask: [B*E, L], left-padded -> outputs with logits [B*E, 1, V].
    """
    e = expansion(generation_config, input_ids.shape[0])
    ids = input_ids[::e]
    mask = model_kwargs.get("attention_mask")
    counts = counts_list = None
    if mask is not None:
        mask = mask[::e].bool()
        counts = mask.sum(1)
        values = torch.cat([counts, inner_padding(mask).view(1)]).tolist()
        counts_list = values[:-1]
        if values[-1]:
            # Zeros after real tokens: generate's own prefill stores them as hidden slots,
            # and a row ending in padding takes its logits there, as Transformers does.
            return None
    padded = counts_list is not None and min(counts_list) < ids.shape[1]
    if padded and min(counts_list) == 0:
        return None  # an all-padding row has no last token to take logits from
    if not padded and e == 1:
        return None
    cache: PagedCache = model_kwargs["past_key_values"]
    device = input_device(model)
    user_positions = model_kwargs.get("position_ids")
    user_positions = user_positions[::e] if user_positions is not None else None
    if padded:
        tokens = ids[mask].unsqueeze(0)  # [1, N], row-major
        if user_positions is not None:  # [B, L] (or [1, L] shared by all rows)
            positions = user_positions.expand(ids.shape[0], -1)[mask.to(user_positions.device)]
            positions = positions.unsqueeze(0)
        else:
            positions = (mask.long().cumsum(1) - 1)[mask].unsqueeze(0)  # [1, N], 0.. per row
        last = counts.cumsum(0) - 1  # [B] index of each row's last token in the pack
        plan = StepPlan(counts_list, ids.shape[1], packed=True)
        outputs = model(input_ids=tokens.to(device), position_ids=positions.to(device),
                        past_key_values=cache, use_cache=True,
                        logits_to_keep=last.to(logits_index_device(model)),
                        return_dict=True, **{PLAN_KWARG: plan})
        outputs.logits = outputs.logits.transpose(0, 1)  # [1, B, V] -> [B, 1, V]
    else:
        outputs = model(input_ids=ids, position_ids=user_positions, past_key_values=cache,
                        use_cache=True, logits_to_keep=1, return_dict=True)
    if e > 1:
        cache.batch_repeat_interleave(e)  # rows share the prompt blocks
        outputs.logits = outputs.logits.repeat_interleave(e, dim=0)
    return outputs
