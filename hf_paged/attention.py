"""The "paged" attention implementation and its mask function, as Transformers calls them."""

from __future__ import annotations

import torch
import torch.nn.functional as F

ATTENTION_NAME = "paged"


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
    model loaded with attn_implementation="paged" but run on another cache) it is plain
    SDPA over the given key/value.
    """
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    owner = getattr(key, "_hf_paged_cache", None)
    cache = owner() if owner is not None else None
    if cache is not None:
        return cache.attend(query, module.layer_idx, scale, sliding_window), None
    return _contiguous_attention(module, query, key, value, attention_mask, scale, dropout,
                                 sliding_window), None


def _contiguous_attention(module, query, key, value, padding_mask, scale, dropout, sliding_window):
    """SDPA over contiguous key/value [B, Hkv, kv, D], queries being the last q positions.

    padding_mask: [B, kv] bool (True = real token) or None.
    """
    q_len, kv_len = query.shape[2], key.shape[2]
    mask = None
    if padding_mask is not None or sliding_window is not None or q_len > 1:
        p = torch.arange(kv_len - q_len, kv_len, device=query.device).unsqueeze(1)  # [q, 1]
        t = torch.arange(kv_len, device=query.device)
        mask = t <= p
        if sliding_window is not None:
            mask = mask & (t > p - sliding_window)
        mask = mask[None, None]
        if padding_mask is not None:
            mask = mask & padding_mask[:, None, None, -kv_len:].bool()
            mask = mask | ~mask.any(-1, keepdim=True)  # fully padded query rows: keep finite
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=scale,
        dropout_p=dropout if module.training else 0.0,
        enable_gqa=query.shape[1] != key.shape[1],
    )
    return out.transpose(1, 2)


def paged_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor | None:
    """Mask interface: passes the 2D padding mask [B, kv] through (no 4D mask is built).

    The paged path takes lengths from the cache; the contiguous fallback builds its own mask.
    """
    if attention_mask is None:
        return None
    return attention_mask[:, -kv_length:]
