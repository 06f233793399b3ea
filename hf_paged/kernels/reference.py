"""Pure-PyTorch paged KV operations: the reference every other backend is compared with.

Shapes (R = batch rows, q = padded query length, Hq/Hkv = query/KV heads, D = head dim,
NB = pool blocks, bs = block size, nb = block-table columns in use, T = nb * bs):
  k_cache, v_cache:  [NB, bs, Hkv, D]  one layer's pool (values may have their own size Dv)
  block_tables:      [R, nb] int64     physical block of each logical block
  slot_mapping:      [N] int64         flat slot (block * bs + offset) of each new token
An 8-bit pool's views are [NB, bs, Hkv, D + 2] of its kind (kv/quant.py): writes quantize,
reads dequantize to the query's dtype after the gather.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kv.pool import split_layer
from ..kv.quant import dequantize, is_quantized, quantize
from .library import define


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Stores new tokens: key/value [N, Hkv, D] go to flat slots `slot_mapping` [N]."""
    for cache, new in ((k_cache, key), (v_cache, value)):
        if is_quantized(cache):
            cache, new = cache.view(torch.uint8), quantize(new, cache.dtype)
        nb, bs, h, d = cache.shape
        if cache.is_contiguous():
            cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, new)
        else:  # a view of a fused K|V tensor (keys and values of different sizes)
            cache.index_put_((slot_mapping // bs, slot_mapping % bs), new)


def _no_outputs(*args) -> None:
    return None


@define("write_layer_kv", "(Tensor(a!) kv, int index, Tensor key, Tensor value, "
        "Tensor slot_mapping, int split, ScalarType? kv_dtype) -> ()", _no_outputs)
def write_layer_kv(kv: torch.Tensor, index: int, key: torch.Tensor, value: torch.Tensor,
                   slot_mapping: torch.Tensor, split: int,
                   kv_dtype: torch.dtype | None) -> None:
    """`write_kv` into layer `index` of a pool shard kv [L, 2, NB, bs, Hkv, D] (`split`,
    `kv_dtype`: as `kv.pool.split_layer`), as one op that mutates the shard itself. A
    compiled forward writes through it: an in-place write into a view of the pool (or into
    views that alias one another, one per layer) is functionalized into a copy of the
    layer's whole pool every step, where this op is kept in place."""
    k_cache, v_cache = split_layer(kv[index], split, kv_dtype)
    write_kv(k_cache, v_cache, key, value, slot_mapping)


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
    num_blocks, bs, h, d = cache.shape
    index = block_tables.reshape(-1)
    if num_blocks == 0:  # a pool still empty (a batch of padding only): every column masked
        return cache.new_zeros(rows, nb * bs, h, d).transpose(1, 2)
    if out is None:
        gathered = cache.index_select(0, index)  # several times faster than cache[index]
    else:
        gathered = torch.index_select(cache, 0, index, out=out[: rows * nb])
    return gathered.view(rows, nb * bs, h, d).transpose(1, 2)


def _gathered_like(kv: torch.Tensor, index: int, block_tables: torch.Tensor, split: int):
    rows, nb = block_tables.shape
    _, _, _, bs, h, d = kv.shape
    return (kv.new_empty(rows, nb * bs, h, split).transpose(1, 2),  # (gather_kv's strides)
            kv.new_empty(rows, nb * bs, h, d - split).transpose(1, 2))


@define("gather_layer_kv", "(Tensor kv, int index, Tensor block_tables, int split) -> "
        "(Tensor, Tensor)", _gathered_like)
def gather_layer_kv(kv: torch.Tensor, index: int, block_tables: torch.Tensor,
                    split: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`gather_kv` of both parts of fused layer `index` of a pool shard kv [L, 1, NB, bs,
    Hkv, Dk + Dv] (values from `split` on) -> [R, Hkv, T, Dk], [R, Hkv, T, Dv], as one op
    that reads the shard itself. A compiled forward gathers a latent layer's rows through
    it: Inductor, gathering them through views of the shard that `write_layer_kv` had just
    written, read part of the values as they were before the write (DeepSeek-V3's logits
    then differed from eager by 1e-2)."""
    k_cache, v_cache = split_layer(kv[index], split)
    return gather_kv(k_cache, block_tables), gather_kv(v_cache, block_tables)


def alibi_bias(slopes: torch.Tensor, positions: torch.Tensor, scale: float) -> torch.Tensor:
    """Falcon's ALiBi term of the scores, as Transformers computes it: slope x key position
    in bfloat16 (`build_alibi_tensor` rounds the slope, the position and the product to
    bfloat16; from 256 tokens on, or with slopes that are not powers of two, that is not
    slope * t), then divided by sqrt(head_dim) like the scores, i.e. times `scale`.
    Broadcasts `slopes` against `positions`; the result has the slopes' dtype."""
    term = slopes.to(torch.bfloat16) * positions.to(torch.bfloat16)
    return term.to(slopes.dtype) * scale


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


def eager_fallback(mask: torch.Tensor, context_lens: torch.Tensor, seq_lens: torch.Tensor,
                   sliding_window: int | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """What Transformers' eager attention gives a query that sees no key (a hidden column
    past a sliding window): an average of the values its cache hands the layer, weighed
    by `_eager_weights` (in float32 and bfloat16 a plain one). Those are the row's slots
    up to `seq_lens` (a sliding layer's cache keeps the W - 1 before this forward).

    mask [R, 1, q, T] bool, context_lens / seq_lens [R] -> (the mask with those slots
    visible to such queries, [R, 1, q, 1] True on them: `attend`'s `uniform`), or None
    when every query sees a key. (One host read: this runs only on masks with hidden
    slots or a caller's mask, where a query can see nothing.)"""
    empty = ~mask.any(-1, keepdim=True)
    if not bool(empty.any()):
        return None
    t = torch.arange(mask.shape[-1], device=mask.device)
    first = torch.zeros_like(context_lens) if sliding_window is None else (
        context_lens - (sliding_window - 1)).clamp(min=0)
    kept = (t >= first[:, None]) & (t < seq_lens[:, None])  # [R, T]
    return mask | (empty & kept[:, None, None, :]), empty


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    uniform: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of new queries over their sequences' cached tokens.

    query [R, Hq, q, D], mask [R, 1, q, T] bool or [R, Hq, q, T] float bias (see `key_mask`)
    -> out [R, q, Hq, Dv]. Covers decode (q = 1), prefill and extend (q > 1) alike.
    mask None: query column j is position j of its row and sees keys 0..j (see `attend`).
    workspace: optional buffers [>= R * nb, bs, Hkv, D] for the gathered K and V.
    softcap, sinks, uniform: see `attend`.
    """
    k = gather_kv(as_stored(k_cache), block_tables, None if workspace is None else workspace[0])
    v = gather_kv(as_stored(v_cache), block_tables, None if workspace is None else workspace[1])
    if is_quantized(k_cache):
        k, v = (dequantize(k, k_cache.dtype, query.dtype),
                dequantize(v, v_cache.dtype, query.dtype))
    return attend(query, k, v, mask, scale, softcap, sinks, uniform)


def as_stored(cache: torch.Tensor) -> torch.Tensor:
    """A layer's view as its storage holds it: an 8-bit pool's bytes (gathers and copies
    work on those), any other unchanged."""
    return cache.view(torch.uint8) if is_quantized(cache) else cache


def value_dim(v_cache: torch.Tensor) -> int:
    """The size of a value head in a layer's V view (an 8-bit one ends with its scale)."""
    return v_cache.shape[-1] - (2 if is_quantized(v_cache) else 0)


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    uniform: torch.Tensor | None = None,
) -> torch.Tensor:
    """Masked attention over gathered keys: query [R, Hq, q, D], key [R, Hkv, T, D], value
    [R, Hkv, T, Dv], mask as in `paged_attention` -> out [R, q, Hq, Dv].
    mask None: causal from the first key (query j sees keys 0..j, T >= q), which SDPA's
    kernels compute without the scores above the diagonal (neither softcap nor sinks).

    softcap c: scores become c * tanh(scores / c) before masking (Gemma 2).
    sinks [Hq]: a per-head logit that joins each softmax's denominator and adds no value
    (gpt-oss's attention sinks).
    uniform [R, 1, q, 1] bool: queries that weigh the keys their mask shows as eager
    attention weighs a query's keys when it may see none (`eager_fallback`). Any other
    query that a bool mask lets see no key gives zeros, as SDPA gives.
    """
    if softcap is None and sinks is None and uniform is None:
        # Traced head counts are symbolic; GQA's broadcast is exact for equal counts too.
        gqa = True if torch.compiler.is_compiling() else query.shape[1] != key.shape[1]
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale,
                                             is_causal=mask is None, enable_gqa=gqa)
        return out.transpose(1, 2)
    if mask is None:
        raise ValueError("Causal attention without a mask takes neither softcap nor sinks.")
    group = query.shape[1] // key.shape[1]
    if group > 1:
        key = key.repeat_interleave(group, dim=1)
        value = value.repeat_interleave(group, dim=1)
    raw = torch.matmul(query, key.transpose(-1, -2))
    scores = raw.float() * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask.dtype == torch.bool:
        # The most negative finite score, not -inf: no NaN from a row of -inf.
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    else:
        scores = scores + mask
    if sinks is not None:
        sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]
    else:
        probs = torch.softmax(scores, -1)
    if mask.dtype == torch.bool:  # a query that sees no key reads no slot: SDPA's zeros,
        seen = mask.any(-1, keepdim=True)  # not an average of whatever the slots hold
        probs = probs.masked_fill(~seen, 0.0)
        if uniform is not None:
            probs = torch.where(uniform, _eager_weights(raw, scale, softcap, mask), probs)
    return torch.matmul(probs.to(value.dtype), value).transpose(1, 2)


def _eager_weights(raw: torch.Tensor, scale: float, softcap: float | None,
                   shown: torch.Tensor) -> torch.Tensor:
    """Eager attention's weights for queries that see no key, over the keys `shown`: their
    scores in the model's dtype plus its minimum, as eager adds its mask. In float32 and
    bfloat16 every sum rounds to the minimum (equal weights); float16's keeps a score above
    16 and overflows one below -16. raw: q.k [R, Hq, q, T] in the model's dtype."""
    scores = raw * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = (scores + torch.finfo(scores.dtype).min).masked_fill(~shown, float("-inf"))
    return torch.softmax(scores.float(), -1)
