"""8-bit K/V blocks: quantization bounds, the reference and the Triton kernels reading them
(compared with the reference over the dequantized values, tolerances paired to the query's
dtype), writes, copies and swaps bit-exact, backend choice and its errors."""

from __future__ import annotations

import pytest
import torch

from hf_paged.kernels import reference
from hf_paged.kernels.backends import select_backend
from hf_paged.kv.quant import QMAX, dequantize, quantize
from test_kernels import (  # noqa: F401  (cuda_kernels and emulated_cuda_ops: fixtures)
    DEVICE, EXTEND_CASES, TOLERANCE, cuda_kernels, emulated_cuda_ops, extend_layout,
    needs_triton, paged_inputs, reference_attention,
)

KINDS = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]
# Worst error of one value relative to its head's absolute maximum.
BOUND = {torch.int8: 0.5 / 127 + 1e-3, torch.float8_e4m3fn: 2.0 ** -4 + 1e-3,
         torch.float8_e5m2: 2.0 ** -3 + 1e-3}


@pytest.mark.parametrize("kind", KINDS)
def test_quantize_round_trip_is_bounded_by_each_heads_maximum(kind):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 4, 64, generator=g) * torch.logspace(-3, 3, 50)[:, None, None]
    x[3, 1] = 0.0  # an all-zero head stays zero
    stored = quantize(x, kind)
    assert stored.dtype == torch.uint8 and stored.shape == (50, 4, 66)
    back = dequantize(stored, kind, torch.float32)
    err = (back - x).abs() / x.abs().amax(-1, keepdim=True).clamp(min=1e-30)
    assert err.max() <= BOUND[kind]
    assert torch.all(back[3, 1] == 0)
    # Never saturated: the largest value of a head maps to at most the kind's maximum.
    values = stored[..., :-2].view(kind).float()
    assert values.abs().max() <= QMAX[kind]


def quantized_pool(k, v, kind):
    """[NB, bs, Hkv, D] float pools -> (8-bit views [NB, bs, Hkv, D + 2], dequantized floats)."""
    kq, vq = quantize(k, kind).view(kind), quantize(v, kind).view(kind)
    return kq, vq, dequantize(kq, kind, torch.float32), dequantize(vq, kind, torch.float32)


@pytest.mark.parametrize("kind", KINDS)
def test_reference_reads_what_was_written(kind):
    """write_kv quantizes, paged_attention dequantizes: equal to attention over the
    dequantized values."""
    k, v, table, seq = paged_inputs([5, 23], 4, 2, 32, torch.float32, device="cpu")
    kq = torch.zeros(*k.shape[:3], 34, dtype=torch.uint8).view(kind)
    vq = torch.zeros_like(kq)
    slots = torch.arange(k.shape[0] * k.shape[1])
    reference.write_kv(kq, vq, k.flatten(0, 1), v.flatten(0, 1), slots)
    assert torch.equal(kq.view(torch.uint8), quantize(k, kind))
    q = torch.randn(2, 4, 1, 32)
    mask = reference.key_mask((seq - 1)[:, None], None, table.shape[1] * 4, None)
    out = reference.paged_attention(q, kq, vq, table.long(), mask, 0.2)
    ref = reference.paged_attention(q, dequantize(kq, kind, torch.float32),
                                    dequantize(vq, kind, torch.float32), table.long(), mask, 0.2)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)


@needs_triton
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window, alibi", [(None, False), (20, True)])
def test_triton_decode_dequantizes(kind, dtype, window, alibi):
    from hf_paged.kernels.triton_attention import decode_attention

    k, v, table, seq = paged_inputs([1, 17, 97], 8, 2, 64, torch.float32)
    kq, vq, kf, vf = quantized_pool(k, v, kind)
    q = torch.randn(3, 4, 64, device=DEVICE).to(dtype)
    slopes = torch.rand(4, device=DEVICE) if alibi else None
    ref = reference_attention(q[:, :, None], kf, vf, table, (seq - 1)[:, None], None, 0.125,
                              window, slopes)[:, 0]
    for splits in (1, 3):
        out = decode_attention(q, kq, vq, table, seq, 0.125, window, slopes,
                               num_splits=splits, tile=16)
        torch.testing.assert_close(out.float(), ref, **TOLERANCE[dtype])


@needs_triton
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("ctx, new, block_size", EXTEND_CASES[:3])
def test_triton_extend_dequantizes(kind, ctx, new, block_size):
    from hf_paged.kernels.triton_attention import extend_attention

    lengths = [c + n for c, n in zip(ctx, new)]
    k, v, table, seq = paged_inputs(lengths, block_size, 2, 64, torch.float32)
    kq, vq, kf, vf = quantized_pool(k, v, kind)
    q_len, ctx_t, query_pos, is_query = extend_layout(ctx, new)
    q = torch.randn(len(ctx), q_len, 4, 64, device=DEVICE)
    ref = reference_attention(q.transpose(1, 2), kf, vf, table, query_pos, is_query, 0.125,
                              None, None)
    out = extend_attention(q, kq, vq, table, query_pos, ctx_t, seq, 0.125)
    torch.testing.assert_close(out[is_query], ref[is_query], **TOLERANCE[torch.float32])


def test_backends_that_do_not_read_8bit_blocks_say_so():
    from hf_paged.kernels.dispatch import PoolAccess
    from hf_paged.kv.pool import KVPool

    pool = KVPool(2, 2, 16, 4, 8, torch.float32, torch.device("cpu"), growable=False,
                  kv_dtype=torch.int8)
    from hf_paged.kernels import cpu_ops

    assert PoolAccess(pool, "auto", 4).backend.name == ("cpu" if cpu_ops.available() else "torch")
    assert PoolAccess(pool, "torch", 4).backend.name == "torch"
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="cuda"):
            PoolAccess(pool, "cuda", 4)
    assert set(KINDS) <= set(select_backend("torch", "cpu").capabilities.kv_dtypes)
    with pytest.raises(ValueError, match="latent"):
        KVPool(2, 2, 16, 4, 8, torch.float32, torch.device("cpu"), growable=False,
               v_head_dim=8, kv_dtype=torch.int8)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_decode_dequantizes(cuda_kernels, kind, dtype):
    """The CUDA C++ decode kernel on 8-bit blocks (on a GPU, and here through the emulator),
    single pass and split-KV, against the reference over the dequantized values."""
    ops, device = cuda_kernels
    k, v, table, seq = paged_inputs([1, 17, 97], 8, 2, 64, torch.float32, device=device)
    kq, vq, kf, vf = quantized_pool(k, v, kind)
    q = torch.randn(3, 4, 64, device=device).to(dtype)
    ref = reference_attention(q[:, :, None], kf, vf, table, (seq - 1)[:, None], None, 0.125,
                              None, None)[:, 0]
    for partition in (512, 32):
        out = ops.decode(q, kq, vq, table, seq, None, 0.125, 0, 97, partition, 0.0, None)
        torch.testing.assert_close(out.float(), ref, **TOLERANCE[dtype])
