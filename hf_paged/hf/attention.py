"""The "paged" attention implementation and its mask function, as Transformers calls them.

Transformers builds a forward's mask once, asking the cache for its sizes right before
calling the mask function: `PagedCache.get_mask_sizes` announces itself (`announce`), and
`paged_mask` claims the announcement. A forward on a PagedCache needs no mask (the cache's
metadata has the lengths; the 2D padding mask, or its absence, is handed to the cache);
any other forward gets Transformers' own SDPA mask and attention, unchanged. A 4D mask
prepared by the caller skips mask creation and reaches the attention, which honours it.
"""

from __future__ import annotations

import contextvars
import weakref

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

ATTENTION_NAME = "paged"

_announced = contextvars.ContextVar("hf_paged_announced", default=None)


def announce(cache, kv_length: int) -> None:
    """Called by PagedCache.get_mask_sizes: the mask of kv_length keys built next is for `cache`."""
    _announced.set((weakref.ref(cache), kv_length))


def claim(kv_length: int | None = None):
    """The PagedCache announced for the mask being built (of `kv_length` keys, when given),
    or None; clears the announcement either way, so a stale one cannot misroute a later mask."""
    announced = _announced.get()
    if announced is None:
        return None
    _announced.set(None)
    ref, length = announced
    return ref() if kv_length is None or kv_length == length else None


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Transformers attention interface: query [B, Hq, q, D] -> (out [B, q, Hq, D], None).

    With a `PagedCache`, `key`/`value` are the layer's pool views and the cache's
    per-forward metadata says where each row's tokens are. Without one (training, or a
    model loaded with attn_implementation="paged" but run on another cache) it is
    Transformers' SDPA attention with the SDPA mask `paged_mask` built.
    """
    owner = getattr(key, "_hf_paged_cache", None)
    cache = owner() if owner is not None else None
    if cache is not None:
        # A mask reaching here was prepared by the caller (4D): paged_mask gives None.
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return cache.attend(query, module.layer_idx, scale, sliding_window,
                            caller_mask=attention_mask), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                  scaling=scaling, sliding_window=sliding_window, **kwargs)


def paged_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor | None:
    """Mask interface: None for a forward on a PagedCache (which takes over a 2D padding mask
    [B, seen + q] it was not given yet), Transformers' SDPA mask for any other forward."""
    cache = claim(kv_length)
    if cache is not None:
        cache.adopt_mask(attention_mask if attention_mask is not None
                         and attention_mask.dim() == 2 else None)
        return None
    return sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset,
                     attention_mask=attention_mask, **kwargs)
