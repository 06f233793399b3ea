"""Triton paged attention: decode (split-KV with a log-sum-exp merge) and prefill/extend.

Both read the pool layout of `reference.py`: one layer's K and V as [NB, bs, Hkv, D],
block tables [R, nb] int32, and follow its masking rules (causal on sequence positions,
Transformers' sliding window `key > query - W`, optional ALiBi `slope * key position`,
optional soft-capping `c * tanh(score / c)` and per-head sink logits in the softmax
denominator).

An 8-bit pool (kv/quant.py) is read as bytes: each tile's values are converted from their
kind (`QUANT`: 1 int8, 2 fp8 e4m3, 3 fp8 e5m2) and multiplied by the bfloat16 scale stored
after each head's D values, then attended in the query's dtype.

On a machine without a GPU these kernels run under `TRITON_INTERPRET=1` (set before this
module is imported); the interpreter gets bf16 `tl.dot` wrong, so tiles are then cast to
float32 first (`CAST_FP32`).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from ..kv.quant import CODES

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


def _p2(n: int, floor: int = 16) -> int:
    """Tile extent for `n` (a power of two, at least `floor`, what tl.dot needs on GPUs)."""
    return max(floor, triton.next_power_of_2(n))


@triton.jit
def _dot(a, b, FP32: tl.constexpr):
    """a @ b accumulated in float32; float32 inputs stay exact (no TF32)."""
    if FP32:
        return tl.dot(a, b, input_precision="ieee", out_dtype=tl.float32)
    return tl.dot(a, b, out_dtype=tl.float32)


@triton.jit
def _load_tile(K, V, TABLE_ROW, stride_kb, stride_kt, head_offset, pos, limit, d, dmask,
               BS: tl.constexpr, CAST_FP32: tl.constexpr, QUANT: tl.constexpr,
               D: tl.constexpr):
    """K and V tiles [TILE, D_P] of one KV head at sequence positions `pos` [TILE] of a row.

    Each position finds its block in the row's table, so a tile may span several blocks
    (or part of one): the tile size is a speed knob independent of the block size.
    Positions >= limit read as zeros. QUANT > 0: K and V are bytes, dequantized here
    (float32 tiles).
    """
    pmask = pos < limit
    block = tl.load(TABLE_ROW + pos // BS, mask=pmask, other=0).to(tl.int64)
    base = block * stride_kb + (pos % BS) * stride_kt + head_offset  # [TILE]
    offs = base[:, None] + d[None, :]
    kv_mask = pmask[:, None] & dmask[None, :]
    if QUANT == 0:
        k = tl.load(K + offs, mask=kv_mask, other=0.0)
        v = tl.load(V + offs, mask=kv_mask, other=0.0)
        if CAST_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
    else:
        k = _dequant(tl.load(K + offs, mask=kv_mask, other=0), QUANT) * \
            _scale(K, base + D, pmask)[:, None]
        v = _dequant(tl.load(V + offs, mask=kv_mask, other=0), QUANT) * \
            _scale(V, base + D, pmask)[:, None]
    return k, v


@triton.jit
def _dequant(x, QUANT: tl.constexpr):
    """Bytes of an 8-bit kind -> float32."""
    if QUANT == 1:
        return x.to(tl.int8, bitcast=True).to(tl.float32)
    elif QUANT == 2:
        return x.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        return x.to(tl.float8e5, bitcast=True).to(tl.float32)


@triton.jit
def _scale(X, at, mask):
    """The bfloat16 scales stored (little-endian) at byte offsets `at` -> float32."""
    lo = tl.load(X + at, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(X + at + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.bfloat16, bitcast=True).to(tl.float32)


@triton.jit
def _tanh(x):
    return 2.0 / (1.0 + tl.exp(-2.0 * x)) - 1.0  # saturates to +-1 without overflow


@triton.jit
def _round_bf16(x):
    """float32 x rounded to the nearest bfloat16 (ties to even), kept in float32; by bits,
    since Triton's interpreter truncates in `.to(tl.bfloat16)` (finite x only)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _attend_tile(q, K, V, TABLE_ROW, stride_kb, stride_kt, head_offset, pos, limit, valid,
                 slopes, scale, softcap, m_i, l_i, acc, d, dmask, BS: tl.constexpr,
                 HAS_ALIBI: tl.constexpr, HAS_SOFTCAP: tl.constexpr, CAST_FP32: tl.constexpr,
                 QUANT: tl.constexpr, D: tl.constexpr):
    """Scores of queries q [M, D_P] against positions `pos` [TILE] (soft-capped by `softcap`;
    ALiBi: + reference.alibi_bias(slopes, pos, scale), slopes broadcastable to [M, 1]),
    masked by `valid`
    ([M or 1, TILE]), folded into the running softmax (m_i, l_i, acc)."""
    k, v = _load_tile(K, V, TABLE_ROW, stride_kb, stride_kt, head_offset, pos, limit, d, dmask,
                      BS, CAST_FP32, QUANT, D)
    if QUANT != 0:  # dequantized in float32: attended in the queries' dtype
        k = k.to(q.dtype)
        v = v.to(q.dtype)
    s = _dot(q, tl.trans(k), CAST_FP32) * scale
    if HAS_SOFTCAP:
        s = softcap * _tanh(s / softcap)
    if HAS_ALIBI:
        # slope, position and product in bfloat16, as Transformers' Falcon (alibi_bias)
        t = _round_bf16(pos[None, :].to(tl.float32))
        s += _round_bf16(_round_bf16(slopes) * t) * scale
    s = tl.where(valid, s, float("-inf"))
    return _online_softmax_step(s, m_i, l_i, acc, v, CAST_FP32)


@triton.jit
def _online_softmax_step(s, m_i, l_i, acc, v, FP32: tl.constexpr):
    """One tile of the streaming softmax: s [M, N] scores (-inf = masked), v [N, D]."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all masked so far: no NaN
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, FP32)
    return m_new, l_i, acc


@triton.jit
def _decode_kernel(
    Q, K, V, BT, SEQ, SLOPES, SINKS, O_PART, LSE_PART,
    stride_qr, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_btr,
    stride_or, stride_oh, stride_os,
    stride_lr, stride_lh,
    scale, softcap, window, tokens_per_split,
    GROUP: tl.constexpr, GROUP_P: tl.constexpr, BS: tl.constexpr, TILE: tl.constexpr,
    D: tl.constexpr, D_P: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr, CAST_FP32: tl.constexpr, STORE_LSE: tl.constexpr,
    QUANT: tl.constexpr,
):
    """Program (row, KV head, split): all GROUP query heads of the KV head at once, so each
    key and value is read once; the split covers `tokens_per_split` visible positions of the
    row, TILE at a time. Sink logits enter split 0's softmax (the merge then carries them)."""
    r = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SEQ + r).to(tl.int32)
    q_pos = seq_len - 1
    g = tl.arange(0, GROUP_P)
    d = tl.arange(0, D_P)
    t = tl.arange(0, TILE)
    heads = kvh * GROUP + g
    gmask = g < GROUP
    dmask = d < D
    q = tl.load(Q + r * stride_qr + heads[:, None] * stride_qh + d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0)
    if CAST_FP32:
        q = q.to(tl.float32)
    first = tl.where(window > 0, tl.maximum(q_pos - window + 1, 0), 0)  # oldest visible
    start = first + split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)
    slopes = 0.0
    if HAS_ALIBI:
        slopes = tl.load(SLOPES + heads, mask=gmask, other=0.0).to(tl.float32)[:, None]
    m_i = tl.full([GROUP_P], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_P], tl.float32)
    if HAS_SINKS:  # a sink is a score exp(sink) with no value: start the softmax from it
        sink = tl.load(SINKS + heads, mask=gmask, other=0.0).to(tl.float32)
        m_i = tl.where(split == 0, sink, m_i)
        l_i = tl.where(split == 0, 1.0, l_i)
    acc = tl.zeros([GROUP_P, D_P], tl.float32)
    for t0 in range(start, end, TILE):
        pos = t0 + t
        m_i, l_i, acc = _attend_tile(q, K, V, BT + r * stride_btr, stride_kb, stride_kt,
                                     kvh * stride_kh, pos, end, (pos < end)[None, :], slopes,
                                     scale, softcap, m_i, l_i, acc, d, dmask, BS, HAS_ALIBI,
                                     HAS_SOFTCAP, CAST_FP32, QUANT, D)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    lse = tl.where(l_i > 0, m_i + tl.log(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
    o_ptr = O_PART + r * stride_or + heads[:, None] * stride_oh + split * stride_os + d[None, :]
    tl.store(o_ptr, out.to(O_PART.dtype.element_ty), mask=gmask[:, None] & dmask[None, :])
    if STORE_LSE:
        tl.store(LSE_PART + r * stride_lr + heads * stride_lh + split, lse, mask=gmask)


@triton.jit
def _merge_splits_kernel(
    O_PART, LSE_PART, OUT,
    stride_or, stride_oh, stride_os,
    stride_lr, stride_lh,
    stride_outr, stride_outh,
    SPLITS: tl.constexpr, SPLITS_P: tl.constexpr, D: tl.constexpr, D_P: tl.constexpr,
):
    """Program (row, head): out = sum_s exp(lse_s - lse) * out_s over the splits."""
    r = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS_P)
    d = tl.arange(0, D_P)
    smask = s < SPLITS
    lse = tl.load(LSE_PART + r * stride_lr + h * stride_lh + s, mask=smask, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.where(smask & (lse > float("-inf")), tl.exp(lse - m), 0.0)
    parts = tl.load(O_PART + r * stride_or + h * stride_oh + s[:, None] * stride_os + d[None, :],
                    mask=smask[:, None] & (d[None, :] < D), other=0.0)
    out = tl.sum(parts * w[:, None], 0) / tl.sum(w, 0)
    tl.store(OUT + r * stride_outr + h * stride_outh + d, out.to(OUT.dtype.element_ty), mask=d < D)


# Launch shapes: the largest tiles that ptxas fits without spilling registers for head
# dim 128 on sm_80 and sm_90 (tests/compile_triton.py prints its report).
DECODE_TILE = 64  # tokens per decode loop step (any block size)
QUANT_DECODE_TILE = 32  # 8-bit pools: their float32 dequantized tiles need the registers


def decode_launch(dtype: torch.dtype, quantized: bool, dim: int) -> tuple[int, int]:
    """(tokens per loop step, warps) of one decode program. 16-bit tiles of head dim <= 128
    take 4 warps: 1.3x the bandwidth of 8 on an H200 (bfloat16, head dim 128, batch 64,
    4096 tokens; bench_attention.py's sweep). float32, 8-bit pools and wider heads keep 8,
    which they need to fit in registers (the GQA group is padded to 16 rows either way)."""
    if quantized:
        return QUANT_DECODE_TILE, 8
    return DECODE_TILE, 4 if dtype != torch.float32 and _p2(dim) <= 128 else 8


def extend_launch(dtype: torch.dtype, quantized: bool = False) -> tuple[int, int, int]:
    """(query columns, tokens per loop step, warps) of one extend program (8-bit pools:
    half the tokens, whose float32 dequantized tiles would spill on sm_80)."""
    if INTERPRETING:
        return 16, 16, 4
    if dtype == torch.float32:
        return 64, 16, 8
    return (64, 32, 8) if quantized else (64, 64, 8)


def decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    alibi_slopes: torch.Tensor | None = None,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
    tile: int | None = None,
    num_warps: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One new token per row over its cached tokens (itself included).

    query [R, Hq, D]; k_cache, v_cache [NB, bs, Hkv, D]; block_tables [R, nb] int32;
    seq_lens [R] (tokens cached, the query's own included) -> out [R, Hq, D].
    num_splits: KV splits per row (default: enough to fill the GPU for long contexts); with
    one split the kernel writes `out` itself, else a merge kernel combines the splits.
    max_seq_len: host-known bound on seq_lens (default: what the table can hold).
    tile, num_warps: launch shape (tokens per loop step, a power of two >= 16; default:
    `decode_launch`).
    softcap: scores -> softcap * tanh(scores / softcap); sinks [Hq]: sink logits.
    """
    rows, heads, dim = query.shape
    _, bs, kv_heads, _ = k_cache.shape
    group = heads // kv_heads
    max_tokens = max(1, max_seq_len or block_tables.shape[1] * bs)
    if sliding_window:  # splits start at each row's oldest visible token
        max_tokens = min(max_tokens, sliding_window)
    quant, k_cache, v_cache = _stored(k_cache, v_cache)
    default_tile, default_warps = decode_launch(query.dtype, bool(quant), dim)
    tile, num_warps = tile or default_tile, num_warps or default_warps
    if num_splits is None:
        num_splits = _default_splits(rows * kv_heads, max_tokens, query.device)
    per_split = triton.cdiv(triton.cdiv(max_tokens, max(1, num_splits)), tile) * tile
    num_splits = triton.cdiv(max_tokens, per_split)
    out = torch.empty(rows, heads, dim, dtype=query.dtype, device=query.device)
    if num_splits == 1:
        o_part, lse_part = out.unsqueeze(2), out  # lse_part unused
    else:
        o_part = torch.empty(rows, heads, num_splits, dim, dtype=torch.float32,
                             device=query.device)
        lse_part = torch.empty(rows, heads, num_splits, dtype=torch.float32, device=query.device)
    slopes = alibi_slopes.contiguous() if alibi_slopes is not None else out  # else unused
    sink_logits = sinks.float().contiguous() if sinks is not None else out  # else unused
    query, seq_lens = query.contiguous(), seq_lens.contiguous()
    _decode_kernel[(rows, kv_heads, num_splits)](
        query, k_cache, v_cache, block_tables, seq_lens, slopes, sink_logits, o_part, lse_part,
        query.stride(0), query.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        o_part.stride(0), o_part.stride(1), o_part.stride(2),
        lse_part.stride(0), lse_part.stride(1),
        scale, softcap or 0.0, sliding_window or 0, per_split,
        GROUP=group, GROUP_P=_p2(group), BS=bs, TILE=tile, D=dim, D_P=_p2(dim),
        HAS_ALIBI=alibi_slopes is not None, HAS_SOFTCAP=softcap is not None,
        HAS_SINKS=sinks is not None, CAST_FP32=INTERPRETING or query.dtype == torch.float32,
        STORE_LSE=num_splits > 1, QUANT=quant, num_warps=num_warps,
    )
    if num_splits > 1:
        _merge_splits_kernel[(rows, heads)](
            o_part, lse_part, out,
            o_part.stride(0), o_part.stride(1), o_part.stride(2),
            lse_part.stride(0), lse_part.stride(1),
            out.stride(0), out.stride(1),
            SPLITS=num_splits, SPLITS_P=triton.next_power_of_2(num_splits), D=dim,
            D_P=_p2(dim),
        )
    return out


def _default_splits(programs: int, tokens: int, device: torch.device) -> int:
    """Splits so that rows x KV heads x splits covers the GPU about twice, with at least 256
    tokens per split (one split when the rows alone fill it)."""
    if device.type != "cuda":
        return 1
    index = torch.cuda.current_device() if device.index is None else device.index
    return max(1, min(triton.cdiv(2 * _sm_count(index), programs), tokens // 256))


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    """Multiprocessors of CUDA device `index` (asked once: the query is not free per layer)."""
    return torch.cuda.get_device_properties(index).multi_processor_count


@triton.jit
def _extend_kernel(
    Q, K, V, BT, QPOS, CTX, SEQ, SLOPES, SINKS, OUT,
    stride_qr, stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_btr, stride_pr,
    stride_or, stride_ot, stride_oh,
    q_len, scale, softcap, window,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BS: tl.constexpr, TILE: tl.constexpr,
    D: tl.constexpr, D_P: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr, CAST_FP32: tl.constexpr, QUANT: tl.constexpr,
):
    """Program (row, query head, BLOCK_M query columns) over the positions its queries see,
    TILE at a time."""
    r = tl.program_id(0)
    h = tl.program_id(1)
    tile = tl.program_id(2)
    kvh = h // GROUP
    cols = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, D_P)
    t = tl.arange(0, TILE)
    cmask = cols < q_len
    dmask = d < D
    ctx = tl.load(CTX + r).to(tl.int32)
    seq_len = tl.load(SEQ + r).to(tl.int32)
    qpos = tl.load(QPOS + r * stride_pr + cols, mask=cmask, other=-1).to(tl.int32)
    is_query = cmask & (qpos >= ctx)  # left-padding columns sit below the context
    q = tl.load(Q + r * stride_qr + cols[:, None] * stride_qt + h * stride_qh + d[None, :],
                mask=is_query[:, None] & dmask[None, :], other=0.0)
    if CAST_FP32:
        q = q.to(tl.float32)
    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(SLOPES + h).to(tl.float32)
    hi = tl.minimum(tl.max(tl.where(is_query, qpos, -1), 0) + 1, seq_len)
    lowest = tl.min(tl.where(is_query, qpos, 2147483647), 0)
    lo = tl.where(window > 0, tl.maximum(lowest - window + 1, 0), 0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    if HAS_SINKS:  # a sink is a score exp(sink) with no value: start the softmax from it
        sink = tl.load(SINKS + h).to(tl.float32)
        m_i = tl.where(is_query, sink, m_i)
        l_i = tl.where(is_query, 1.0, l_i)
    acc = tl.zeros([BLOCK_M, D_P], tl.float32)
    for t0 in range(lo, hi, TILE):
        pos = t0 + t
        valid = (pos[None, :] <= qpos[:, None]) & is_query[:, None]
        valid = valid & ((window <= 0) | (pos[None, :] > qpos[:, None] - window))
        m_i, l_i, acc = _attend_tile(q, K, V, BT + r * stride_btr, stride_kb, stride_kt,
                                     kvh * stride_kh, pos, hi, valid, slope, scale, softcap,
                                     m_i, l_i, acc, d, dmask, BS, HAS_ALIBI, HAS_SOFTCAP,
                                     CAST_FP32, QUANT, D)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # padding columns come out as zeros
    tl.store(OUT + r * stride_or + cols[:, None] * stride_ot + h * stride_oh + d[None, :],
             out.to(OUT.dtype.element_ty), mask=cmask[:, None] & dmask[None, :])


def extend_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_pos: torch.Tensor,
    context_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    alibi_slopes: torch.Tensor | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q >= 1 new tokens per row attending causally to their context and to each other.

    query [R, q, Hq, D] (left-padded columns allowed); query_pos [R, q] sequence position
    of each column (padding: below context_lens); context_lens, seq_lens [R]
    -> out [R, q, Hq, D], zeros on padding columns. softcap, sinks: as `decode_attention`.
    """
    rows, q_len, heads, dim = query.shape
    _, bs, kv_heads, _ = k_cache.shape
    out = torch.empty_like(query)
    block_m, tile, num_warps = extend_launch(query.dtype, k_cache.dtype in CODES)
    cast_fp32 = INTERPRETING or query.dtype == torch.float32
    slopes = alibi_slopes.contiguous() if alibi_slopes is not None else out  # else unused
    sink_logits = sinks.float().contiguous() if sinks is not None else out  # else unused
    context_lens, seq_lens = context_lens.contiguous(), seq_lens.contiguous()
    quant, k_cache, v_cache = _stored(k_cache, v_cache)
    _extend_kernel[(rows, heads, triton.cdiv(q_len, block_m))](
        query, k_cache, v_cache, block_tables, query_pos, context_lens, seq_lens, slopes,
        sink_logits, out,
        query.stride(0), query.stride(1), query.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), query_pos.stride(0),
        out.stride(0), out.stride(1), out.stride(2),
        q_len, scale, softcap or 0.0, sliding_window or 0,
        GROUP=heads // kv_heads, BLOCK_M=block_m, BS=bs, TILE=tile, D=dim, D_P=_p2(dim),
        HAS_ALIBI=alibi_slopes is not None, HAS_SOFTCAP=softcap is not None,
        HAS_SINKS=sinks is not None, CAST_FP32=cast_fp32, QUANT=quant,
        num_warps=num_warps,
    )
    return out


def _stored(k_cache: torch.Tensor, v_cache: torch.Tensor):
    """(QUANT, K, V): an 8-bit pool's views as bytes and their kind's code; others as given."""
    quant = CODES.get(k_cache.dtype, 0)
    if quant:
        return quant, k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    return 0, k_cache, v_cache
