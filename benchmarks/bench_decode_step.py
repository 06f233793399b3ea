"""Where a decode step of the tight trace (`bench_engine.py --tight`) spends its time, on CPU.

    python benchmarks/bench_decode_step.py            # the weights' matmuls by row count
    python benchmarks/bench_decode_step.py --trace    # also the trace's forwards by row count

The first part times the 168M random Llama's projections and MLPs (8 layers) and its
32k-vocabulary head as `F.linear` runs them, over M rows of activations, each weight read
once per pass as a decode step reads it (542 MB: far more than the caches, so every pass
streams the weights from memory), best of a few passes. One row streams them at the memory's
speed; from four rows on, the BLAS's float32 GEMM runs well below it, so a step's cost grows
with its rows much less than in proportion: batching more rows into a step is the lever,
and the KV budget bounds it. The same passes through oneDNN's matmul, which the engine's
forwards run (hf/linear.py), stream the weights much faster. It also checks whether a row's
result depends on how many rows share the call (the BLAS picks its kernel by row count, and
kernels round differently), and times MKL's packed-weight GEMM next to it.

--trace runs the engine on the tight trace twice, with its oneDNN linear layers and with
torch's (about 4 min), and reports its forwards by row count: decode-only forwards (one token per row) by rows, and forwards with prompt chunks.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import random_llama  # noqa: E402

from hf_paged.kernels import cpu_linear  # noqa: E402

ROWS = (1, 2, 4, 8, 12, 15, 16, 19, 24, 32, 64)


def weight_passes(model, rows=ROWS, passes: int = 3, linear=F.linear) -> list[dict]:
    """Per row count M: the best time of one pass of `linear` (F.linear, or the engine's
    oneDNN call) over every projection, MLP and head weight of `model` (inputs [1, M, in]),
    with its bandwidth and FLOP rate, and the largest difference of its output from
    `F.linear`'s on the first weight."""
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    total = sum(w.numel() * w.element_size() for w in weights)
    flops_per_row = 2 * sum(w.numel() for w in weights)
    out = []
    with torch.inference_mode():
        for m in rows:
            inputs = {w.shape[1]: torch.randn(1, m, w.shape[1]) for w in weights}
            best = float("inf")
            for _ in range(passes):
                start = time.perf_counter()
                for w in weights:
                    linear(inputs[w.shape[1]], w, None)
                best = min(best, time.perf_counter() - start)
            x, w = inputs[weights[0].shape[1]], weights[0]
            apart = (linear(x, w, None) - F.linear(x, w)).abs().max().item()
            out.append(dict(rows=m, ms=round(best * 1e3, 1), gb_per_s=round(total / best / 1e9, 1),
                            gflop_per_s=round(flops_per_row * m / best / 1e9), max_diff=apart))
            print(f"  {m:3d} rows: {out[-1]['ms']:7.1f} ms per pass, {out[-1]['gb_per_s']:5.1f} "
                  f"GB/s of weights, {out[-1]['gflop_per_s']:4d} GFLOP/s"
                  + (f"; largest difference from F.linear {apart:.2g}" if apart else ""),
                  flush=True)
    return out


def packed_passes(model, rows=ROWS, passes: int = 3) -> list[dict]:
    """`weight_passes` with MKL's packed-weight GEMM (each weight packed once per row count,
    outside the timing, as a runtime that packed weights would hold them), and the largest
    difference of its output from `F.linear`'s on the first weight. An empty list where
    this torch has no MKL."""
    if not (torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")):
        return []
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    out = []
    with torch.inference_mode():
        for m in rows:
            inputs = {w.shape[1]: torch.randn(m, w.shape[1]) for w in weights}
            packed = [torch.ops.mkl._mkl_reorder_linear_weight(w, m) for w in weights]
            best = float("inf")
            for _ in range(passes):
                start = time.perf_counter()
                for w, p in zip(weights, packed):
                    torch.ops.mkl._mkl_linear(inputs[w.shape[1]], p, w, None, m)
                best = min(best, time.perf_counter() - start)
            x, w = inputs[weights[0].shape[1]], weights[0]
            apart = (torch.ops.mkl._mkl_linear(x, packed[0], w, None, m) - F.linear(x, w))
            out.append(dict(rows=m, ms=round(best * 1e3, 1), max_diff=apart.abs().max().item()))
            print(f"  {m:3d} rows: {out[-1]['ms']:7.1f} ms per pass; largest difference from "
                  f"F.linear {out[-1]['max_diff']:.2g}", flush=True)
    return out


def bit_identical_row_counts(in_features: int = 1024, out_features: int = 2816, most: int = 40):
    """The row counts M (1..`most`) whose M-row `F.linear` gives, bit for bit, the first M
    rows of the same call over `most` rows."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, most, in_features, generator=g)
    w = torch.randn(out_features, in_features, generator=g)
    with torch.inference_mode():
        full = F.linear(x, w)[0]
        same = [m for m in range(1, most + 1) if torch.equal(F.linear(x[:, :m], w)[0], full[:m])]
    return same


def trace_forwards(**options) -> dict:
    """The tight trace on the engine (with `options`): forwards by kind and row count, with
    their mean time."""
    import bench_engine
    from hf_paged.engine import runner

    counts, seconds = collections.Counter(), collections.Counter()
    forward = runner.ModelRunner.forward

    def timed(self, f, check=None):
        start = time.perf_counter()
        try:
            return forward(self, f, check)
        finally:
            key = len(f.ids) if f.counts.count(1) == len(f.counts) else "with prompt chunks"
            counts[key] += 1
            seconds[key] += time.perf_counter() - start

    runner.ModelRunner.forward = timed
    try:
        model = random_llama()
        requests = bench_engine.workload(128, model.config.vocab_size, seed=0)
        budget = bench_engine.static_peak_tokens(requests, 16) * bench_engine._bytes_per_token(model)
        row = bench_engine.run_engine(model, requests, budget, 16, **options)
    finally:
        runner.ModelRunner.forward = forward
    print(f"  engine: {row['seconds']:.1f} s, {sum(counts.values())} forwards")
    for key in sorted(counts, key=lambda k: (isinstance(k, str), k)):
        label = f"decode, {key:2d} rows" if isinstance(key, int) else key
        print(f"  {label:20s} {counts[key]:4d} forwards, {seconds[key] / counts[key] * 1e3:6.1f} ms "
              f"each, {seconds[key]:5.1f} s in all")
    return dict(seconds=row["seconds"], forwards={str(k): [counts[k], seconds[k]] for k in counts})


def _ranges(values: list[int]) -> str:
    """[1, 2, 3, 7] -> "1..3, 7"."""
    runs: list[list[int]] = []
    for v in values:
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return ", ".join(f"{a}..{b}" if b > a else f"{a}" for a, b in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", action="store_true",
                        help="also run the tight trace, with the engine's oneDNN linear layers "
                             "and without (~4 min)")
    args = parser.parse_args()
    print(f"F.linear over the 168M Llama's weights, float32, threads {torch.get_num_threads()}:")
    model = random_llama()
    weight_passes(model)
    if cpu_linear.available():
        print("oneDNN's matmul over the same weights (what the engine's forwards run: "
              "hf/linear.py):")
        weight_passes(model, linear=cpu_linear.linear)
    print("MKL's packed-weight GEMM over the same weights (not what the model's nn.Linear "
          "runs):")
    packed_passes(model) or print("  (this torch has no MKL)")
    same = set(bit_identical_row_counts())
    differ = [m for m in range(1, 41) if m not in same]
    print(f"  row counts whose rows differ (bits) from the same rows of a 40-row call: "
          f"{_ranges(differ) or 'none'}")
    if args.trace:
        for name, options in (("oneDNN linear layers (the default)", {}),
                              ("torch's linear layers", {"onednn_linear": False})):
            print(f"tight trace, engine forwards, {name}:")
            trace_forwards(**options)


if __name__ == "__main__":
    main()
