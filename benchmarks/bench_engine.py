"""The continuous-batching engine against static batching and Transformers' own continuous
batching, side by side in one process: same model, same requests, same KV memory budget.

    python benchmarks/bench_engine.py              # 128 requests, ~168M random Llama, CPU
    python benchmarks/bench_engine.py --quick      # a smoke run in seconds
    python benchmarks/bench_engine.py --tight      # KV budget of a static batch's peak

Requests: prompt and output lengths drawn from long-tailed (log-normal) distributions, like
ShareGPT conversations: prompts median ~200 tokens (16..1024), outputs median ~80 tokens
(16..256); every output has its fixed length (EOS ignored) and all requests arrive at once.
Rows:
  engine          hf_paged.LLM (continuous batching, chunked prefill, prefix caching)
  engine-torch-linears  the same, linear layers as torch runs them (MKL; the engine's default
                  runs a float32 CPU model's large ones through oneDNN)
  engine-cuda-graphs  the same, decode steps replayed from CUDA graphs (GPU; not by default)
  transformers-cb Transformers' continuous batching (its manager, per-request max_new_tokens)
  static-dynamic  model.generate in static batches of 8, DynamicCache (arrival order)
  static-paged    model.generate in static batches of 8, cache_implementation="paged"
Static batches generate to the longest output of their batch; only each request's own
tokens count. A second section repeats the engine with half the requests sharing a
512-token prefix (a system prompt), with and without prefix caching.

--tight gives every method the KV budget a static batch of 8 needs at its peak (each row's
prompt plus the batch's longest output, in blocks) and compares the engine's admission and
preemption policies on it: headroom kept at admission (the default) or none, recompute or
swap.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import check_device, random_llama  # noqa: E402

import hf_paged  # noqa: E402
from hf_paged import LLM, SamplingParams  # noqa: E402


def workload(count: int, vocab: int, seed: int, shared_prefix: int = 0):
    """[(prompt ids, output length)]: log-normal lengths, clipped as ShareGPT filters do."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, vocab) for _ in range(shared_prefix)]
    requests = []
    for i in range(count):
        prompt_len = min(1024, max(16, int(rng.lognormvariate(math.log(200), 0.9))))
        out_len = min(256, max(16, int(rng.lognormvariate(math.log(80), 0.8))))
        prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
        if shared_prefix and i % 2 == 0:
            prompt = prefix + prompt[:max(16, prompt_len - shared_prefix)]
        requests.append((prompt, out_len))
    return requests


def static_peak_tokens(requests, block_size: int, batch: int = 8) -> int:
    """KV tokens (whole blocks) a static batch of `batch` holds at its end: each row's prompt
    plus the batch's longest output."""
    peak = 0
    for first in range(0, len(requests), batch):
        group = requests[first:first + batch]
        new = max(n for _, n in group)
        peak = max(peak, sum(-(-(len(p) + new) // block_size) for p, _ in group) * block_size)
    return peak


def run_engine(model, requests, budget_bytes, block_size, **options):
    llm = LLM(model, block_size=block_size, kv_cache_bytes=budget_bytes, **options)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in requests]
    start = time.perf_counter()
    outs = llm.generate([p for p, _ in requests], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    stats = llm.stats()
    peak = stats.num_blocks * stats.block_size  # the pool is allocated up front
    return dict(seconds=seconds, tokens=[o.outputs[0].token_ids for o in outs],
                kv_bytes=llm.engine.pool.nbytes, preemptions=stats.num_preemptions,
                prefix_hit_tokens=stats.prefix_cache_hit_tokens, pool_tokens=peak,
                recomputed=stats.recomputed_tokens)


def run_transformers_cb(model, requests, budget_bytes, block_size):
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    per_token = _bytes_per_token(model)
    blocks = budget_bytes // (per_token * block_size)
    config = GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=256)
    cb = ContinuousBatchingConfig(page_size=block_size, num_blocks=blocks)
    results = {}
    start = time.perf_counter()
    with model.continuous_batching_context_manager(generation_config=config,
                                                   continuous_batching_config=cb, block=True,
                                                   timeout=30) as manager:
        ids = [manager.add_request(p, request_id=f"r{i}", max_new_tokens=n, eos_token_id=-1)
               for i, (p, n) in enumerate(requests)]
        while len(results) < len(ids):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                results[result.request_id] = result.generated_tokens
            elif result is None and not manager.is_running():
                break
        cache = manager.batch_processor.cache
        kv_bytes = getattr(cache, "cache_tensor", None)
        kv_bytes = kv_bytes.numel() * kv_bytes.element_size() if kv_bytes is not None else None
    seconds = time.perf_counter() - start
    model.config._attn_implementation_internal = "sdpa"
    return dict(seconds=seconds, tokens=[results.get(i, []) for i in ids], kv_bytes=kv_bytes,
                preemptions=None)


def run_static(model, requests, budget_bytes, block_size, paged: bool, batch: int = 8):
    from common import cache_tensor_bytes

    tokens, peak = [], 0
    start = time.perf_counter()
    for first in range(0, len(requests), batch):
        group = requests[first:first + batch]
        width = max(len(p) for p, _ in group)
        ids = torch.zeros(len(group), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, (p, _) in enumerate(group):
            ids[r, width - len(p):] = torch.tensor(p)
            mask[r, width - len(p):] = 1
        new = max(n for _, n in group)
        extra = {}
        if paged:
            extra = dict(cache_implementation="paged",
                         cache_config={"block_size": block_size,
                                       "max_kv_bytes": budget_bytes})
        out = model.generate(ids.to(model.device), attention_mask=mask.to(model.device),
                             max_new_tokens=new, min_new_tokens=new, do_sample=False,
                             eos_token_id=None, pad_token_id=0, return_dict_in_generate=True,
                             **extra)
        cache = out.past_key_values
        if paged:
            stats = cache.memory_stats()
            peak = max(peak, stats.peak_blocks_in_use * stats.block_size * stats.bytes_per_token)
        else:
            peak = max(peak, cache_tensor_bytes(cache))
        for r, (_, n) in enumerate(group):
            tokens.append(out.sequences[r, width:width + n].tolist())
        del out, cache
    return dict(seconds=time.perf_counter() - start, tokens=tokens, kv_bytes=peak, preemptions=None)


def _bytes_per_token(model) -> int:
    from hf_paged.hf.architectures import kv_layout

    layers, heads, dim = kv_layout(model.config)
    return layers * 2 * heads * dim * torch.tensor([], dtype=model.dtype).element_size()


class _TimedModel:
    """Stands in for the engine's model: accumulates the seconds spent inside its calls
    (synchronizing a CUDA device so that the time is the forward's own)."""

    def __init__(self, model):
        self.__dict__["_model"], self.__dict__["seconds"] = model, 0.0

    def __call__(self, *args, **kwargs):
        cuda = self._model.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = self._model(*args, **kwargs)
        if cuda:
            torch.cuda.synchronize()
        self.__dict__["seconds"] += time.perf_counter() - start
        return out

    def __getattr__(self, name):
        return getattr(self._model, name)


class _Paused:
    """Stands in for the engine's model: `profile` is paused while the model runs."""

    def __init__(self, model, profile):
        self.__dict__.update(_model=model, _profile=profile)

    def __call__(self, *args, **kwargs):
        self._profile.disable()
        try:
            return self._model(*args, **kwargs)
        finally:
            self._profile.enable()

    def __getattr__(self, name):
        return getattr(self._model, name)


def host_overhead(model, counts=(64, 128, 256), prompt_len=16, new_tokens=64, **options):
    """Per engine step, the time outside the model's forward per scheduled sequence: every
    request (a random prompt of `prompt_len` tokens, `new_tokens` greedy tokens) arrives at
    once and all run together; steps whose sequences all decode are measured."""
    rows = []
    vocab = model.config.vocab_size
    for count in counts:
        rng = random.Random(count)
        llm = LLM(model, max_num_seqs=count, max_num_batched_tokens=count * prompt_len,
                  kv_cache_bytes=_bytes_per_token(model) * count * (prompt_len + new_tokens + 32),
                  **options)
        engine = llm.engine
        engine.finished_only = True  # as LLM.generate runs it
        timed = _TimedModel(engine.runner.base)
        # The runner calls `base` (the model without a PEFT wrapper) when no adapter is
        # loaded; versions before it called `model` (for runs on another checkout).
        engine.runner.model = engine.runner.base = timed
        params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        for i in range(count):
            engine.add_request(f"h{i}", [rng.randrange(3, vocab) for _ in range(prompt_len)],
                               params)
        host = forward = 0.0
        steps = scheduled = 0
        while engine.has_unfinished_requests():
            decoding = len(engine.scheduler.running)
            timed.seconds = 0.0
            start = time.perf_counter()
            engine.step()
            total = time.perf_counter() - start
            if decoding == count and engine.scheduler.running:  # a decode step, none ended
                host += total - timed.seconds
                forward += timed.seconds
                steps += 1
                scheduled += count
        rows.append(dict(seqs=count, steps=steps, step_ms=round((host + forward) / steps * 1e3, 2),
                         forward_ms=round(forward / steps * 1e3, 2),
                         host_ms=round(host / steps * 1e3, 2),
                         host_us_per_seq=round(host / scheduled * 1e6, 2)))
        print(f"  {count:4d} sequences: step {rows[-1]['step_ms']:8.2f} ms, forward "
              f"{rows[-1]['forward_ms']:8.2f} ms, host {rows[-1]['host_ms']:7.2f} ms = "
              f"{rows[-1]['host_us_per_seq']:6.2f} us per sequence", flush=True)
    return rows


def python_calls(model, counts=(64, 256), prompt_len=16, new_tokens=64):
    """Python function calls per sequence per decode step outside the model's forward
    (cProfile's count, paused during the forward): the host-overhead workload, counted
    rather than timed, so that runs on a noisy machine compare exactly."""
    import cProfile
    import pstats

    rows = []
    for count in counts:
        rng = random.Random(count)
        llm = LLM(model, max_num_seqs=count, max_num_batched_tokens=count * prompt_len,
                  kv_cache_bytes=_bytes_per_token(model) * count * (prompt_len + new_tokens + 32))
        engine, profile = llm.engine, cProfile.Profile()
        engine.finished_only = True
        paused = _Paused(engine.runner.base, profile)
        engine.runner.model = engine.runner.base = paused  # (as in host_overhead)
        params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        for i in range(count):
            engine.add_request(f"c{i}", [rng.randrange(3, model.config.vocab_size)
                                         for _ in range(prompt_len)], params)
        engine.step()  # the prompts
        steps = 0
        while len(engine.scheduler.running) == count:  # decode steps, nobody finished
            profile.enable()
            engine.step()
            profile.disable()
            steps += 1
        calls = pstats.Stats(profile).total_calls / steps / count
        rows.append(dict(seqs=count, steps=steps, python_calls_per_seq=round(calls, 2)))
        print(f"  {count:4d} sequences: {calls:6.2f} Python calls per sequence per step "
              f"({steps} decode steps)", flush=True)
    return rows


def throughput(model, counts=(64, 256), prompt_len=16, new_tokens=64, runs=5, **options):
    """`LLM.generate` output tokens/s (best of `runs`) of the host-overhead workload. The
    engine options this checkout's LLM takes only (run it on another checkout with
    PYTHONPATH=that/checkout, interleaved, to compare versions)."""
    rows = []
    for count in counts:
        rng = random.Random(count)
        prompts = [[rng.randrange(3, model.config.vocab_size) for _ in range(prompt_len)]
                   for _ in range(count)]
        llm = LLM(model, max_num_seqs=count, max_num_batched_tokens=count * prompt_len,
                  kv_cache_bytes=_bytes_per_token(model) * count * (prompt_len + new_tokens + 32),
                  **options)
        params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        best = float("inf")
        for _ in range(runs):
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            best = min(best, time.perf_counter() - start)
        rows.append(dict(requests=count, tokens_per_s=round(count * new_tokens / best)))
        graphs = getattr(getattr(llm.engine, "runner", None), "graphs", None)  # (older: none)
        if graphs is not None:
            rows[-1]["graphs"] = graphs.stats()
        print(f"  {count:4d} requests x {new_tokens} tokens: {rows[-1]['tokens_per_s']:8,d} "
              f"output tokens/s (best of {runs})"
              + (f"; graphs {rows[-1]['graphs']}" if graphs is not None else ""), flush=True)
    return rows


def compiled_by_pool_size(model, count=64, scales=(1, 32), prompt_len=16, new_tokens=64,
                          runs=4):
    """`LLM.generate` output tokens/s (best of `runs`), eager and `compile=True`, with the
    throughput workload's KV budget times each of `scales`: a compiled step's cost must not
    grow with the pool (run another checkout on PYTHONPATH to compare versions)."""
    rng = random.Random(count)
    prompts = [[rng.randrange(3, model.config.vocab_size) for _ in range(prompt_len)]
               for _ in range(count)]
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    rows = []
    for compile in (False, True):
        for scale in scales:
            llm = LLM(model, max_num_seqs=count, max_num_batched_tokens=count * prompt_len,
                      compile=compile, kv_cache_bytes=_bytes_per_token(model) * count
                      * (prompt_len + new_tokens + 32) * scale)
            best = float("inf")
            for _ in range(runs):  # (the first compiles)
                start = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                best = min(best, time.perf_counter() - start)
            rows.append(dict(compile=compile, blocks=llm.engine.runner.pool.shards[0].shape[2],
                             tokens_per_s=round(count * new_tokens / best)))
            print(f"  compile={compile!s:5} {rows[-1]['blocks']:6,d} blocks: "
                  f"{rows[-1]['tokens_per_s']:8,d} output tokens/s (best of {runs})", flush=True)
            torch._dynamo.reset()
    return rows


def tiny_llama(device="cpu", dtype=torch.float32):
    """The host-overhead model: hidden 64, 2 layers (its forward is cheap)."""
    return random_llama(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=1000,
                        dtype=dtype, device=device)


def report(name, row, requests, reference):
    useful = sum(n for _, n in requests)
    same = row["tokens"] == reference if reference is not None else None
    kv = row.get("kv_bytes")
    return dict(method=name, seconds=round(row["seconds"], 2),
                tokens_per_s=round(useful / row["seconds"], 2),
                requests_per_s=round(len(requests) / row["seconds"], 3),
                kv_mib=round(kv / 2**20, 1) if kv else None,
                preemptions=row.get("preemptions"),
                prefix_hit_tokens=row.get("prefix_hit_tokens"),
                recomputed_tokens=row.get("recomputed"), same_tokens=same)


def print_table(rows, base="static-dynamic"):
    ref = next((r for r in rows if r["method"] == base), rows[0])
    base = ref["method"]  # (the ratios are to the first row when `base` did not run)
    width = max(20, len(base) + 4)
    print(f"{'method':30}{'s':>9}{'tok/s':>9}{'x ' + base:>{width}}{'req/s':>8}{'KV MiB':>9}"
          f"{'preempt':>9}{'recomputed':>11}{'prefix hit':>11}  same")
    for r in rows:
        ratio = r["tokens_per_s"] / ref["tokens_per_s"]
        print(f"{r['method']:30}{r['seconds']:>9}{r['tokens_per_s']:>9}{ratio:>{width}.2f}"
              f"{r['requests_per_s']:>8}{str(r['kv_mib']):>9}{str(r['preemptions']):>9}"
              f"{str(r['recomputed_tokens']):>11}{str(r['prefix_hit_tokens']):>11}  "
              f"{r['same_tokens']}")


def main():
    if "--speculative" in sys.argv:  # speculative decoding: options of its own
        import bench_speculative
        return bench_speculative.main([a for a in sys.argv[1:] if a != "--speculative"])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model and 16 requests")
    parser.add_argument("--requests", type=int, default=128, help="number of requests (128)")
    parser.add_argument("--kv-mib", type=int, default=768,
                        help="KV memory budget of every method, MiB (768)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block (16)")
    parser.add_argument("--methods", default="engine,engine-torch-linears,transformers-cb,"
                        "static-dynamic,static-paged",
                        help="comma-separated subset of the rows (default: all)")
    parser.add_argument("--no-prefix-section", action="store_true",
                        help="skip the shared-prefix section")
    parser.add_argument("--no-policy-rows", action="store_true",
                        help="with --tight: skip the no-headroom, swap and int8 KV rows")
    parser.add_argument("--device", default="cpu", help="device of the model (cpu)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="model and KV dtype (float32)")
    parser.add_argument("--model-size", default="168m", choices=["168m", "7b"],
                        help="random Llama shape: ~168M (hidden 1024, 8 layers) or Llama-7B-like")
    parser.add_argument("--max-num-batched-tokens", type=int,
                        help="the engine rows' token budget per step (the engine's default)")
    parser.add_argument("--out", help="also write the rows as JSON here")
    for flag, text in (
            ("--python-calls", "only count Python calls per sequence per decode step outside "
                               "the forward (tiny model, 64 and 256 sequences)"),
            ("--tight", "KV budget of a static batch's peak; the engine's admission and "
                        "preemption policies against Transformers' continuous batching"),
            ("--async-scheduling", "the engine rows (and the host-overhead report) with "
                                   "async_scheduling=True"),
            ("--compile", "with --throughput: LLM(compile=True) (the first of the runs "
                          "compiles)"),
            ("--host-overhead", "only the host-overhead report: time per step outside the "
                                "forward, per sequence, at 64/128/256 sequences, tiny and 168M "
                                "models"),
            ("--speculative", "only speculative decoding, with and without (see "
                              "bench_speculative.py --help for its options)"),
            ("--throughput", "only LLM.generate tokens/s of the host-overhead workload (tiny "
                             "model, 64 and 256 requests; PYTHONPATH=other/checkout to compare)"),
            ("--compile-pool", "only LLM.generate tokens/s of the tiny model at 64 "
                               "requests, eager and compile=True, with the throughput "
                               "workload's KV budget and 32 times it"),
            ("--cuda-graphs", "only the --throughput workload without and with CUDA graphs, "
                              "with their capture time and memory (GPU)")):
        parser.add_argument(flag, action="store_true", help=text)
    args = parser.parse_args()
    check_device(args.device, needs_cuda=args.cuda_graphs)
    dtype = getattr(torch, args.dtype)
    overlap = dict(async_scheduling=True) if args.async_scheduling else {}
    if args.python_calls:
        print("Python calls outside the forward, tiny Llama:", flush=True)
        rows = python_calls(tiny_llama(dtype=dtype, device=args.device))
        if args.out:
            Path(args.out).write_text(json.dumps(rows, indent=2))
        return
    if args.compile_pool:
        print(f"LLM.generate, tiny Llama, hf_paged from {Path(hf_paged.__file__).parent}:",
              flush=True)
        rows = compiled_by_pool_size(tiny_llama(dtype=dtype, device=args.device))
        if args.out:
            Path(args.out).write_text(json.dumps(rows, indent=2))
        return
    if args.cuda_graphs:
        model, rows = tiny_llama(dtype=dtype, device=args.device), []
        for graphs in (False, True):
            print(f"LLM.generate, tiny Llama, cuda_graphs={graphs}:", flush=True)
            for row in throughput(model, runs=3, cuda_graphs=graphs, **overlap):
                rows.append(dict(row, cuda_graphs=graphs))
        if args.out:
            Path(args.out).write_text(json.dumps(rows, indent=2))
        return
    if args.throughput:
        print(f"LLM.generate, tiny Llama, hf_paged from {Path(hf_paged.__file__).parent}:",
              flush=True)
        compiled = dict(compile=True) if args.compile else {}
        rows = throughput(tiny_llama(dtype=dtype, device=args.device), **overlap, **compiled)
        if args.out:
            Path(args.out).write_text(json.dumps(rows, indent=2))
        return
    if args.host_overhead:
        rows = {}
        for name, build in (("tiny (hidden 64, 2 layers)", tiny_llama),
                            ("168M (hidden 1024, 8 layers)", random_llama)):
            if args.quick and name.startswith("168M"):
                continue
            print(f"host overhead, {name}, {args.dtype}, {args.device}, threads "
                  f"{torch.get_num_threads()}:", flush=True)
            rows[name] = host_overhead(build(dtype=dtype, device=args.device),
                                       counts=(16, 32) if args.quick else (64, 128, 256),
                                       **overlap)
        if args.out:
            Path(args.out).write_text(json.dumps(rows, indent=2))
        return
    if args.quick:
        model = random_llama(hidden=128, layers=2, heads=4, kv_heads=4, intermediate=256,
                             vocab=1000, dtype=dtype, device=args.device)
        args.requests, args.kv_mib = 16, 16
    elif args.model_size == "7b":
        model = random_llama(hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=11008,
                             dtype=dtype, device=args.device)
    else:
        model = random_llama(dtype=dtype, device=args.device)
    budget = args.kv_mib * 2**20
    vocab = model.config.vocab_size
    requests = workload(args.requests, vocab, seed=0)
    if args.tight:
        tokens = static_peak_tokens(requests, args.block_size)
        budget = tokens * _bytes_per_token(model)
        args.kv_mib = round(budget / 2**20, 1)
        print(f"tight budget: {tokens} KV tokens, a static batch of 8's peak")
    print(f"model: random Llama, {sum(p.numel() for p in model.parameters()) / 1e6:.3g}M params, "
          f"{args.dtype}, {args.device}, threads {torch.get_num_threads()}")
    print(f"{len(requests)} requests: prompts {min(len(p) for p, _ in requests)}.."
          f"{max(len(p) for p, _ in requests)} tokens (median "
          f"{sorted(len(p) for p, _ in requests)[len(requests) // 2]}), outputs "
          f"{min(n for _, n in requests)}..{max(n for _, n in requests)} (median "
          f"{sorted(n for _, n in requests)[len(requests) // 2]}), {sum(n for _, n in requests)} "
          f"output tokens; KV budget {args.kv_mib} MiB for every method")
    methods = args.methods.split(",")
    if args.tight:
        policies = () if args.no_policy_rows else ("engine, no headroom", "engine, swap",
                                                   "engine, int8 KV")
        methods = [m for m in ("engine", *policies, "engine, torch attention",
                               "engine-torch-linears", "transformers-cb")
                   if m.split(",")[0] in methods]
        args.no_prefix_section = True
    engine_options = dict(overlap)
    if args.max_num_batched_tokens:
        engine_options["max_num_batched_tokens"] = args.max_num_batched_tokens
    runners = {
        "engine": lambda: run_engine(model, requests, budget, args.block_size, **engine_options),
        "engine, no headroom": lambda: run_engine(model, requests, budget, args.block_size,
                                                  admission_headroom=0, **engine_options),
        "engine, swap": lambda: run_engine(model, requests, budget, args.block_size,
                                           preemption_mode="swap", **engine_options),
        # The same bytes hold 4x the tokens of float32 (not token for token the same).
        "engine, int8 KV": lambda: run_engine(model, requests, budget, args.block_size,
                                              kv_cache_dtype="int8", **engine_options),
        "engine, torch attention": lambda: run_engine(model, requests, budget, args.block_size,
                                                      backend="torch", **engine_options),
        # Linear layers as torch runs them (MKL), none through oneDNN (hf/linear.py).
        "engine-torch-linears": lambda: run_engine(model, requests, budget, args.block_size,
                                                   onednn_linear=False, **engine_options),
        # (GPU) decode steps replayed from CUDA graphs of the eager forward.
        "engine-cuda-graphs": lambda: run_engine(model, requests, budget, args.block_size,
                                                 cuda_graphs=True, **engine_options),
        "transformers-cb": lambda: run_transformers_cb(model, requests, budget, args.block_size),
        "static-dynamic": lambda: run_static(model, requests, budget, args.block_size, False),
        "static-paged": lambda: run_static(model, requests, budget, args.block_size, True),
    }
    unknown = [m for m in methods if m not in runners]
    if unknown:
        parser.error(f"--methods: unknown {', '.join(unknown)}; known: {', '.join(runners)}")
    results = {}
    for name in methods:
        print(f"running {name} ...", end=" ", flush=True)
        results[name] = runners[name]()
        seconds = results[name]["seconds"]  # shown at once: a time-limited run keeps it
        print(f"{seconds:.2f} s, {sum(n for _, n in requests) / seconds:.1f} tokens/s", flush=True)
    reference = results.get("static-dynamic", results.get("engine"))["tokens"]
    rows = [report(name, results[name], requests, reference) for name in methods]
    print()
    print_table(rows, base="transformers-cb" if args.tight else "static-dynamic")
    if not args.no_prefix_section:
        shared = workload(args.requests, vocab, seed=1, shared_prefix=512 if not args.quick else 64)
        print(f"\nshared prefix: {len(shared) // 2} of {len(shared)} requests start with the same "
              f"{512 if not args.quick else 64} tokens")
        with_cache = run_engine(model, shared, budget, args.block_size)
        without = run_engine(model, shared, budget, args.block_size, enable_prefix_caching=False)
        prefix_rows = [report("engine, prefix caching", with_cache, shared, without["tokens"]),
                       report("engine, no prefix caching", without, shared, without["tokens"])]
        print_table(prefix_rows, base="engine, no prefix caching")
        rows += prefix_rows
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
