"""The CPU C++ decode kernel (backend "cpu"; "auto" takes it for 8-bit CPU pools)
against the PyTorch reference: dtypes with their tolerances, GQA groups, block sizes,
sliding windows, ALiBi, soft-capping, sinks, strided layer views of a whole pool; the
backend's fallback to the reference for prompt rows; and "auto" choosing it."""

from __future__ import annotations

import pytest
import torch

from hf_paged.kernels import cpu_ops, reference
from hf_paged.kernels.backends import CpuBackend, TorchBackend, select_backend
from hf_paged.kv.metadata import DeviceBlockTable, build_metadata
from test_kernels import GRID, TOLERANCE, extend_layout, paged_inputs, reference_attention

needs_cpu_kernel = pytest.mark.skipif(not cpu_ops.available(),
                                      reason=str(cpu_ops.unavailable_reason()
                                                 or "the CPU kernel did not build"))
pytestmark = needs_cpu_kernel
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def decode(q, k, v, table, seq, scale, window=None, slopes=None, softcap=None, sinks=None):
    return cpu_ops.load().decode(q, k, v, table, seq, scale, window or 0, softcap or 0.0,
                                 slopes, sinks)


# Head sizes off the kernel's eight lanes (12, 20) take its scalar tails.
@pytest.mark.parametrize("block_size, heads, kv_heads, head_dim",
                         GRID + [(16, 16, 2, 80), (4, 6, 2, 12), (5, 4, 4, 20)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_equals_reference(block_size, heads, kv_heads, head_dim, dtype):
    lengths = [1, 17, 97, 250, 2]
    k, v, table, seq = paged_inputs(lengths, block_size, kv_heads, head_dim, dtype,
                                    device="cpu")
    q = torch.randn(len(lengths), heads, head_dim).to(dtype)
    scale = head_dim ** -0.5
    ref = reference_attention(q[:, :, None], k, v, table, (seq - 1)[:, None], None, scale,
                              None, None)[:, 0]
    out = decode(q, k, v, table, seq, scale)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, **TOLERANCE[dtype])


@pytest.mark.parametrize("spread", [30.0, 400.0])
def test_decode_sharp_softmax_equals_reference(spread):
    """Scores hundreds apart: the kernel's own exp, on eight lanes and on the tails, takes
    weights down to e^-87 and drops those below (their float32 value is 0 or a denormal)."""
    lengths = [9, 61, 200, 8, 1]
    k, v, table, seq = paged_inputs(lengths, 16, 2, 32, torch.float32, seed=3, device="cpu")
    q = torch.randn(len(lengths), 4, 32) * spread
    ref = reference_attention(q[:, :, None], k, v, table, (seq - 1)[:, None], None,
                              32 ** -0.5, None, None)[:, 0]
    out = decode(q, k, v, table, seq, 32 ** -0.5)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, **TOLERANCE[torch.float32])


@pytest.mark.parametrize("window, alibi", [(5, False), (None, True), (40, True), (1, False)])
def test_decode_window_and_alibi(window, alibi):
    k, v, table, seq = paged_inputs([3, 97, 50], 8, 2, 64, torch.float32, seed=1, device="cpu")
    q = torch.randn(3, 4, 64)
    slopes = torch.rand(4) if alibi else None
    ref = reference_attention(q[:, :, None], k, v, table, (seq - 1)[:, None], None, 0.125,
                              window, slopes)[:, 0]
    torch.testing.assert_close(decode(q, k, v, table, seq, 0.125, window, slopes), ref,
                               **TOLERANCE[torch.float32])


@pytest.mark.parametrize("softcap, with_sinks", [(5.0, False), (None, True), (3.0, True)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 5])
def test_decode_softcap_and_sinks(softcap, with_sinks, dtype, window):
    from test_kernel_features import expected

    k, v, table, seq = paged_inputs([3, 97, 50], 8, 2, 64, dtype, seed=2, device="cpu")
    q = torch.randn(3, 4, 64).to(dtype)
    sinks = torch.randn(4) * 2 if with_sinks else None
    ref = expected(q[:, :, None], k, v, table, (seq - 1)[:, None], None, 0.125, window,
                   softcap, sinks)[:, 0]
    out = decode(q, k, v, table, seq, 0.125, window, softcap=softcap, sinks=sinks)
    torch.testing.assert_close(out.float(), ref, **TOLERANCE[dtype])


def test_strided_layer_views_of_a_pool():
    """A layer's K and V are views of the pool [L, 2, NB, bs, H, D] (strided blocks)."""
    lengths = [5, 40, 33]
    k, v, table, seq = paged_inputs(lengths, 4, 2, 32, torch.float32, seed=5, device="cpu")
    pool = torch.randn(3, 2, *k.shape)
    pool[1, 0], pool[1, 1] = k, v
    q = torch.randn(3, 6, 32)
    out = decode(q, pool[1, 0], pool[1, 1], table, seq, 0.2)
    torch.testing.assert_close(out, decode(q, k, v, table, seq, 0.2), rtol=0, atol=0)


def test_backend_decodes_with_the_kernel_and_prompts_with_the_reference():
    lengths = [9, 30, 4]
    k, v, table, seq = paged_inputs(lengths, 4, 2, 16, torch.float32, seed=3, device="cpu")
    dev = DeviceBlockTable(len(lengths), table.shape[1], torch.device("cpu"))
    dev.table.copy_(table)
    backend, ref = CpuBackend(), TorchBackend()
    meta = build_metadata(dev, seq - 1, [1, 1, 1], 1, int(seq.max()), 4)
    q = torch.randn(3, 4, 1, 16)
    torch.testing.assert_close(backend.attention(q, k, v, meta, 0.25, 7),
                               ref.attention(q, k, v, meta, 0.25, 7), rtol=1e-5, atol=1e-6)
    counts = [5, 2, 4]  # prompt chunks: the reference's own result
    q_len, ctx, query_pos, is_query = extend_layout([4, 28, 0], counts)
    meta = build_metadata(dev, ctx, counts, q_len, int(seq.max()), 4)
    q = torch.randn(3, 4, q_len, 16)
    assert torch.equal(backend.attention(q, k, v, meta, 0.25),
                       ref.attention(q, k, v, meta, 0.25))


def test_auto_takes_it_on_cpu_and_the_environment_can_turn_it_off(monkeypatch):
    from hf_paged.kernels.dispatch import PoolAccess
    from hf_paged.kv.pool import KVPool

    assert isinstance(select_backend("cpu", "cpu"), CpuBackend)
    assert isinstance(select_backend("auto", "cpu"), CpuBackend)  # full precision
    pool = KVPool(2, 2, 16, 4, 8, torch.float32, torch.device("cpu"), growable=False,
                  kv_dtype=torch.int8)
    assert isinstance(PoolAccess(pool, "auto", 4).backend, CpuBackend)
    monkeypatch.setenv("HF_PAGED_CPU_KERNELS", "0")
    assert isinstance(PoolAccess(pool, "auto", 4).backend, TorchBackend)
    assert isinstance(select_backend("auto", "cpu"), TorchBackend)
    with pytest.raises(ValueError, match="HF_PAGED_CPU_KERNELS=0"):
        select_backend("cpu", "cpu")


@pytest.mark.parametrize("kind", [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window, alibi, softcap, dim",
                         [(None, False, None, 64), (20, True, 4.0, 64), (None, False, None, 12)])
def test_decode_dequantizes_8bit_blocks(kind, dtype, window, alibi, softcap, dim):
    """8-bit pools ([NB, bs, Hkv, D + 2]: values and their bfloat16 scale) read as
    value * scale, against the reference over the dequantized values."""
    from test_kernel_features import expected
    from test_kv_quant import quantized_pool

    k, v, table, seq = paged_inputs([1, 17, 97], 8, 2, dim, torch.float32, device="cpu")
    kq, vq, kf, vf = quantized_pool(k, v, kind)
    q = torch.randn(3, 4, dim).to(dtype)
    slopes = torch.rand(4) if alibi else None
    if softcap is None:
        ref = reference_attention(q[:, :, None], kf, vf, table, (seq - 1)[:, None], None,
                                  dim ** -0.5, window, slopes)[:, 0]
    else:
        ref = expected(q[:, :, None], kf, vf, table, (seq - 1)[:, None], None, dim ** -0.5,
                       window, softcap, None)[:, 0]
        slopes = None
    out = decode(q, kq, vq, table, seq, dim ** -0.5, window, slopes, softcap=softcap)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, **TOLERANCE[dtype])


def test_auto_reads_8bit_cpu_pools_with_the_kernel():
    from hf_paged import LLMEngine
    from conftest import make_model

    engine = LLMEngine(make_model("llama_gqa"), num_blocks=16, kv_cache_dtype="int8")
    assert isinstance(engine.runner.access.backend, CpuBackend)


def test_a_cache_folder_that_cannot_be_made_is_named_not_raised(tmp_path, monkeypatch):
    """An unwritable build cache leaves the kernel unavailable (the reference serves)."""
    from hf_paged.errors import CpuKernelsUnavailable

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("HF_PAGED_CACHE", str(blocker / "cache"))
    with pytest.raises(CpuKernelsUnavailable, match="failed to build"):
        cpu_ops.load.__wrapped__()  # (the cached load is the real one, already built)


@needs_cpu_kernel
def test_eager_calls_skip_the_op_and_traces_record_it():
    """Eager forwards call the extension; a make_fx trace records the torch op (so a traced
    graph replays the kernel instead of baking in its output)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    k, v, table, seq = paged_inputs([5, 40], 8, 2, 32, torch.float32, device="cpu")
    q = torch.randn(2, 4, 32)
    table32 = table.to(torch.int32)

    def run(query):
        return cpu_ops.decode(query, k, v, table32, seq, 0.2, 0, 0.0, None, None)

    trace = make_fx(run)(q)
    assert any("cpu_decode" in str(node.target) for node in trace.graph.nodes)
    other = torch.randn(2, 4, 32)
    torch.testing.assert_close(trace(other), run(other), rtol=0, atol=0)


@needs_cpu_kernel
@pytest.mark.parametrize("name", ["llama_gqa", "mistral_sw", "falcon_alibi"])
def test_generate_named_cpu_backend_equals_dynamic_cache(name):
    """`cache_config={"backend": "cpu"}` in generate: greedy and beam tokens equal stock."""
    from conftest import assert_same, left_padded_batch, make_model

    model = make_model(name)
    ids, mask = left_padded_batch([7, 19, 3], seed=4)
    for options in (dict(do_sample=False), dict(do_sample=False, num_beams=3)):
        ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, **options)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12,
                             cache_implementation="paged", cache_config={"backend": "cpu"},
                             return_dict_in_generate=True, **options)
        assert out.past_key_values.backend.name == "cpu"
        assert_same(ref, out)


@pytest.mark.parametrize("vocab", [1, 7, 8, 13, 1000, 32003])
def test_greedy_equals_torch_max(vocab):
    """The sampler's CPU argmax: torch.max's first-maximum index and finiteness, on rows
    full of ties, rows of -inf, with a NaN or +inf, and a view of every other row."""
    g = torch.Generator().manual_seed(vocab)
    x = torch.randint(-3, 4, (130, vocab), generator=g).float()
    x[4] = float("-inf")
    x[5, vocab // 2] = float("nan")
    x[6, vocab - 1] = float("inf")
    x[7, vocab - 1] = 9.0
    x[8, 0] = 9.0
    for logits in (x, x[::2]):
        tokens, valid = cpu_ops.greedy(logits)
        best, expected = logits.max(-1)
        assert torch.equal(valid, torch.isfinite(best))
        assert torch.equal(tokens, expected)


def test_greedy_serves_only_float32_rows_on_cpu():
    """Other dtypes and layouts go to torch.max (the sampler's fallback)."""
    x = torch.randn(4, 50)
    assert cpu_ops.greedy(x.bfloat16()) is None
    assert cpu_ops.greedy(x.t()) is None
    assert cpu_ops.greedy(x[None]) is None


@pytest.mark.parametrize("dtype", DTYPES)
def test_native_write_equals_reference_on_strided_views(dtype):
    """The native pool write: K and V of a layer view of a whole pool [L, 2, NB, bs, H, D],
    new tokens as the transposed [N, H, D] views a layer's projections give; every slot
    equals the reference's write, every other slot is untouched."""
    pool = torch.randn(2, 2, 9, 4, 3, 8).to(dtype)
    expected = pool.clone()
    key = torch.randn(1, 3, 6, 8).to(dtype).transpose(1, 2)[0]  # [6, 3, 8], strided
    value = torch.randn(1, 3, 6, 8).to(dtype).transpose(1, 2)[0]
    slots = torch.tensor([0, 5, 35, 17, 18, 3])
    reference.write_kv(expected[1, 0], expected[1, 1], key, value, slots)
    cpu_ops.write_kv(pool[1, 0], pool[1, 1], key, value, slots)
    assert torch.equal(pool, expected)


def test_native_write_checks_every_slot_before_writing():
    pool = torch.zeros(2, 5, 4, 2, 8)
    key = value = torch.ones(3, 2, 8)
    with pytest.raises(RuntimeError, match="slot 20 of token 2 is outside the pool's 20 slots"):
        cpu_ops.load().write_kv(pool[0], pool[1], key, value, torch.tensor([1, 2, 20]))
    assert not pool.any()  # nothing written
    with pytest.raises(RuntimeError, match="the new tokens must have the cache's dtype"):
        cpu_ops.load().write_kv(pool[0], pool[1], key.double(), value, torch.tensor([1, 2, 3]))


def test_native_write_leaves_8bit_pools_and_traces_to_the_reference():
    """An 8-bit pool quantizes through the reference; under a make_fx trace the write is
    aten ops the trace records (a CPU stand-in for a CUDA graph replays them)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from hf_paged.kv.quant import dequantize

    pool = torch.zeros(2, 6, 4, 2, 10, dtype=torch.int8)
    key, value = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    slots = torch.tensor([4, 0, 9])
    cpu_ops.write_kv(pool[0], pool[1], key, value, slots)
    stored = dequantize(pool[0].view(-1, 2, 10)[slots], torch.int8, torch.float32)
    torch.testing.assert_close(stored, key, rtol=0.02, atol=0.02)

    cache = torch.zeros(2, 6, 4, 2, 8)

    def write(k, v):
        cpu_ops.write_kv(cache[0], cache[1], k, v, slots)
        return cache.sum()

    trace = make_fx(write)(key, value)
    assert any("index_copy" in str(node.target) for node in trace.graph.nodes)


@pytest.mark.parametrize("kv_dtype", [None, torch.int8])
def test_the_compiled_forwards_write_op_takes_the_native_write_on_cpu(kv_dtype):
    """`hf_paged::write_layer_kv` (what a compiled forward calls) on a CPU pool shard, once
    the CPU backend registered its kernel: the reference's result, the other layer
    untouched; an 8-bit shard still quantizes through the reference."""
    from hf_paged.kv.pool import split_layer

    CpuBackend()  # registers the op's CPU kernel
    assert torch._C._dispatch_has_kernel_for_dispatch_key("hf_paged::write_layer_kv", "CPU")
    dtype = torch.int8 if kv_dtype else torch.float32
    shard = torch.zeros(2, 2, 5, 4, 2, 10 if kv_dtype else 8).to(dtype)
    expected = shard.clone()
    key = torch.randn(1, 2, 3, 8).transpose(1, 2)[0]  # [3, 2, 8], strided
    value = torch.randn(3, 2, 8)
    slots = torch.tensor([7, 0, 19])
    torch.ops.hf_paged.write_layer_kv(shard, 1, key, value, slots, 0, kv_dtype)
    reference.write_kv(*split_layer(expected[1], 0, kv_dtype), key, value, slots)
    assert torch.equal(shard, expected) and shard[1].any() and not shard[0].any()
