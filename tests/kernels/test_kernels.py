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


def paged_inputs(lengths, block_size, kv_heads, head_dim, dtype, seed=0, device=DEVICE):
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
    return (k.to(device, dtype), v.to(device, dtype), table.to(device),
            torch.tensor(lengths, device=device))


def reference_attention(q, k, v, table, query_pos, is_query, scale, window, slopes):
    """float32 reference: q [R, Hq, q, D] -> [R, q, Hq, D]."""
    num_keys = table.shape[1] * k.shape[1]
    mask = reference.key_mask(query_pos, is_query, num_keys, window)
    if slopes is not None:
        # Falcon's ALiBi as Transformers builds it: position and product in bfloat16.
        t = torch.arange(num_keys, device=q.device).to(torch.bfloat16)
        bias = (slopes.view(1, -1, 1, 1).to(torch.bfloat16) * t).float() * scale
        mask = bias.masked_fill(~mask, float("-inf"))
    return reference.paged_attention(q.float(), k.float(), v.float(), table.long(), mask, scale)


GRID = [
    # block_size, query heads, kv heads, head_dim
    (8, 4, 4, 64),
    (16, 8, 2, 64),
    (32, 8, 2, 128),
    (1, 2, 1, 64),
    (3, 4, 2, 64),
    (128, 4, 2, 64),  # blocks larger than a kernel tile, all partly filled
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
    for splits, tile, bound in ((1, 64, None), (3, 16, None), (None, 64, max(lengths))):
        out = decode_attention(q, k, v, table, seq, scale, num_splits=splits, tile=tile,
                               max_seq_len=bound)
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
    # tile 16: with window 40 the visible span crosses a split boundary
    out = decode_attention(q, k, v, table, seq, 0.125, window, slopes, num_splits=2, tile=16)
    torch.testing.assert_close(out, ref, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("heads", [4, 6])  # slopes powers of two, and not
def test_alibi_past_256_tokens_is_rounded_as_transformers_falcon_rounds_it(heads):
    """Falcon's ALiBi in bfloat16 (positions past 256 round, and so do products with slopes
    that are not powers of two): every decode backend here against the reference, which
    must differ from slope * t for this test to mean anything."""
    from hf_paged.hf.falcon import alibi_slopes
    from hf_paged.kernels import cpu_ops

    k, v, table, seq = paged_inputs([700, 300, 5], 16, heads, 16, torch.float32, seed=3)
    q = torch.randn(3, heads, 16, device=DEVICE) * 4
    slopes, scale = alibi_slopes(heads).to(DEVICE), 0.25
    ref = reference_attention(q[:, :, None], k, v, table, (seq - 1)[:, None], None, scale,
                              None, slopes)[:, 0]
    t = torch.arange(table.shape[1] * 16, device=DEVICE, dtype=torch.float32)
    plain = (slopes.view(1, -1, 1, 1) * t * scale).masked_fill(
        ~reference.key_mask((seq - 1)[:, None], None, t.numel(), None), float("-inf"))
    unrounded = reference.paged_attention(q[:, :, None], k, v, table.long(), plain, scale)[:, 0]
    assert (unrounded - ref).abs().max() > 1e-3
    outs = {}
    if TRITON_REASON is None:
        from hf_paged.kernels.triton_attention import decode_attention

        outs["triton"] = decode_attention(q, k, v, table, seq, scale, None, slopes,
                                          num_splits=2, tile=16)
    if DEVICE.type == "cpu" and cpu_ops.available():
        outs["cpu"] = cpu_ops.decode(q, k, v, table, seq, scale, 0, 0.0, slopes, None)
    from hf_paged.kernels.backends import TorchBackend
    from hf_paged.metadata import DeviceBlockTable, build_metadata

    dev = DeviceBlockTable(3, table.shape[1], DEVICE)
    dev.table.copy_(table)
    meta = build_metadata(dev, seq - 1, [1, 1, 1], 1, int(seq.max()), 16)
    outs["torch"] = TorchBackend().attention(q[:, :, None], k, v, meta, scale, None, slopes)[:, 0]
    for name, out in outs.items():
        torch.testing.assert_close(out, ref, **TOLERANCE[torch.float32], msg=name)


def extend_layout(ctx, new):
    """(q_len, context lengths [R], query positions [R, q], real columns [R, q]) of rows
    with `ctx` cached tokens and `new` ones, right-aligned in the longest."""
    q_len = max(new)
    ctx_t = torch.tensor(ctx, device=DEVICE)
    col = torch.arange(q_len, device=DEVICE)
    pad = (q_len - torch.tensor(new, device=DEVICE)).unsqueeze(1)
    return q_len, ctx_t, ctx_t.unsqueeze(1) + col - pad, col >= pad


EXTEND_CASES = [
    # context lengths, new tokens per row (left-padded to the longest), block_size
    ([0, 0, 0], [1, 17, 40], 16),   # prefill, ragged
    ([5, 12], [3, 9], 8),           # extend after context (chunked prefill, verification)
    ([30], [4], 4),                 # one row, partial blocks
    ([0, 96], [97, 1], 32),
    ([0, 40], [70, 5], 64),         # blocks larger than a kernel tile
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
    q_len, ctx_t, query_pos, is_query = extend_layout(ctx, new)
    q = torch.randn(len(ctx), q_len, heads, head_dim, device=DEVICE).to(dtype)
    slopes = torch.rand(heads, device=DEVICE) if alibi else None
    ref = reference_attention(q.transpose(1, 2), k, v, table, query_pos, is_query, 0.125,
                              window, slopes)
    out = extend_attention(q, k, v, table, query_pos, ctx_t, seq, 0.125, window, slopes)
    torch.testing.assert_close(out.float()[is_query], ref[is_query], **TOLERANCE[dtype])
    assert torch.all(out[~is_query] == 0)


def check_write_and_copy(write_kv, copy_blocks, dtype, device=DEVICE):
    """A backend's slot-mapping write and block copy equal the reference's exactly.

    write_kv(k_cache, v_cache, key, value, slots); copy_blocks(kv, src, dst).
    """
    k, v, _, _ = paged_inputs([40], 8, 2, 64, dtype, device=device)
    key = torch.randn(6, 2, 64, device=device).to(dtype)
    value = torch.randn(6, 2, 64, device=device).to(dtype)
    slots = torch.tensor([0, 9, 17, 30, 31, 47], device=device)
    k2, v2 = k.clone(), v.clone()
    write_kv(k, v, key, value, slots)
    reference.write_kv(k2, v2, key, value, slots)
    assert torch.equal(k, k2) and torch.equal(v, v2)
    kv = torch.randn(3, 2, 7, 4, 2, 16, device=device).to(dtype)
    kv2 = kv.clone()
    src, dst = torch.tensor([0, 4], device=device), torch.tensor([6, 2], device=device)
    copy_blocks(kv, src, dst)
    reference.copy_blocks(kv2, src, dst)
    assert torch.equal(kv, kv2)
    return kv


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_write_and_copy(dtype):
    from hf_paged.kernels import triton_cache_ops

    check_write_and_copy(triton_cache_ops.write_kv, triton_cache_ops.copy_blocks, dtype)


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


@needs_triton
def test_hidden_slots_and_4d_masks_with_a_kernel_backend():
    """Forwards the kernels do not cover (hidden slots, a caller's 4D mask) run on the
    reference, whatever the cache's backend; the rest of the call stays on the kernels."""
    model = make_model("llama_gqa").to(DEVICE)
    ids, mask = left_padded_batch([6, 9], seed=3)
    mask[0, -2:] = 0  # right padding: hidden slots
    kwargs = dict(input_ids=ids.to(DEVICE), attention_mask=mask.to(DEVICE), max_new_tokens=5,
                  do_sample=False, return_dict_in_generate=True)
    ref = model.generate(**kwargs)
    out = model.generate(**kwargs, cache_implementation="paged",
                         cache_config={"backend": "triton", "block_size": 4})
    assert out.past_key_values.backend.name == "triton"
    assert_same(ref, out)
    from hf_paged import PagedCache

    packed = torch.ones(1, 1, 6, 6, dtype=torch.bool, device=DEVICE).tril()
    packed[..., 3:, :3] = False  # two sequences of 3 in one row
    positions = torch.tensor([[0, 1, 2, 0, 1, 2]], device=DEVICE)
    row = ids[1:, -6:].to(DEVICE)
    with torch.no_grad():
        expected = model(input_ids=row, attention_mask=packed, position_ids=positions).logits
        model.config._attn_implementation_internal = "paged"
        try:
            cache = PagedCache(model.config, {"backend": "triton", "block_size": 4})
            got = model(input_ids=row, attention_mask=packed, position_ids=positions,
                        past_key_values=cache).logits
        finally:
            model.config._attn_implementation_internal = "sdpa"
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(GPU, reason="checks the errors a CPU-only machine gives")
def test_backend_selection_on_cpu():
    assert select_backend("torch", "cpu").name == "torch"
    # the C++ kernel on CPU where it builds, else the reference
    from hf_paged.kernels import cpu_ops

    assert select_backend("auto", "cpu").name == ("cpu" if cpu_ops.build_error() is None
                                                  else "torch")
    with pytest.raises(ValueError, match="'cuda' cannot run here: no CUDA device"):
        select_backend("cuda", "cpu")
    with pytest.raises(ValueError, match="'flash_attn' cannot run here"):
        select_backend("flash_attn", "cpu", torch.float16, 256)
    with pytest.raises(ValueError, match="must be one of"):
        select_backend("nope", "cpu")


def test_triton_on_cpu_without_interpreter_says_why(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="CUDA device"):
        select_backend("triton", "cpu")


def test_torch_backend_gives_zeros_on_padding_columns():
    """Padding columns (a row with fewer new tokens, or none) come out as zeros, as the
    kernels give them, never another row's values."""
    from hf_paged.kernels.backends import TorchBackend
    from hf_paged.metadata import DeviceBlockTable, build_metadata

    lengths = [3, 9, 5]
    counts = [0, 4, 5]  # row 0: all padding in this forward
    k, v, table, seq = paged_inputs(lengths, 4, 2, 16, torch.float32, device="cpu")
    dev = DeviceBlockTable(3, table.shape[1], torch.device("cpu"))
    dev.table.copy_(table)
    ctx = seq - torch.tensor(counts)
    meta = build_metadata(dev, ctx, counts, 5, int(seq.max()), 4)
    q = torch.randn(3, 4, 5, 16)
    out = TorchBackend().attention(q, k, v, meta, 0.25)
    assert torch.all(out[~meta.is_query] == 0)
    ref = reference_attention(q, k, v, table, meta.query_pos, meta.is_query, 0.25, None, None)
    torch.testing.assert_close(out[meta.is_query], ref[meta.is_query])


@pytest.mark.parametrize("window, alibi", [(None, False), (7, False), (None, True)])
def test_torch_backend_length_buckets_equal_one_padded_batch(window, alibi):
    """Decode rows of very different lengths are gathered per length bucket: the same
    result as padding every row to the longest."""
    from hf_paged.kernels.backends import TorchBackend
    from hf_paged.kernels.torch_backend import length_groups
    from hf_paged.metadata import DeviceBlockTable, build_metadata

    lengths = [1, 3, 4, 9, 17, 30, 61, 97, 100, 250, 5, 64]
    k, v, table, seq = paged_inputs(lengths, 4, 2, 16, torch.float32, device="cpu")
    dev = DeviceBlockTable(len(lengths), table.shape[1], torch.device("cpu"))
    dev.table.copy_(table)
    counts = [1] * len(lengths)
    q = torch.randn(len(lengths), 4, 1, 16)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625]) if alibi else None
    plain = build_metadata(dev, seq - 1, counts, 1, int(seq.max()), 4)
    grouped = build_metadata(dev, seq - 1, counts, 1, int(seq.max()), 4, seq_lens_host=lengths)
    assert length_groups(grouped) is not None and length_groups(plain) is None
    a = TorchBackend().attention(q, k, v, plain, 0.25, window, slopes)
    b = TorchBackend().attention(q, k, v, grouped, 0.25, window, slopes)
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 20, 200])
@pytest.mark.parametrize("ctx, new", [
    ([0, 0, 0, 0, 0], [2, 17, 40, 3, 120]),   # prompts only, several length buckets
    ([0, 5, 0, 30, 0], [60, 9, 1, 4, 8]),     # with chunk continuations and a 1-token row
    ([3, 9], [5, 2]),                         # no fresh prompt: the masked path alone
    ([0, 0, 0], [13, 13, 13]),                # equal prompts filling the layout: in place
])
def test_torch_backend_causal_prompts_equal_the_masked_batch(dtype, window, ctx, new):
    """Rows that start their sequences attend causally without a mask, left-aligned in
    length buckets; the others keep their mask: the same outputs as one masked batch,
    zeros on padding columns, GQA, any sliding window (rows longer than it stay masked)."""
    from hf_paged.kernels.backends import TorchBackend
    from hf_paged.kernels.torch_backend import causal_rows
    from hf_paged.metadata import DeviceBlockTable, build_metadata

    lengths = [c + n for c, n in zip(ctx, new)]
    k, v, table, seq = paged_inputs(lengths, 4, 2, 16, dtype, device="cpu")
    dev = DeviceBlockTable(len(lengths), table.shape[1], torch.device("cpu"))
    dev.table.copy_(table)
    ctx_t = torch.tensor(ctx)
    plain = build_metadata(dev, ctx_t, new, max(new), max(lengths), 4)
    split = build_metadata(dev, ctx_t, new, max(new), max(lengths), 4, seq_lens_host=lengths)
    fresh = any(c == 0 and n > 1 and (window is None or n <= window)
                for c, n in zip(ctx, new))
    assert (causal_rows(split, window) is not None) == fresh
    in_place = fresh and min(new) == max(new) and not any(ctx)
    assert (causal_rows(split, window) == (None, None)) == in_place
    assert causal_rows(plain, window) is None
    q = torch.randn(len(lengths), 4, max(new), 16).to(dtype)
    a = TorchBackend().attention(q, k, v, plain, 0.25, window)
    b = TorchBackend().attention(q, k, v, split, 0.25, window)
    assert plain.is_query is None or torch.all(b[~plain.is_query] == 0)
    torch.testing.assert_close(b.float(), a.float(), **TOLERANCE[dtype])


def test_backend_from_environment(monkeypatch, llama):
    monkeypatch.setenv("HF_PAGED_BACKEND", "torch")
    ids, _ = left_padded_batch([5], seed=1)
    out = llama.generate(ids, max_new_tokens=2, cache_implementation="paged",
                         return_dict_in_generate=True)
    assert out.past_key_values.backend.name == "torch"
    monkeypatch.setenv("HF_PAGED_BACKEND", "bogus")
    with pytest.raises(ValueError, match="HF_PAGED_BACKEND"):
        llama.generate(ids, max_new_tokens=2, cache_implementation="paged")


# -- CUDA C++: on a GPU as built by cuda_ops, and everywhere through the CPU emulator -------
def _cuda_reason():
    from hf_paged.kernels import cuda_ops

    return cuda_ops.unavailable_reason()


@pytest.fixture(scope="session")
def emulated_cuda_ops(tmp_path_factory):
    """cuda/*.cu compiled for the CPU against tests/cuda_emu (see cuda_runtime.h there)."""
    from cuda_emu import emulator

    if emulator.compiler() is None:
        pytest.skip("g++ is not installed")
    return emulator.EmulatedCudaOps(emulator.build(tmp_path_factory.mktemp("cuda_emu")))


@pytest.fixture(params=["gpu", "emulated"])
def cuda_kernels(request):
    """(ops with the binding's calls, the device their tensors live on)."""
    if request.param == "emulated":
        return request.getfixturevalue("emulated_cuda_ops"), torch.device("cpu")
    reason = _cuda_reason()
    if reason is not None:
        pytest.skip(reason)
    from hf_paged.kernels import cuda_ops

    return cuda_ops.load(), DEVICE


# The GPU grid plus GQA groups of 8 and 16 (with head_dim 256, 1024-token partitions need
# more than the default 48 KiB of shared memory: the kernel opts in).
CUDA_GRID = GRID + [(16, 16, 2, 64), (8, 16, 1, 256)]


@pytest.mark.parametrize("block_size, heads, kv_heads, head_dim", CUDA_GRID)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window, alibi", [(None, False), (40, False), (None, True)])
def test_cuda_decode(cuda_kernels, block_size, heads, kv_heads, head_dim, dtype, window, alibi):
    from hf_paged.kernels import cuda_ops

    ops, device = cuda_kernels
    lengths = [1, 17, 97, 1000, 600] if device.type == "cuda" else [1, 17, 97, 300]
    k, v, table, seq = paged_inputs(lengths, block_size, kv_heads, head_dim, dtype, device=device)
    q = torch.randn(len(lengths), heads, head_dim, device=device).to(dtype)
    slopes = torch.rand(heads, device=device) if alibi else None
    scale = head_dim ** -0.5
    ref = reference_attention(q[:, :, None], k, v, table, (seq - 1)[:, None], None, scale,
                              window, slopes)[:, 0]
    for partition in (cuda_ops.PARTITION, 64, 1024):  # single pass and split-KV
        out = ops.decode(q, k, v, table, seq, slopes, scale, window or 0, max(lengths), partition,
                         0.0, None)
        torch.testing.assert_close(out.float(), ref, **TOLERANCE[dtype])


def test_traced_cuda_decode_op_calls_the_binding_in_its_order(emulated_cuda_ops, monkeypatch):
    """`hf_paged::cuda_decode` (what a compiled forward records for the CUDA backend's
    decode) hands its arguments to the binding in the binding's order: run against the
    emulated binding, with ALiBi and a window, then soft-capping and sinks, it equals the
    reference."""
    from hf_paged.kernels import cuda_ops

    monkeypatch.setattr(cuda_ops, "load", lambda: emulated_cuda_ops)
    lengths = [1, 17, 97, 300]
    k, v, table, seq = paged_inputs(lengths, 8, 2, 64, torch.float32, device="cpu")
    q = torch.randn(len(lengths), 4, 64)
    slopes, sinks = torch.rand(4), torch.randn(4)
    pos = (seq - 1)[:, None]
    ref = reference_attention(q[:, :, None], k, v, table, pos, None, 0.125, 40, slopes)[:, 0]
    out = torch.ops.hf_paged.cuda_decode(q, k, v, table, seq, 0.125, 40, slopes, 0.0, None, 64)
    torch.testing.assert_close(out, ref, **TOLERANCE[torch.float32])
    mask = reference.key_mask(pos, None, table.shape[1] * k.shape[1], None)
    ref = reference.paged_attention(q[:, :, None], k, v, table.long(), mask, 0.125,
                                    softcap=30.0, sinks=sinks)[:, 0]
    out = torch.ops.hf_paged.cuda_decode(q, k, v, table, seq, 0.125, 0, None, 30.0, sinks, 64)
    torch.testing.assert_close(out, ref, **TOLERANCE[torch.float32])


def test_emulated_cuda_decode_rejects_unsupported_group(emulated_cuda_ops):
    k, v, table, seq = paged_inputs([5], 4, 1, 64, torch.float32, device="cpu")
    with pytest.raises(RuntimeError, match="paged_decode failed"):
        emulated_cuda_ops.decode(torch.randn(1, 3, 64), k, v, table, seq, None, 0.1, 0, 5, 512,
                                 0.0, None)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_write_and_copy(cuda_kernels, dtype):
    ops, device = cuda_kernels
    check_write_and_copy(lambda k, v, key, value, slots: ops.write_kv(key, value, k, v, slots),
                         ops.copy_blocks, dtype, device)


def test_emulated_cuda_swap(emulated_cuda_ops):
    """Block swap by (src, dst) pairs, both directions (host memory stands in for the GPU)."""
    gpu = torch.randn(6, 4, 2, 16)
    host = torch.zeros(5, 4, 2, 16)
    emulated_cuda_ops.swap_blocks(gpu, host, torch.tensor([[1, 3], [5, 0]]), to_host=True)
    assert torch.equal(host[3], gpu[1]) and torch.equal(host[0], gpu[5])
    back = torch.zeros_like(gpu)
    emulated_cuda_ops.swap_blocks(host, back, torch.tensor([[3, 2]]), to_host=False)
    assert torch.equal(back[2], gpu[1]) and back[[0, 1, 3, 4, 5]].abs().sum() == 0


@pytest.mark.skipif(_cuda_reason() is not None, reason=str(_cuda_reason()))
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_swap_between_gpu_and_pinned_host(dtype):
    from hf_paged.kernels import cuda_ops

    ops = cuda_ops.load()
    kv = torch.randn(6, 4, 2, 16, device=DEVICE).to(dtype)
    host = torch.zeros(5, 4, 2, 16, dtype=dtype).pin_memory()
    ops.swap_blocks(kv, host, torch.tensor([[1, 3], [5, 0]]))
    torch.cuda.synchronize()
    assert torch.equal(host[3], kv[1].cpu()) and torch.equal(host[0], kv[5].cpu())
    back = torch.zeros_like(kv)
    ops.swap_blocks(host, back, torch.tensor([[3, 2]]))
    torch.cuda.synchronize()
    assert torch.equal(back[2], kv[1])


def _flash_reason():
    from hf_paged.kernels.backends import flash_attn_unavailable_reason

    return flash_attn_unavailable_reason(DEVICE, torch.float16, 256)


@pytest.mark.skipif(_flash_reason() is not None, reason=str(_flash_reason()))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 4, 64), (32, 8, 128)])
def test_flash_attn_decode_and_extend(dtype, heads, kv_heads, head_dim):
    from hf_paged.kernels.backends import FlashAttnBackend
    from hf_paged.metadata import DeviceBlockTable, build_metadata

    backend = FlashAttnBackend()
    lengths = [1, 17, 700, 1000]
    k, v, table, seq = paged_inputs(lengths, 256, kv_heads, head_dim, dtype)
    dev = DeviceBlockTable(len(lengths), table.shape[1], DEVICE)
    dev.table.copy_(table)
    for q_len, counts in ((1, [1] * 4), (5, [1, 5, 3, 5])):
        ctx = seq - torch.tensor(counts, device=DEVICE)
        meta = build_metadata(dev, ctx, counts, q_len, int(seq.max()), 256)
        q = torch.randn(len(lengths), heads, q_len, head_dim, device=DEVICE).to(dtype)
        ref = reference_attention(q, k, v, table, meta.query_pos, meta.is_query, 0.1, None, None)
        out = backend.attention(q, k, v, meta, 0.1)
        real = meta.is_query if meta.is_query is not None else torch.ones_like(meta.query_pos, dtype=torch.bool)
        torch.testing.assert_close(out.float()[real], ref[real], **TOLERANCE[dtype])


@pytest.mark.skipif(not GPU, reason="end-to-end GPU backends need a CUDA device")
@pytest.mark.parametrize("backend", ["triton", "cuda", "flash_attn"])
def test_generate_with_gpu_backends(backend):
    from hf_paged.kernels.backends import select_backend as select

    model = make_model("llama_gqa").to(DEVICE)
    block_size = 256 if backend == "flash_attn" else 16
    dtype = torch.float16 if backend == "flash_attn" else torch.float32
    model = model.to(dtype)
    try:
        select(backend, DEVICE, dtype, block_size, 4, 2)
    except ValueError as err:
        pytest.skip(str(err))
    ids, mask = left_padded_batch([3, 40, 17], seed=3)
    kwargs = dict(input_ids=ids.to(DEVICE), attention_mask=mask.to(DEVICE), max_new_tokens=12,
                  do_sample=False, cache_implementation="paged")
    ref = model.generate(**kwargs, cache_config={"backend": "torch", "block_size": block_size})
    out = model.generate(**kwargs, cache_config={"backend": backend, "block_size": block_size})
    assert_same(ref, out)


def test_cuda_sources_compile_for_sm80_and_sm90(tmp_path):
    """Compile-only check of cuda/*.cu (no GPU needed), so a broken kernel fails CI."""
    import shutil
    import subprocess

    from hf_paged.kernels import cuda_ops

    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not installed")
    src = cuda_ops.source_dir()
    # The four compiles at once: each is one single-threaded nvcc (half the wall time on 2 cores).
    jobs = [subprocess.Popen(
        [nvcc, "-c", "-std=c++17", "-O3", f"-arch={arch}", f"-I{src}", str(src / name),
         "-o", str(tmp_path / f"{name}.{arch}.o")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for name in ("paged_attention.cu", "cache_ops.cu") for arch in ("sm_80", "sm_90")]
    errors = [job.communicate()[1] for job in jobs]  # (all finish before any assertion)
    for job, stderr in zip(jobs, errors):
        assert job.returncode == 0, stderr


def test_triton_kernels_compile_for_sm80_and_sm90_without_spills():
    """Full GPU compile of every Triton kernel in its launch shapes (no GPU needed): the
    interpreter accepts code ptxas rejects, and register spills would cost bandwidth."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).with_name("compile_triton.py")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    result = subprocess.run([sys.executable, str(script), "sm_80", "sm_90"], capture_output=True,
                            text=True, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith("sm_")]
    assert len(lines) == 39, result.stdout  # (sm_90 adds the fp8 e4m3 pool cases)
    spilling = [line for line in lines if "STACK:0 " not in line]
    assert not spilling, "register spills:\n" + "\n".join(spilling)
