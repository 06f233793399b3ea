"""8-bit K/V blocks against bfloat16 ones, side by side in one process.

1. Capacity: blocks in the same `kv_cache_bytes`, and the sequences that run at once on a
   long-context workload (prompts of 1,500 to 2,000 tokens) with that budget, with the
   engine's throughput (a random Llama, head dim 64, bfloat16); and the largest batch of
   long prompts `generate()` runs with a pool of the same bytes (`max_kv_bytes`).
2. Accuracy: a byte-level Llama trained here for a few seconds on text found on this
   machine (Python's own sources), run in bfloat16: greedy agreement with bfloat16 KV over
   the first 32 tokens of each request, and the perplexity of held-out text (from the
   engine's prompt log-probabilities, whose prefill reads K/V back from the pool), for the
   engine and for `generate()`.

Run: python benchmarks/bench_kv_quant.py [--quick]
     python benchmarks/bench_kv_quant.py --accuracy-only --seeds 0,1,2,3,4 --prompts 128
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import sysconfig
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hf_paged  # noqa: E402,F401
from hf_paged import LLM, SamplingParams  # noqa: E402
from hf_paged.kv.quant import KV_CACHE_DTYPES  # noqa: E402

KINDS = ["auto", "int8", "fp8_e4m3", "fp8_e5m2"]


def llama(hidden, layers, heads, vocab, seed=0, dtype=torch.float32, max_len=4096):
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
        max_position_embeddings=max_len, bos_token_id=1, eos_token_id=2,
        pad_token_id=0)).to(dtype).eval()


def capacity(rows, quick):
    model = llama(256, 2, 4, 1000, dtype=torch.bfloat16)  # head dim 64
    budget = (8 if quick else 24) * 2**20
    rng = random.Random(0)
    count = 12 if quick else 32
    prompts = [[rng.randrange(3, 1000) for _ in range(rng.randint(1500, 2000))]
               for _ in range(count)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    print(f"capacity: {budget / 2**20:.0f} MiB of KV, {count} prompts of 1500-2000 tokens, "
          "16 new tokens each:", flush=True)
    base = None
    for kind in KINDS:
        llm = LLM(model, kv_cache_bytes=budget, kv_cache_dtype=kind, max_num_seqs=count,
                  max_num_batched_tokens=4096, admission_headroom=0)
        engine = llm.engine
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, params)
        peak, start = 0, time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
            peak = max(peak, engine.stats().running)
        seconds = time.perf_counter() - start
        row = dict(section="capacity", kv_cache_dtype=kind, blocks=engine.num_blocks,
                   bytes_per_token=engine.pool.bytes_per_token, peak_running=peak,
                   preemptions=engine.stats().num_preemptions, seconds=round(seconds, 2))
        base = base or row
        row["blocks_x"] = round(row["blocks"] / base["blocks"], 2)
        row["running_x"] = round(peak / base["peak_running"], 2)
        rows.append(row)
        print(f"  {kind:9s} {row['blocks']:5d} blocks (x{row['blocks_x']:.2f}), "
              f"{row['bytes_per_token']} B/token, at most {peak} running "
              f"(x{row['running_x']:.2f}), {row['preemptions']} preemptions, "
              f"{seconds:.1f} s", flush=True)
    generate_capacity(rows, model, budget, quick)


def generate_capacity(rows, model, budget, quick):
    """generate() with a pool of `budget` bytes: the largest batch of equal long prompts it
    runs (one row more raises KVCacheExhaustedError, before anything is written)."""
    length, new = (1000 if quick else 1500), 16
    print(f"capacity of generate(): {budget / 2**20:.0f} MiB of KV, batches of "
          f"{length}-token prompts, {new} new tokens each:", flush=True)
    base = None
    for kind in KINDS:
        config = {"kv_cache_dtype": kind, "max_kv_bytes": budget}

        def run(size):  # -> the cache's stats, or None when the pool ran out
            ids = torch.randint(3, 1000, (size, length),
                                generator=torch.Generator().manual_seed(size))
            cache = hf_paged.PagedCache(model.config, config)
            try:
                model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                               min_new_tokens=new, do_sample=False, pad_token_id=0,
                               past_key_values=cache)
            except hf_paged.KVCacheExhaustedError:
                return None
            return cache.memory_stats()

        stats = run(1)  # the pool's size in blocks, as generate() sized it
        blocks = stats.num_blocks
        batch = blocks // -(-(length + new) // stats.block_size)
        fits = {size: run(size) is not None for size in (batch, batch + 1)}
        largest = max(k for k, ok in fits.items() if ok) if any(fits.values()) else 0
        base = base or largest
        row = dict(section="generate_capacity", kv_cache_dtype=kind, blocks=blocks,
                   largest_batch=largest, batch_x=round(largest / base, 2),
                   one_more_fails=not fits[batch + 1])
        rows.append(row)
        print(f"  {kind:9s} {blocks:5d} blocks, largest batch {largest} "
              f"(x{row['batch_x']:.2f}; one more row: "
              f"{'KVCacheExhaustedError' if row['one_more_fails'] else 'ran'})", flush=True)


def corpus() -> bytes:
    """Text that is surely on this machine: the Python standard library's sources."""
    root = Path(sysconfig.get_paths()["stdlib"])
    names = ["textwrap.py", "argparse.py", "inspect.py", "typing.py", "dataclasses.py",
             "pathlib.py", "functools.py", "enum.py"]
    text = b"".join((root / n).read_bytes() for n in names if (root / n).exists())
    if len(text) < 200_000:
        raise SystemExit(f"found only {len(text)} bytes of text under {root}")
    return text


def train_text_model(text: bytes, steps: int, seed: int = 0):
    model = llama(128, 2, 2, 256, seed=seed, max_len=1024)  # head dim 64
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = torch.tensor(list(text), dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    start = time.perf_counter()
    with torch.enable_grad():
        for _ in range(steps):
            at = torch.randint(0, len(data) - 129, (32,), generator=g)
            batch = torch.stack([data[i:i + 129] for i in at.tolist()])
            loss = model(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
    print(f"accuracy: a byte-level Llama (hidden 128, 2 layers, head dim 64) trained "
          f"{steps} steps (seed {seed}) in {time.perf_counter() - start:.0f} s, loss "
          f"{loss.item():.2f}",
          flush=True)
    return model.eval().to(torch.bfloat16)


def accuracy(rows, quick, steps=None, seed=0, num_prompts=None):
    text = corpus()
    split = int(len(text) * 0.9)
    model = train_text_model(text[:split], steps or (150 if quick else 400), seed)
    held = text[split:]
    rng = random.Random(1)
    starts = [rng.randrange(0, len(held) - 600) for _ in range(num_prompts or (16 if quick else 48))]
    prompts = [list(held[s:s + 96]) for s in starts]
    scored = [list(held[s:s + 512]) for s in starts[:8]]
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    score = SamplingParams(max_tokens=1, prompt_logprobs=0)
    results = {}
    for kind in KINDS:
        llm = LLM(model, kv_cache_dtype=kind, num_blocks=2048)
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        nll, count = 0.0, 0
        for out in llm.generate(scored, score, use_tqdm=False):
            for token, entry in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
                nll -= entry[token]
                count += 1
        ids = torch.tensor(prompts)
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32,
                             do_sample=False, pad_token_id=0, eos_token_id=None,
                             cache_implementation="paged",
                             cache_config={"kv_cache_dtype": kind})[:, 96:].tolist()
        results[kind] = (tokens, math.exp(nll / count), gen)
    base_tokens, base_ppl, base_gen = results["auto"]
    # The floor: two correct bfloat16 implementations (Transformers' DynamicCache and SDPA
    # against the paged bfloat16 pool) differ by their own rounding alone.
    stock = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32,
                           do_sample=False, pad_token_id=0, eos_token_id=None)[:, 96:].tolist()
    total = 32 * len(prompts)
    floor = sum(sum(a == b for a, b in zip(t, r)) for t, r in zip(stock, base_tokens))
    rows.append(dict(section="accuracy", seed=seed, kv_cache_dtype="stock DynamicCache",
                     engine_greedy_agreement=round(floor / total, 4)))
    print(f"  stock Transformers (DynamicCache, bfloat16) agrees with the paged bfloat16 "
          f"pool on {floor / total:.3f}", flush=True)
    for kind in KINDS:
        tokens, ppl, gen = results[kind]
        agree = sum(sum(a == b for a, b in zip(t, r)) for t, r in zip(tokens, base_tokens))
        agree_gen = sum(sum(a == b for a, b in zip(t, r)) for t, r in zip(gen, base_gen))
        row = dict(section="accuracy", seed=seed, kv_cache_dtype=kind,
                   engine_greedy_agreement=round(agree / total, 4),
                   generate_greedy_agreement=round(agree_gen / total, 4),
                   perplexity=round(ppl, 4), perplexity_rise=round(ppl / base_ppl - 1, 4))
        rows.append(row)
        print(f"  {kind:9s} engine agreement {row['engine_greedy_agreement']:.3f}, "
              f"generate() agreement {row['generate_greedy_agreement']:.3f}, held-out "
              f"perplexity {ppl:.3f} ({100 * row['perplexity_rise']:+.2f}%)", flush=True)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller workloads")
    parser.add_argument("--out", help="also write the rows as JSON here")
    parser.add_argument("--train-steps", type=int,
                        help="training steps of the accuracy model (400; --quick: 150)")
    parser.add_argument("--accuracy-only", action="store_true",
                        help="skip the capacity section")
    parser.add_argument("--prompts", type=int,
                        help="greedy prompts of the accuracy section (48; --quick: 16)")
    parser.add_argument("--seeds", default="0",
                        help="comma-separated seeds of the accuracy model's weights and "
                             "batches: one model trained per seed (0)")
    args = parser.parse_args(argv)
    assert set(KINDS[1:]) <= set(KV_CACHE_DTYPES)
    rows: list[dict] = []
    print(f"threads {torch.get_num_threads()}", flush=True)
    if not args.accuracy_only:
        capacity(rows, args.quick)
    seeds = [int(x) for x in args.seeds.split(",")]
    for seed in seeds:
        accuracy(rows, args.quick, args.train_steps, seed, args.prompts)
    if len(seeds) > 1:
        for kind in ["stock DynamicCache", *KINDS[1:]]:
            mine = [r for r in rows if r.get("kv_cache_dtype") == kind]
            each = [r["engine_greedy_agreement"] for r in mine]
            rises = [r["perplexity_rise"] for r in mine if "perplexity_rise" in r]
            worst = f", largest perplexity rise {100 * max(rises):+.2f}%" if rises else ""
            print(f"  {kind:9s} over seeds {args.seeds}: mean engine agreement "
                  f"{sum(each) / len(each):.3f} (each: {', '.join(f'{a:.3f}' for a in each)})"
                  f"{worst}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
