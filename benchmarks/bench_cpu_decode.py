"""The CPU decode kernel (`cuda/cpu_paged_attention.cpp`) alone, on a few decode shapes:
best-of-5 microseconds a call, and the K/V bytes it reads per second.

    python benchmarks/bench_cpu_decode.py
    PYTHONPATH=other/checkout python benchmarks/bench_cpu_decode.py   # another version's

Each version builds its own kernel (cached by its sources' hash), so two checkouts run one
after the other, interleaved, compare on the same machine.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import hf_paged
from hf_paged.kernels import cpu_ops
from hf_paged.kv.quant import quantize

# rows, query heads, KV heads, head dim, cached tokens per row, pool dtype, 8-bit kind
SHAPES = [
    (64, 4, 2, 16, 48, torch.float32, None),  # the engine benchmark's tiny Llama
    (64, 16, 16, 64, 300, torch.float32, None),  # its 168M Llama
    (64, 32, 8, 128, 500, torch.float32, None),  # Llama-3-8B-like heads
    (64, 32, 8, 128, 500, torch.bfloat16, None),
    (64, 32, 8, 128, 500, torch.bfloat16, torch.int8),
    (8, 32, 8, 128, 2000, torch.float32, None),  # few rows, long contexts
]


def measure(rows, heads, kv_heads, dim, context, dtype, kind, block_size=16, runs=5):
    torch.manual_seed(0)
    per_row = -(-context // block_size)
    blocks = rows * per_row + 8

    def pool():
        values = torch.randn(blocks, block_size, kv_heads, dim)
        return values.to(dtype) if kind is None else quantize(values, kind).view(kind)

    k, v = pool(), pool()
    q = torch.randn(rows, heads, dim, dtype=dtype)
    lens = torch.full((rows,), context, dtype=torch.int64)
    tables = torch.randperm(blocks)[:rows * per_row].view(rows, per_row).to(torch.int32)
    decode = cpu_ops.load().decode
    calls = max(10, int(1e5 / (rows * context * heads * dim / 64)))
    for _ in range(3):
        decode(q, k, v, tables, lens, dim ** -0.5, 0, 0.0, None, None)
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        for _ in range(calls):
            decode(q, k, v, tables, lens, dim ** -0.5, 0, 0.0, None, None)
        best = min(best, (time.perf_counter() - start) / calls)
    read = rows * context * kv_heads * k.shape[-1] * k.element_size() * 2
    return dict(rows=rows, heads=heads, kv_heads=kv_heads, head_dim=dim, context=context,
                dtype=str(dtype).removeprefix("torch."),
                kv_cache_dtype=None if kind is None else str(kind).removeprefix("torch."),
                us=round(best * 1e6, 1), gb_per_s=round(read / best / 1e9, 1))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="also write the rows as JSON here")
    args = parser.parse_args()
    if not cpu_ops.available():
        raise SystemExit(f"the CPU kernel is unavailable: {cpu_ops.unavailable_reason()}")
    print(f"hf_paged from {Path(hf_paged.__file__).parent}, {torch.get_num_threads()} threads")
    rows = []
    for shape in SHAPES:
        row = measure(*shape)
        rows.append(row)
        kind = f" {row['kv_cache_dtype']}" if row["kv_cache_dtype"] else ""
        print(f"  {row['rows']:3d} rows, {row['heads']:2d}/{row['kv_heads']:2d} heads, dim "
              f"{row['head_dim']:3d}, {row['context']:5d} tokens, {row['dtype']}{kind}: "
              f"{row['us']:9.1f} us ({row['gb_per_s']:.1f} GB/s of K/V)", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
