"""Pure-PyTorch paged KV operations: the reference every other backend is compared with.

Shapes (R = batch rows, q = padded query length, Hq/Hkv = query/KV heads, D = head dim,
NB = pool blocks, bs = block size, nb = block-table columns in use, T = nb * bs):
  k_cache, v_cache:  [NB, bs, Hkv, D]  one layer's pool
  block_tables:      [R, nb] int64     physical block of each logical block
  slot_mapping:      [N] int64         flat slot (block * bs + offset) of each new token
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Stores new tokens: key/value [N, Hkv, D] go to flat slots `slot_mapping` [N]."""
    nb, bs, h, d = k_cache.shape
    k_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, key)
    v_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, value)


def copy_blocks(kv: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy-on-write: block src[i] -> dst[i] in every layer, K and V, in one batched copy.

    kv: [L, 2, NB, bs, Hkv, D]; src, dst: [n] int64.
    """
    kv[:, :, dst] = kv[:, :, src]


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """Contiguous copy of each row's blocks: [NB, bs, Hkv, D] -> [R, Hkv, T, D].

    out: optional buffer [>= R * nb, bs, Hkv, D] to gather into. Reusing one across layers
    and steps avoids fresh allocations, whose page faults cost more than the copy on CPU.
    """
    rows, nb = block_tables.shape
    _, bs, h, d = cache.shape
    index = block_tables.reshape(-1)
    if out is None:
        gathered = cache.index_select(0, index)  # several times faster than cache[index]
    else:
        gathered = torch.index_select(cache, 0, index, out=out[: rows * nb])
    return gathered.view(rows, nb * bs, h, d).transpose(1, 2)


def key_mask(
    query_pos: torch.Tensor, is_query: torch.Tensor | None, num_keys: int,
    sliding_window: int | None, key_hidden: torch.Tensor | None = None,
) -> torch.Tensor:
    """Which keys each query sees: [R, q] positions -> [R, 1, q, T] bool.

    Key t is visible to a query at position p when t <= p and, with a sliding window W,
    t > p - W (Transformers' convention), unless `key_hidden` [R, T] marks it. Rows of
    `is_query` that are False are padding: they see key 0 only, so their (discarded)
    output stays finite.
    """
    t = torch.arange(num_keys, device=query_pos.device)
    p = query_pos.unsqueeze(-1)
    mask = t <= p
    if sliding_window is not None:
        mask &= t > p - sliding_window
    if key_hidden is not None:
        mask &= ~key_hidden.unsqueeze(1)
    if is_query is not None:
        mask |= (~is_query).unsqueeze(-1) & (t == 0)
    return mask.unsqueeze(1)


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    workspace: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of new queries over their sequences' cached tokens.

    query [R, Hq, q, D], mask [R, 1, q, T] bool or [R, Hq, q, T] float bias (see `key_mask`)
    -> out [R, q, Hq, D]. Covers decode (q = 1), prefill and extend (q > 1) alike.
    workspace: optional [2, >= R * nb, bs, Hkv, D] buffer for the gathered K and V.
    """
    k = gather_kv(k_cache, block_tables, None if workspace is None else workspace[0])
    v = gather_kv(v_cache, block_tables, None if workspace is None else workspace[1])
    out = F.scaled_dot_product_attention(
        query, k, v, attn_mask=mask, scale=scale, enable_gqa=query.shape[1] != k.shape[1]
    )
    return out.transpose(1, 2)
