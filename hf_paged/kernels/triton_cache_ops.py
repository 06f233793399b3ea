"""Triton cache writes: new tokens through a slot mapping, and copy-on-write block copies."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(KEY, VALUE, K_CACHE, V_CACHE, SLOTS, stride_n, stride_slot,
                     ROW: tl.constexpr, ROW_P: tl.constexpr):
    """Program n: token n's [Hkv * D] K and V go to flat slot SLOTS[n] (negative: skipped)."""
    n = tl.program_id(0)
    slot = tl.load(SLOTS + n).to(tl.int64)
    if slot >= 0:
        offs = tl.arange(0, ROW_P)
        mask = offs < ROW
        k = tl.load(KEY + n * stride_n + offs, mask=mask)
        v = tl.load(VALUE + n * stride_n + offs, mask=mask)
        tl.store(K_CACHE + slot * stride_slot + offs, k, mask=mask)
        tl.store(V_CACHE + slot * stride_slot + offs, v, mask=mask)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor,
             value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """key/value [N, Hkv, D] -> caches [NB, bs, Hkv, D] at flat slots `slot_mapping` [N]."""
    n = key.shape[0]
    if n == 0:
        return
    row = key.shape[1] * key.shape[2]
    key, value, slot_mapping = key.contiguous(), value.contiguous(), slot_mapping.contiguous()
    _write_kv_kernel[(n,)](key, value, k_cache, v_cache, slot_mapping, key.stride(0),
                           k_cache.stride(1), ROW=row, ROW_P=triton.next_power_of_2(row))


@triton.jit
def _copy_blocks_kernel(KV, SRC, DST, stride_lkv, stride_b, BLOCK_NUMEL: tl.constexpr,
                        CHUNK: tl.constexpr):
    """Program (pair i, layer x K/V j): block SRC[i] -> DST[i] of plane j."""
    i = tl.program_id(0)
    j = tl.program_id(1)
    src = tl.load(SRC + i).to(tl.int64)
    dst = tl.load(DST + i).to(tl.int64)
    base = KV + j * stride_lkv
    for start in range(0, BLOCK_NUMEL, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        mask = offs < BLOCK_NUMEL
        tl.store(base + dst * stride_b + offs, tl.load(base + src * stride_b + offs, mask=mask),
                 mask=mask)


def copy_blocks(kv: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy-on-write for every layer, K and V: kv [L, 2, NB, bs, Hkv, D], src/dst [n]."""
    if src.numel() == 0:
        return
    src, dst = src.contiguous(), dst.contiguous()  # kernels index them as flat arrays
    planes = kv.shape[0] * kv.shape[1]
    flat = kv.view(planes, kv.shape[2], -1)
    numel = flat.shape[2]
    _copy_blocks_kernel[(src.numel(), planes)](flat, src, dst, flat.stride(0), flat.stride(1),
                                               BLOCK_NUMEL=numel,
                                               CHUNK=min(4096, triton.next_power_of_2(numel)))
