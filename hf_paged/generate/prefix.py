"""Leading tokens given as keys and values rather than computed: PEFT prefix tuning's virtual
tokens, stored as the first tokens of a `PagedCache` in one packed write."""

from __future__ import annotations

import torch

from .plan import StepPlan


def load_prefix(cache, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
    """Stores leading tokens given directly as keys and values, before any forward:
    PEFT prefix tuning's virtual tokens. Rows with the same prefix share its blocks.

    keys, values: one [R, Hkv, V, D] tensor per layer. Raises ValueError if the shapes do
    not match this cache's layers, KV heads and head dim.
    """
    rows, heads, length, dim = keys[0].shape
    if cache._seen or len(keys) != cache.num_layers or len(values) != cache.num_layers or any(
            t.shape != (rows, cache.num_kv_heads, length, cache.head_dim) for t in keys + values):
        raise ValueError(
            f"a prefix needs {cache.num_layers} layers of [rows, {cache.num_kv_heads} KV heads, "
            f"tokens, {cache.head_dim}] on an empty cache; got {len(keys)} layers of "
            f"{tuple(keys[0].shape)} after {cache._seen} columns"
        )
    if cache.pool is None:
        cache._bind_pool(None, keys[0].dtype, keys[0].device)
    shared = all(torch.equal(t, t[:1].expand_as(t)) for t in keys + values)
    stored = 1 if shared else rows
    # One packed forward of the prefix tokens: [1, Hkv, stored * V, D], rows back to back.
    plan = StepPlan([length] * stored + [0] * (rows - stored), length, packed=True)
    cache.begin_forward(1, stored * length, plan=plan)
    try:
        for layer, (k, v) in enumerate(zip(keys, values)):
            device = cache.access.views(layer)[0].device  # a layer's own device (device_map)
            packed = [t[:stored].transpose(0, 1).reshape(1, heads, stored * length, dim)
                      .to(device) for t in (k, v)]
            cache.update(packed[0], packed[1], layer)
    finally:
        cache.end_forward()
    if shared and rows > 1:
        cache.reorder_cache(torch.zeros(rows, dtype=torch.long))  # every row shares row 0's

