"""Soft-capping and attention sinks in every kernel backend against the PyTorch reference
(Triton under its interpreter without a GPU; the CUDA C++ decode kernel on a GPU and through
the CPU emulator), and the reference itself against a direct formula."""

from __future__ import annotations

import pytest
import torch

from hf_paged.kernels import reference
from test_kernels import (  # noqa: F401  (fixtures)
    DEVICE, DTYPES, TOLERANCE, cuda_kernels, emulated_cuda_ops, extend_layout, needs_triton,
    paged_inputs,
)

FEATURES = [(5.0, False), (None, True), (3.0, True)]  # (softcap, sinks)


def expected(q, k, v, table, query_pos, is_query, scale, window, softcap, sinks):
    """float32 reference with features: q [R, Hq, q, D] -> [R, q, Hq, D]."""
    mask = reference.key_mask(query_pos, is_query, table.shape[1] * k.shape[1], window)
    return reference.paged_attention(q.float(), k.float(), v.float(), table.long(), mask, scale,
                                     softcap=softcap,
                                     sinks=None if sinks is None else sinks.float())


def test_reference_features_match_the_formula():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 3, 8, generator=g) for _ in range(3))
    sinks = torch.tensor([0.5, -1.0])
    mask = torch.ones(1, 1, 3, 3, dtype=torch.bool).tril()
    out = reference.attend(q, k, v, mask, 0.3, softcap=2.0, sinks=sinks)
    s = 2.0 * torch.tanh(q @ k.transpose(-1, -2) * 0.3 / 2.0)
    s = s.masked_fill(~mask, float("-inf"))
    e = torch.exp(s)
    p = e / (e.sum(-1, keepdim=True) + torch.exp(sinks).view(1, 2, 1, 1))
    torch.testing.assert_close(out, (p @ v).transpose(1, 2))


@pytest.mark.parametrize("softcap", [None, 2.0])
def test_a_query_that_sees_no_key_reads_no_slot_unless_told_to_average(softcap):
    """A query whose mask shows no key gives zeros whatever the slots hold (SDPA's answer;
    the slots may be another sequence's), and with `uniform` the plain average of the keys
    `eager_fallback` shows it: the row's slots up to its length, from the window's kept."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, n, 8, generator=g) for n in (3, 5, 5))
    mask = torch.ones(2, 1, 3, 5, dtype=torch.bool).tril(2)
    mask[0, 0, 2] = False  # row 0's last query sees nothing
    outs = [reference.attend(q, k, v * scale_v, mask, 0.3, softcap=softcap)
            for scale_v in (1.0, 7.0)]
    for out in outs:
        assert torch.equal(out[0, 2], torch.zeros(2, 8))
    torch.testing.assert_close(outs[0][1:], reference.attend(q[1:], k[1:], v[1:], mask[1:],
                                                             0.3, softcap=softcap))
    seq_lens, context_lens = torch.tensor([4, 5]), torch.tensor([2, 2])
    for window, first in ((None, 0), (2, 1)):
        shown, uniform = reference.eager_fallback(mask, context_lens, seq_lens, window)
        assert uniform.flatten().tolist() == [False, False, True] + [False] * 3
        assert shown[0, 0, 2].tolist() == [t in range(first, 4) for t in range(5)]
        assert torch.equal(shown[1], mask[1]) and torch.equal(shown[0, :, :2], mask[0, :, :2])
        out = reference.attend(q, k, v, shown, 0.3, softcap=softcap, uniform=uniform)
        torch.testing.assert_close(out[0, 2], v[0, :, first:4].mean(1))
        torch.testing.assert_close(out[:, :2], outs[0][:, :2])
    assert reference.eager_fallback(mask[1:], context_lens[1:], seq_lens[1:], None) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_query_that_sees_no_key_weighs_values_as_eager_attention(dtype):
    """`eager_fallback`'s weights are Transformers' eager attention's, dtype by dtype: equal
    in float32 and bfloat16, where a score plus the minimum rounds to the minimum; in
    float16 (minimum -65504, a step of 32 there) large scores keep their lead."""
    from types import SimpleNamespace

    from transformers.models.llama.modeling_llama import eager_attention_forward

    g = torch.Generator().manual_seed(1)
    q = (torch.randn(1, 2, 4, 8, generator=g) * 6).to(dtype)  # scores of tens: float16 shows
    k, v = (torch.randn(1, 2, 6, 8, generator=g).to(dtype) for _ in range(2))
    mask = torch.ones(1, 1, 4, 6, dtype=torch.bool).tril(2)
    mask[0, 0, 3] = False  # the last query sees nothing
    additive = torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, torch.finfo(dtype).min)
    module = SimpleNamespace(num_key_value_groups=1, training=False)
    stock, _ = eager_attention_forward(module, q, k, v, additive, scaling=0.5)
    shown, uniform = reference.eager_fallback(mask, torch.tensor([0]), torch.tensor([6]), None)
    out = reference.attend(q, k, v, shown, 0.5, uniform=uniform)
    torch.testing.assert_close(out[0, 3], stock[0, 3], **TOLERANCE[dtype])
    if dtype == torch.float16:  # (where a plain mean would be wrong)
        assert (out[0, 3].float() - v[0].float().mean(1)).abs().max() > 0.1


def _sinks(heads, with_sinks, device=DEVICE):
    return torch.randn(heads, device=device) * 2 if with_sinks else None


@needs_triton
@pytest.mark.parametrize("softcap, with_sinks", FEATURES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 5])
def test_triton_decode_features(softcap, with_sinks, dtype, window):
    from hf_paged.kernels.triton_attention import decode_attention

    k, v, table, seq = paged_inputs([3, 97, 50], 8, 2, 64, dtype, seed=2)
    q = torch.randn(3, 4, 64, device=DEVICE).to(dtype)
    sinks = _sinks(4, with_sinks)
    ref = expected(q[:, :, None], k, v, table, (seq - 1)[:, None], None, 0.125, window,
                   softcap, sinks)[:, 0]
    for splits, tile in ((1, 64), (3, 16)):  # the sink in one split, merged with the others
        out = decode_attention(q, k, v, table, seq, 0.125, window, None, num_splits=splits,
                               tile=tile, softcap=softcap, sinks=sinks)
        torch.testing.assert_close(out.float(), ref, **TOLERANCE[dtype])


@needs_triton
@pytest.mark.parametrize("softcap, with_sinks", FEATURES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 6])
def test_triton_extend_features(softcap, with_sinks, dtype, window):
    from hf_paged.kernels.triton_attention import extend_attention

    ctx, new, heads = [0, 12], [17, 9], 4
    lengths = [c + n for c, n in zip(ctx, new)]
    k, v, table, seq = paged_inputs(lengths, 8, 2, 32, dtype, seed=3)
    q_len, ctx_t, query_pos, is_query = extend_layout(ctx, new)
    q = torch.randn(2, q_len, heads, 32, device=DEVICE).to(dtype)
    sinks = _sinks(heads, with_sinks)
    ref = expected(q.transpose(1, 2), k, v, table, query_pos, is_query, 0.2, window, softcap,
                   sinks)
    out = extend_attention(q, k, v, table, query_pos, ctx_t, seq, 0.2, window, None,
                           softcap=softcap, sinks=sinks)
    torch.testing.assert_close(out.float()[is_query], ref[is_query], **TOLERANCE[dtype])
    assert torch.all(out[~is_query] == 0)


@pytest.mark.parametrize("softcap, with_sinks", FEATURES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_decode_features(cuda_kernels, softcap, with_sinks, dtype):
    from hf_paged.kernels import cuda_ops

    ops, device = cuda_kernels
    lengths = [1, 17, 97, 300]
    k, v, table, seq = paged_inputs(lengths, 16, 2, 64, dtype, device=device)
    q = torch.randn(len(lengths), 8, 64, device=device).to(dtype)
    sinks = _sinks(8, with_sinks, device)
    ref = expected(q[:, :, None], k, v, table, (seq - 1)[:, None], None, 0.125, None, softcap,
                   sinks)[:, 0]
    for partition in (cuda_ops.PARTITION, 64):  # single pass and split-KV
        out = ops.decode(q, k, v, table, seq, None, 0.125, 0, max(lengths), partition,
                         softcap or 0.0, sinks)
        torch.testing.assert_close(out.float(), ref, **TOLERANCE[dtype])


@needs_triton
@pytest.mark.parametrize("name", ["gemma2", "gpt_oss"])
def test_generate_with_triton_on_softcap_and_sink_models(name):
    """Hybrid KV groups with soft-capping (Gemma 2) or sinks (gpt-oss) through the Triton
    kernels end to end (decode and extend), token for token with stock."""
    from conftest import assert_same, left_padded_batch
    from zoo import make_arch

    model = make_arch(name)
    ids, mask = left_padded_batch([5, 11, 8], seed=1)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False,
                  eos_token_id=None)
    out = model.generate(**kwargs, cache_implementation="paged", return_dict_in_generate=True,
                         cache_config={"backend": "triton", "block_size": 4})
    assert out.past_key_values.backend.name == "triton"
    assert out.past_key_values.groups.is_hybrid
    assert_same(model.generate(**kwargs), out)
