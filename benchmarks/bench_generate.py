"""generate() with the paged cache vs Transformers' caches, side by side in one process.

    python benchmarks/bench_generate.py            # the README workloads (~160M Llama, CPU)
    python benchmarks/bench_generate.py --quick    # a small smoke run

Sections (--sections, default all):
  padded:   8 left-padded prompts of 20..500 tokens, greedy: paged vs DynamicCache vs
            StaticCache vs Transformers' continuous batching.
  beam:     2 prompts of 512 tokens, num_beams=4: paged vs DynamicCache.
  sampling: 2 prompts of 512 tokens, num_return_sequences=4: paged vs DynamicCache.
Every method runs on the same model and inputs with EOS disabled, so each row generates
exactly --new-tokens tokens. Reported: generated tokens/s (whole call, best of --repeats
after an untimed round, methods interleaved), KV bytes, and ratios to DynamicCache.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from transformers import GenerationConfig

sys.path.insert(0, os.path.dirname(__file__))
import hf_paged  # noqa: E402
from common import (cache_tensor_bytes, check_device, left_padded, random_llama,  # noqa: E402
                    timed)


def run_generate(model, ids, mask, new_tokens, **kw):
    return model.generate(
        ids.to(model.device), attention_mask=mask.to(model.device), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
        do_sample=False, return_dict_in_generate=True, **kw,
    )


def run_continuous_batching(model, ids, mask, new_tokens):
    prompts = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1)
    out = model.generate_batch(inputs=prompts, generation_config=config, persistent_manager=True,
                               progress_bar=False)
    manager = model._cached_continuous_batching_manager
    cache = manager.batch_processor.cache
    kv_bytes = cache.cache_tensor.numel() * cache.cache_tensor.element_size()
    model.destroy_cached_continuous_batching_manager()
    return out, kv_bytes


def bench_padded(model, args):
    cfg = model.config
    if args.quick:
        lengths = [5, 9, 14, 20, 27, 33, 41, 50]
    else:
        lengths = [round(20 + i * (500 - 20) / 7) for i in range(8)]
    ids, mask = left_padded(lengths, cfg.vocab_size)
    new = args.new_tokens
    bytes_per_token = _bytes_per_token(cfg, model.dtype)
    real_tokens = sum(lengths) + len(lengths) * (new - 1)  # the last token is never fed back
    print(f"== padded: {len(lengths)} prompts, lengths {lengths}, {new} new tokens, greedy")
    print(f"real tokens at the end: {real_tokens} ({real_tokens * bytes_per_token / 2**20:.1f} MiB of K+V)")

    methods = {
        "dynamic": lambda: run_generate(model, ids, mask, new),
        "static": lambda: run_generate(model, ids, mask, new, cache_implementation="static"),
        "paged": lambda: run_generate(model, ids, mask, new, cache_implementation="paged"),
    }
    results, outputs = _interleaved(methods, args.repeats)
    stats = outputs["paged"].past_key_values.memory_stats()
    kv = {
        "dynamic": cache_tensor_bytes(outputs["dynamic"].past_key_values),
        "static": cache_tensor_bytes(outputs["static"].past_key_values),
        "paged": stats.pool_bytes,
    }
    same = {name: bool((outputs[name].sequences == outputs["dynamic"].sequences).all().item())
            for name in outputs}
    if not args.no_cb:
        cb_times = []
        for _ in range(args.repeats):
            (cb_out, cb_bytes), seconds = timed(lambda: run_continuous_batching(model, ids, mask, new))
            cb_times.append(seconds)
        results["continuous_batching"] = min(cb_times)
        kv["continuous_batching"] = cb_bytes
        cb_seqs = [cb_out[f"req_{i}"].generated_tokens for i in range(len(lengths))]
        ref = outputs["dynamic"].sequences[:, ids.shape[1]:].cpu().tolist()
        same["continuous_batching"] = cb_seqs == ref

    real_bytes = real_tokens * bytes_per_token
    print(f"{'method':<22}{'tokens/s':>10}{'x dynamic':>11}{'KV MiB':>10}{'x dynamic':>11}"
          f"{'real/KV':>9}  same tokens as dynamic")
    for name, seconds in results.items():
        tps = len(lengths) * new / seconds
        base_tps = len(lengths) * new / results["dynamic"]
        print(f"{name:<22}{tps:>10.1f}{tps / base_tps:>11.2f}{kv[name] / 2**20:>10.1f}"
              f"{kv[name] / kv['dynamic']:>11.2f}{real_bytes / kv[name]:>9.2f}  {same[name]}")
    print(f"paged: utilization {stats.utilization:.3f} (tokens_stored {stats.tokens_stored} / "
          f"{stats.blocks_in_use} blocks x {stats.block_size}), peak blocks "
          f"{stats.peak_blocks_in_use}, pool {stats.num_blocks} blocks")
    print(f"paged: pool bytes / bytes of peak stored tokens = "
          f"{stats.pool_bytes / (stats.tokens_stored * stats.bytes_per_token):.3f}")
    print()


def bench_shared(model, args, mode):
    """Beam search or parallel sampling: rows of one prompt share its blocks."""
    cfg = model.config
    prompt = 48 if args.quick else 512
    ids, mask = left_padded([prompt, prompt], cfg.vocab_size, seed=1)
    new, e = args.new_tokens, 4
    if mode == "beam":
        kw = dict(num_beams=e, early_stopping=False)
        title = f"num_beams={e}"
    else:
        kw = dict(num_return_sequences=e, do_sample=True, top_k=50)
        title = f"num_return_sequences={e}, sampling"
    print(f"== {mode}: 2 prompts of {prompt} tokens, {title}, {new} new tokens")

    def call(**extra):
        torch.manual_seed(0)
        return model.generate(ids.to(model.device), attention_mask=mask.to(model.device),
                              max_new_tokens=new, min_new_tokens=new,
                              return_dict_in_generate=True, **kw, **extra)

    methods = {"dynamic": call, "paged": lambda: call(cache_implementation="paged")}
    results, outputs = _interleaved(methods, args.repeats)
    stats = outputs["paged"].past_key_values.memory_stats()
    dyn_bytes = cache_tensor_bytes(outputs["dynamic"].past_key_values)
    paged_peak = stats.peak_kv_bytes
    same = bool((outputs["paged"].sequences == outputs["dynamic"].sequences).all().item())
    rows = ids.shape[0] * (e if mode == "sampling" else 1)
    tps = {name: rows * new / seconds for name, seconds in results.items()}
    print(f"{'method':<22}{'tokens/s':>10}{'x dynamic':>11}{'peak KV MiB':>13}{'x dynamic':>11}")
    print(f"{'dynamic':<22}{tps['dynamic']:>10.1f}{1.0:>11.2f}{dyn_bytes / 2**20:>13.1f}{1.0:>11.2f}")
    print(f"{'paged':<22}{tps['paged']:>10.1f}{tps['paged'] / tps['dynamic']:>11.2f}"
          f"{paged_peak / 2**20:>13.1f}{paged_peak / dyn_bytes:>11.2f}")
    print(f"paged: same tokens as dynamic: {same}; at the end {stats.tokens_stored} distinct tokens "
          f"stored for {stats.logical_tokens} row tokens ({stats.shared_blocks} shared blocks); "
          f"prompt tokens stored: {2 * prompt} of {2 * e * prompt} in the rows")
    print()


def _bytes_per_token(cfg, dtype) -> int:
    return (cfg.num_hidden_layers * 2 * cfg.num_key_value_heads
            * (cfg.hidden_size // cfg.num_attention_heads) * dtype.itemsize)


def _interleaved(methods, repeats):
    """Best time of each method over `repeats` rounds, methods interleaved within a round,
    after an untimed round: compiles for this section's shapes (Triton's JIT for each new
    specialization on a GPU, torch.compile for the static cache) stay out of the timings."""
    results, outputs = {}, {}
    for fn in methods.values():
        fn()
    for _ in range(repeats):
        for name, fn in methods.items():
            out, seconds = timed(fn)
            outputs[name] = out
            results[name] = min(results.get(name, float("inf")), seconds)
    return results, outputs


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model and prompts (smoke test)")
    parser.add_argument("--new-tokens", type=int, default=64,
                        help="tokens generated per row, EOS disabled (default 64)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="runs of each method, interleaved; the best counts (default 2)")
    parser.add_argument("--no-cb", action="store_true", help="skip Transformers' continuous batching")
    parser.add_argument("--sections", default="padded,beam,sampling",
                        help="comma-separated subset of padded, beam, sampling (default: all)")
    parser.add_argument("--device", default="cpu", help="device of the model (default cpu)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="model and cache dtype (default float32)")
    args = parser.parse_args()
    check_device(args.device)
    dtype = getattr(torch, args.dtype)
    if args.quick:
        model = random_llama(hidden=128, layers=2, heads=4, kv_heads=4, intermediate=256, vocab=512,
                             dtype=dtype)
        args.new_tokens = min(args.new_tokens, 16)
    else:
        model = random_llama(dtype=dtype)
    model = model.to(args.device)
    cfg = model.config
    n_params = sum(p.numel() for p in model.parameters())
    where = (torch.cuda.get_device_name(args.device) if args.device.startswith("cuda")
             else f"CPU threads {torch.get_num_threads()}")
    print(f"model: random Llama, {n_params / 1e6:.3g}M params, hidden {cfg.hidden_size}, "
          f"{cfg.num_hidden_layers} layers, {args.dtype}, {where}")
    ids, mask = left_padded([8, 5], cfg.vocab_size)
    run_generate(model, ids, mask, 4)  # warm-up, outside the timings
    run_generate(model, ids, mask, 4, cache_implementation="paged")
    print()
    sections = args.sections.split(",")
    if "padded" in sections:
        bench_padded(model, args)
    for mode in ("beam", "sampling"):
        if mode in sections:
            bench_shared(model, args, mode)


if __name__ == "__main__":
    main()
