"""Speculative decoding in the engine: output tokens/s with and without it, side by side.

Two workloads, each run with and without speculation in one process, interleaved, best of
`--runs`:

(a) copy-heavy: a small Llama trained here (about 1.5 minutes on 2 cores; --quick: 15 s) to
    repeat its prompt (each
    request's prompt is a random span and a separator; the model writes the span again and
    again, as summaries and code edits repeat spans of their inputs), at 1, 8 and 64
    concurrent requests; n-gram (prompt lookup) speculation, and a draft model several
    times smaller trained the same way;
(b) ShareGPT-like: a random tiny Llama (nothing to copy but its own loops) with prompt and
    output lengths drawn as in bench_engine.py, at the same concurrencies; n-gram.

Between them, the per-sequence turn-down rule: the copy workload with an untrained draft
model (nearly every draft rejected), with the rule and without it.

Every speculative run's tokens are checked against the run without it (greedy: they must
be identical). Run: python benchmarks/bench_engine.py --speculative [--quick]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_paged import LLM, SamplingParams  # noqa: E402

SEP, SPAN, VOCAB = 3, 24, 64


def copy_model(hidden: int, layers: int, heads: int, steps: int, seed: int = 0):
    """A Llama trained to repeat what came SPAN + 1 tokens before (a span and a separator,
    three times over; the loss is on the repeats)."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
        max_position_embeddings=1024, pad_token_id=0, bos_token_id=1, eos_token_id=2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    g = torch.Generator().manual_seed(seed)
    start = time.perf_counter()
    for _ in range(steps):
        span = torch.randint(4, VOCAB, (32, SPAN), generator=g)
        ids = torch.cat([span, torch.full((32, 1), SEP)], 1).repeat(1, 3)
        labels = ids.clone()
        labels[:, :SPAN + 1] = -100
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    params = sum(p.numel() for p in model.parameters())
    print(f"  trained hidden {hidden} x {layers} layers ({params / 1e6:.2f}M parameters) in "
          f"{time.perf_counter() - start:.1f} s, final loss {loss.item():.4f}", flush=True)
    return model.eval()


def copy_workload(count: int, new_tokens: int, seed: int = 0):
    rng = random.Random(seed)
    return [([rng.randrange(4, VOCAB) for _ in range(SPAN)] + [SEP], new_tokens)
            for _ in range(count)]


def sharegpt_workload(count: int, vocab: int, seed: int = 0):
    """Prompt and output lengths as bench_engine.workload draws them, shorter outputs."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        prompt = [rng.randrange(3, vocab) for _ in range(int(rng.lognormvariate(4.0, 0.8)) % 400 + 4)]
        out.append((prompt, min(int(rng.lognormvariate(4.2, 0.6)) + 8, 192)))
    return out


def measure(model, requests, concurrency: int, configs: dict, runs: int):
    """{name: (best seconds, tokens, stats)} of LLM.generate over `requests` for each
    speculative config (None: none), the engines built once and run interleaved."""
    llms = {name: LLM(model, max_num_seqs=concurrency, num_blocks=4096, block_size=16,
                      speculative_config=config) for name, config in configs.items()}
    prompts = [p for p, _ in requests]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in requests]
    best, tokens = {name: float("inf") for name in llms}, {}
    for _ in range(runs):
        for name, llm in llms.items():
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            best[name] = min(best[name], time.perf_counter() - start)
            tokens[name] = [o.outputs[0].token_ids for o in outs]
    return {name: (best[name], tokens[name], llms[name].engine.stats()) for name in llms}


def section(title, model, make_requests, concurrencies, configs, runs, rows):
    print(title, flush=True)
    for c in concurrencies:
        requests = make_requests(max(4, 2 * c))
        result = measure(model, requests, c, configs, runs)
        base_s, base_tokens, _ = result["none"]
        useful = sum(n for _, n in requests)
        for name, (seconds, tokens, stats) in result.items():
            same = tokens == base_tokens
            row = dict(workload=title.split(":")[0], concurrency=c, method=name,
                       tokens_per_s=round(useful / seconds, 1),
                       speedup=round(base_s / seconds, 2), identical=same,
                       acceptance=round(stats.spec_acceptance_rate, 3),
                       mean_accepted_length=round(stats.spec_mean_accepted_length, 2))
            rows.append(row)
            print(f"  {c:3d} concurrent  {name:12s} {row['tokens_per_s']:9.1f} tok/s  "
                  f"x{row['speedup']:.2f}  acceptance {row['acceptance']:.2f}  "
                  f"mean accepted length {row['mean_accepted_length']:.2f}  "
                  f"identical tokens: {same}", flush=True)
            if not same:
                raise SystemExit(f"{name}: greedy tokens differ from the run without "
                                 "speculation")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller models, 1 and 8 only")
    parser.add_argument("--runs", type=int, default=3, help="best of (3)")
    parser.add_argument("-k", type=int, default=4, help="num_speculative_tokens (4)")
    parser.add_argument("--out", help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    torch.set_grad_enabled(True)
    concurrencies = (1, 8) if args.quick else (1, 8, 64)
    print(f"threads {torch.get_num_threads()}; training the copy models:", flush=True)
    target = copy_model(128 if args.quick else 256, 2, 4, 120 if args.quick else 200)
    draft = copy_model(64, 1, 4, 120, seed=1)
    torch.set_grad_enabled(False)
    ngram = dict(method="ngram", num_speculative_tokens=args.k, prompt_lookup_max=4)
    rows: list[dict] = []
    new_tokens = 4 * (SPAN + 1)
    section(f"copy: span of {SPAN} + separator, {new_tokens} new tokens", target,
            lambda n: copy_workload(n, new_tokens), concurrencies,
            {"none": None, "ngram": ngram,
             "draft_model": dict(method="draft_model", model=draft,
                                 num_speculative_tokens=args.k)}, args.runs, rows)
    # The per-sequence rule: a draft model that is no copier at all (untrained), with the
    # rule (min_acceptance 0.25, the default) and without it (0).
    wrong = LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024)).eval()
    bad = dict(method="draft_model", model=wrong, num_speculative_tokens=args.k)
    section("turn-down: copy workload, an untrained draft model", target,
            lambda n: copy_workload(n, new_tokens), concurrencies[:2],
            {"none": None, "bad_draft_rule": bad,
             "bad_draft_no_rule": dict(bad, min_acceptance=0.0)}, args.runs, rows)
    random_model = LlamaForCausalLM(LlamaConfig(
        vocab_size=1000, hidden_size=128 if args.quick else 256, intermediate_size=512,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=1024)).eval()
    section("sharegpt: random model, lognormal lengths", random_model,
            lambda n: sharegpt_workload(n, 1000), concurrencies,
            {"none": None, "ngram": ngram}, args.runs, rows)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
