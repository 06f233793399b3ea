"""Paged attention kernels vs contiguous attention on the same shapes.

    python benchmarks/bench_attention.py                 # GPU: Llama-7B-like shapes
    python benchmarks/bench_attention.py --quick         # small shapes (CPU smoke run)

Decode: one query token per row over `context` cached tokens, 32 query heads, 8 KV heads,
head dim 128, block size 16 (flash-attn's paged path needs blocks of 256 and gets its own
pool). Each paged backend is timed against SDPA over contiguous K/V (and flash-attn over
contiguous K/V where installed); achieved bandwidth counts the K and V bytes read. The
device-to-device copy bandwidth (read + write) is measured too, as the roofline. On CPU the
CPU kernel (backend "cpu") is timed too, and both it and the reference on int8 blocks.
Prefill: `context` new tokens per row, causal, paged (Triton extend) vs contiguous SDPA.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from common import check_device
from hf_paged.kernels import reference
from hf_paged.kernels.backends import (
    flash_attn_unavailable_reason, select_backend, triton_unavailable_reason,
)


def timer(device: torch.device, iters: int):
    """Returns f(fn) -> median seconds of `iters` calls after two warm-ups."""

    def run(fn):
        fn()
        fn()
        times = []
        for _ in range(iters):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
        return statistics.median(times)

    return run


def paged_pool(batch, context, block_size, kv_heads, head_dim, dtype, device, seed=0):
    """K/V pools holding `batch` rows of `context` tokens in shuffled blocks, plus tables."""
    g = torch.Generator().manual_seed(seed)
    per_row = -(-context // block_size)
    num_blocks = batch * per_row
    k = torch.randn(num_blocks, block_size, kv_heads, head_dim, dtype=dtype, device=device)
    v = torch.randn_like(k)
    table = torch.randperm(num_blocks, generator=g).view(batch, per_row).to(torch.int32).to(device)
    return k, v, table


def copy_bandwidth(device, dtype, run) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write) of a 1 GiB tensor (64 MiB on CPU)."""
    n = (2**30 if device.type == "cuda" else 2**26) // torch.tensor([], dtype=dtype).element_size()
    src = torch.empty(n, dtype=dtype, device=device)
    dst = torch.empty_like(src)
    seconds = run(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / seconds


def bench_decode(args, device, dtype, run, copy_bw):
    rows = []
    heads, kv_heads, dim, bs = args.heads, args.kv_heads, args.head_dim, args.block_size
    backends = ["torch", "triton", "cuda", "cpu"]
    flash_reason = flash_attn_unavailable_reason(device, dtype, 256)
    for batch in args.batches:
        for context in args.contexts:
            k, v, table = paged_pool(batch, context, bs, kv_heads, dim, dtype, device)
            seq = torch.full((batch,), context, device=device)
            q = torch.randn(batch, heads, dim, dtype=dtype, device=device)
            kv_bytes = 2 * batch * context * kv_heads * dim * k.element_size()
            kc = reference.gather_kv(k, table.long())[:, :, :context].contiguous()  # [B, Hkv, T, D]
            vc = reference.gather_kv(v, table.long())[:, :, :context].contiguous()
            scale = dim ** -0.5
            times = {"sdpa_contiguous": run(lambda: F.scaled_dot_product_attention(
                q[:, :, None], kc, vc, scale=scale, enable_gqa=True))}
            if flash_reason is None:
                from flash_attn import flash_attn_with_kvcache

                kf, vf = kc.transpose(1, 2).contiguous(), vc.transpose(1, 2).contiguous()
                seq32 = seq.to(torch.int32)
                times["flash_contiguous"] = run(lambda: flash_attn_with_kvcache(
                    q[:, None], kf, vf, cache_seqlens=seq32, softmax_scale=scale))
                k256, v256, t256 = paged_pool(batch, context, 256, kv_heads, dim, dtype, device)
                times["flash_attn_paged(bs=256)"] = run(lambda: flash_attn_with_kvcache(
                    q[:, None], k256, v256, cache_seqlens=seq32, block_table=t256,
                    softmax_scale=scale))
                del kf, vf, k256, v256
            for name in backends:
                try:
                    backend = select_backend(name, device, dtype, bs, heads, kv_heads)
                except (ValueError, RuntimeError):
                    continue
                if name == "torch" and kv_bytes > args.torch_limit:
                    continue  # the reference gathers a full copy per call: skip the largest
                if name == "torch":
                    mask = reference.key_mask((seq - 1)[:, None], None, table.shape[1] * bs, None)
                    fn = lambda: reference.paged_attention(  # noqa: E731
                        q[:, :, None], k, v, table.long(), mask, scale)
                elif name == "cpu":
                    from hf_paged.kernels import cpu_ops

                    fn = lambda: cpu_ops.decode(q, k, v, table, seq, scale, 0, 0.0,  # noqa: E731
                                                None, None)
                elif name == "triton":
                    from hf_paged.kernels.triton_attention import decode_attention

                    fn = lambda: decode_attention(q, k, v, table, seq, scale,  # noqa: E731
                                                  max_seq_len=context)
                else:
                    ops = backend._ops
                    fn = lambda: ops.decode(q, k, v, table, seq, None, scale, 0, context,  # noqa: E731
                                            512, 0.0, None)
                times[f"{name}_paged"] = run(fn)
            if device.type == "cpu":  # int8 blocks: the reference and the CPU kernel
                times.update(decode_int8(q, k, v, table, seq, scale, run))
            baseline = times.get("flash_contiguous", times["sdpa_contiguous"])
            for name, seconds in times.items():
                bw = kv_bytes / seconds
                rows.append(dict(kind="decode", batch=batch, context=context, method=name,
                                 ms=seconds * 1e3, gbps=bw / 1e9,
                                 vs_contiguous=baseline / seconds, vs_copy_bw=bw / copy_bw))
            del k, v, kc, vc
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def decode_int8(q, k, v, table, seq, scale, run) -> dict:
    """Decode over the same pool stored as int8 blocks (kv/quant.py): the reference, which
    dequantizes what it gathers, and the CPU kernel, which dequantizes as it reads."""
    from hf_paged.kernels import cpu_ops
    from hf_paged.kv.quant import quantize

    kq, vq = (quantize(x, torch.int8).view(torch.int8) for x in (k, v))
    mask = reference.key_mask((seq - 1)[:, None], None, table.shape[1] * k.shape[1], None)
    times = {"torch_paged_int8": run(lambda: reference.paged_attention(
        q[:, :, None], kq, vq, table.long(), mask, scale))}
    if cpu_ops.available():
        times["cpu_paged_int8"] = run(lambda: cpu_ops.decode(q, kq, vq, table, seq, scale, 0,
                                                             0.0, None, None))
    return times


def sweep_triton_decode(args, device, dtype, run, copy_bw, batch=64, context=4096):
    """Triton decode launch shapes (tokens per step x warps) at the target shape; the
    defaults in triton_attention.py come from this on the GPU they were tuned on."""
    if triton_unavailable_reason(device) is not None:
        return []
    from hf_paged.kernels.triton_attention import decode_attention

    k, v, table = paged_pool(batch, context, args.block_size, args.kv_heads, args.head_dim,
                             dtype, device)
    seq = torch.full((batch,), context, device=device)
    q = torch.randn(batch, args.heads, args.head_dim, dtype=dtype, device=device)
    kv_bytes = 2 * k.numel() * k.element_size()
    rows = []
    for tile in (16, 32, 64, 128):
        for warps in (4, 8):
            seconds = run(lambda: decode_attention(q, k, v, table, seq, args.head_dim ** -0.5,
                                                   max_seq_len=context, tile=tile,
                                                   num_warps=warps))
            rows.append(dict(kind="decode_sweep", batch=batch, context=context,
                             method=f"triton tile={tile} warps={warps}", ms=seconds * 1e3,
                             gbps=kv_bytes / seconds / 1e9, vs_copy_bw=kv_bytes / seconds / copy_bw))
    return rows


def bench_prefill(args, device, dtype, run):
    rows = []
    if triton_unavailable_reason(device) is not None:
        return rows
    from hf_paged.kernels.triton_attention import extend_attention

    heads, kv_heads, dim, bs = args.heads, args.kv_heads, args.head_dim, args.block_size
    for batch in args.prefill_batches:
        for context in args.prefill_contexts:
            k, v, table = paged_pool(batch, context, bs, kv_heads, dim, dtype, device)
            q = torch.randn(batch, context, heads, dim, dtype=dtype, device=device)
            pos = torch.arange(context, device=device).expand(batch, context).contiguous()
            zeros = torch.zeros(batch, dtype=torch.long, device=device)
            seq = torch.full((batch,), context, device=device)
            kc = reference.gather_kv(k, table.long())[:, :, :context].contiguous()
            vc = reference.gather_kv(v, table.long())[:, :, :context].contiguous()
            qt = q.transpose(1, 2).contiguous()
            scale = dim ** -0.5
            sdpa = run(lambda: F.scaled_dot_product_attention(qt, kc, vc, is_causal=True,
                                                              scale=scale, enable_gqa=True))
            paged = run(lambda: extend_attention(q, k, v, table, pos, zeros, seq, scale))
            flops = 4 * batch * heads * dim * context * context / 2
            for name, seconds in (("sdpa_contiguous", sdpa), ("triton_paged", paged)):
                rows.append(dict(kind="prefill", batch=batch, context=context, method=name,
                                 ms=seconds * 1e3, tflops=flops / seconds / 1e12,
                                 vs_contiguous=sdpa / seconds))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small shapes (CPU smoke run)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="device to time on (default: cuda when available, else cpu)")
    parser.add_argument("--out", help="write the rows as JSON here")
    parser.add_argument("--iters", type=int, default=20,
                        help="timed repetitions per shape, after warm-up (default 20)")
    args = parser.parse_args()
    check_device(args.device)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    args.heads, args.kv_heads, args.head_dim, args.block_size = 32, 8, 128, 16
    if args.quick or device.type != "cuda":
        args.batches, args.contexts = [1, 4], [512, 2048]
        args.prefill_batches, args.prefill_contexts = [1], [256]
        args.iters = min(args.iters, 5)
    else:
        args.batches, args.contexts = [1, 8, 64], [512, 2048, 4096, 8192]
        args.prefill_batches, args.prefill_contexts = [1, 8], [512, 2048, 4096]
    args.torch_limit = 2**31
    run = timer(device, args.iters)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    copy_bw = copy_bandwidth(device, dtype, run)
    print(f"device: {name}, dtype {dtype}, Hq={args.heads} Hkv={args.kv_heads} D={args.head_dim} "
          f"block_size={args.block_size}; device copy bandwidth {copy_bw / 1e9:.3g} GB/s")
    rows = bench_decode(args, device, dtype, run, copy_bw)
    print(f"\n{'decode':<10}{'batch':>6}{'context':>8}  {'method':<26}{'ms':>9}{'GB/s':>9}"
          f"{'x contiguous':>14}{'of copy BW':>12}")
    for r in rows:
        print(f"{'':<10}{r['batch']:>6}{r['context']:>8}  {r['method']:<26}{r['ms']:>9.3f}"
              f"{r['gbps']:>9.3g}{r['vs_contiguous']:>14.2f}{r['vs_copy_bw']:>12.2f}")
    sweep = sweep_triton_decode(args, device, dtype, run, copy_bw) if device.type == "cuda" else []
    for r in sweep:
        print(f"{'sweep':<10}{r['batch']:>6}{r['context']:>8}  {r['method']:<26}{r['ms']:>9.3f}"
              f"{r['gbps']:>9.3g}{'':>14}{r['vs_copy_bw']:>12.2f}")
    prefill = bench_prefill(args, device, dtype, run)
    if prefill:
        print(f"\n{'prefill':<10}{'batch':>6}{'context':>8}  {'method':<26}{'ms':>9}{'TFLOP/s':>9}"
              f"{'x contiguous':>14}")
        for r in prefill:
            print(f"{'':<10}{r['batch']:>6}{r['context']:>8}  {r['method']:<26}{r['ms']:>9.3f}"
                  f"{r['tflops']:>9.1f}{r['vs_contiguous']:>14.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=name, dtype=str(dtype), copy_gbps=copy_bw / 1e9,
                           rows=rows + sweep + prefill), f, indent=1)


if __name__ == "__main__":
    main()
