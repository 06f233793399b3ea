"""Every kernel backend against the PyTorch reference, over a grid of shapes and dtypes.

Without a GPU, Triton runs under its interpreter (set in conftest) on small shapes;
with one, the same grid runs compiled, plus long contexts.
"""

from __future__ import annotations

import os

import pytest
import torch

from hf_paged.kernels import reference
from hf_paged.kernels.backends import select_backend, triton_unavailable_reason
from conftest import assert_same, both, left_padded_batch, make_model

GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if GPU else "cpu")
TRITON_REASON = triton_unavailable_reason(DEVICE)
needs_triton = pytest.mark.skipif(TRITON_REASON is not None, reason=str(TRITON_REASON))

# Tolerances paired with pool dtypes, in one place.
TOLERANCE = {
    torch.float32: dict(rtol=1e-4, atol=1e-4),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2),
}
LENGTHS = [1, 17, 97] + ([1000] if GPU else [])


def paged_inputs(lengths, block_size, kv_heads, head_dim, dtype, seed=0):
    """A pool with each row's blocks scattered (shuffled, non-contiguous) and partly filled."""
    g = torch.Generator().manual_seed(seed)
    per_row = [-(-n // block_size) for n in lengths]
    width = max(per_row)
    num_blocks = sum(per_row) + 5
    k = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    v = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    ids = torch.randperm(num_blocks, generator=g)
    table = torch.zeros(len(lengths), width, dtype=torch.int32)
    used = 0
    for r, n in enumerate(per_row):
        table[r, :n] = ids[used:used + n]
        used += n
    return (k.to(DEVICE, dtype), v.to(DEVICE, dtype), table.to(DEVICE),
            torch.tensor(lengths, device=DEVICE))


def reference_attention(q, k, v, table, query_pos, is_query, scale, window, slopes):
    """float32 reference: q [R, Hq, q, D] -> [R, q, Hq, D]."""
    num_keys = table.shape[1] * k.shape[1]
    mask = reference.key_mask(query_pos, is_query, num_keys, window)
    if slopes is not None:
        t = torch.arange(num_keys, device=q.device, dtype=torch.float32)
        mask = (slopes.float().view(1, -1, 1, 1) * t).masked_fill(~mask, float("-inf"))
    return reference.paged_attention(q.float(), k.float(), v.float(), table.long(), mask, scale)


GRID = [
    # block_size, query heads, kv heads, head_dim
    (8, 4, 4, 64),
    (16, 8, 2, 64),
    (32, 8, 2, 128),
    (1, 2, 1, 64),
    (3, 4, 2, 64),
]
if GPU:
    GRID += [(16, 32, 8, 128), (8, 32, 8, 64)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@needs_triton
@pytest.mark.parametrize("block_size, heads, kv_heads, head_dim", GRID)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 3])
def test_triton_decode(block_size, heads, kv_heads, head_dim, dtype, batch):
    from hf_paged.kernels.triton_attention import decode_attention

    lengths = [LENGTHS[(i * 2 + 1) % len(LENGTHS)] for i in range(batch)]
    k, v, table, seq = paged_inputs(lengths, block_size, kv_heads, head_dim, dtype)
    q = torch.randn(batch, heads, head_dim, device=DEVICE).to(dtype)
    scale = head_dim ** -0.5
    ref = reference_attention(q[:, :, None], k, v, table, (seq - 1)[:, None], None, scale,
                              None, None)[:, 0]
    for splits in (1, 3):
        out = decode_attention(q, k, v, table, seq, scale, num_splits=splits)
        torch.testing.assert_close(out.float(), ref, **TOLERANCE[dtype])


@needs_triton
@pytest.mark.parametrize("window, alibi", [(5, False), (None, True), (40, True)])
def test_triton_decode_window_and_alibi(window, alibi):
    from hf_paged.kernels.triton_attention import decode_attention

    k, v, table, seq = paged_inputs([3, 97, 50], 8, 2, 64, torch.float32, seed=1)
    q = torch.randn(3, 4, 64, device=DEVICE)
    slopes = torch.rand(4, device=DEVICE) if alibi else None
    ref = reference_attention(q[:, :, None], k, v, table, (seq - 1)[:, None], None, 0.125,
                              window, slopes)[:, 0]
    out = decode_attention(q, k, v, table, seq, 0.125, window, slopes, num_splits=2)
    torch.testing.assert_close(out, ref, **TOLERANCE[torch.float32])


EXTEND_CASES = [
    # context lengths, new tokens per row (left-padded to the longest), block_size
    ([0, 0, 0], [1, 17, 40], 16),   # prefill, ragged
    ([5, 12], [3, 9], 8),           # extend after context (chunked prefill, verification)
    ([30], [4], 4),                 # one row, partial blocks
    ([0, 96], [97, 1], 32),
]


@needs_triton
@pytest.mark.parametrize("ctx, new, block_size", EXTEND_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window, alibi", [(None, False), (6, False), (None, True)])
def test_triton_extend(ctx, new, block_size, dtype, window, alibi):
    from hf_paged.kernels.triton_attention import extend_attention

    heads, kv_heads, head_dim = 4, 2, 64
    lengths = [c + n for c, n in zip(ctx, new)]
    k, v, table, seq = paged_inputs(lengths, block_size, kv_heads, head_dim, dtype)
    q_len = max(new)
    ctx_t = torch.tensor(ctx, device=DEVICE)
    col = torch.arange(q_len, device=DEVICE)
    pad = (q_len - torch.tensor(new, device=DEVICE)).unsqueeze(1)
    query_pos = ctx_t.unsqueeze(1) + col - pad
    is_query = col >= pad
    q = torch.randn(len(ctx), q_len, heads, head_dim, device=DEVICE).to(dtype)
    slopes = torch.rand(heads, device=DEVICE) if alibi else None
    ref = reference_attention(q.transpose(1, 2), k, v, table, query_pos, is_query, 0.125,
                              window, slopes)
    out = extend_attention(q, k, v, table, query_pos, ctx_t, seq, 0.125, window, slopes)
    torch.testing.assert_close(out.float()[is_query], ref[is_query], **TOLERANCE[dtype])
    assert torch.all(out[~is_query] == 0)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_write_and_copy(dtype):
    from hf_paged.kernels import triton_cache_ops

    k, v, _, _ = paged_inputs([40], 8, 2, 64, dtype)
    key = torch.randn(6, 2, 64, device=DEVICE).to(dtype)
    value = torch.randn(6, 2, 64, device=DEVICE).to(dtype)
    slots = torch.tensor([0, 9, 17, 30, 31, 47], device=DEVICE)
    k2, v2 = k.clone(), v.clone()
    triton_cache_ops.write_kv(k, v, key, value, slots)
    reference.write_kv(k2, v2, key, value, slots)
    assert torch.equal(k, k2) and torch.equal(v, v2)
    kv = torch.randn(3, 2, 7, 4, 2, 16, device=DEVICE).to(dtype)
    kv2 = kv.clone()
    src, dst = torch.tensor([0, 4], device=DEVICE), torch.tensor([6, 2], device=DEVICE)
    triton_cache_ops.copy_blocks(kv, src, dst)
    reference.copy_blocks(kv2, src, dst)
    assert torch.equal(kv, kv2)


@needs_triton
@pytest.mark.parametrize("kind", ["llama_gqa", "mistral_sw", "falcon_alibi"])
def test_generate_with_triton_backend(kind):
    model = make_model(kind).to(DEVICE)
    ids, mask = left_padded_batch([3, 11], seed=3)
    kwargs = dict(input_ids=ids.to(DEVICE), attention_mask=mask.to(DEVICE), max_new_tokens=6,
                  do_sample=False, cache_implementation="paged", return_dict_in_generate=True)
    ref = model.generate(**kwargs, cache_config={"backend": "torch", "block_size": 4})
    out = model.generate(**kwargs, cache_config={"backend": "triton", "block_size": 4})
    assert out.past_key_values.backend.name == "triton"
    assert_same(ref, out)
    beams = dict(kwargs, num_beams=2)
    assert_same(model.generate(**beams, cache_config={"backend": "torch", "block_size": 4}),
                model.generate(**beams, cache_config={"backend": "triton", "block_size": 4}))


def test_backend_selection():
    assert select_backend("torch", "cpu").name == "torch"
    assert select_backend("auto", "cpu").name == "torch"  # the reference on CPU
    for name in ("cuda", "flash_attn", "nope"):
        with pytest.raises(ValueError, match=name):
            select_backend(name, "cpu")


def test_triton_on_cpu_without_interpreter_says_why(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="CUDA device"):
        select_backend("triton", "cpu")


def test_backend_from_environment(monkeypatch, llama):
    monkeypatch.setenv("HF_PAGED_BACKEND", "torch")
    ids, _ = left_padded_batch([5], seed=1)
    out = llama.generate(ids, max_new_tokens=2, cache_implementation="paged",
                         return_dict_in_generate=True)
    assert out.past_key_values.backend.name == "torch"
    monkeypatch.setenv("HF_PAGED_BACKEND", "bogus")
    with pytest.raises(ValueError, match="backend"):
        llama.generate(ids, max_new_tokens=2, cache_implementation="paged")
