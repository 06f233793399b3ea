"""KV memory of a hybrid (sliding-window : full attention) model on the paged cache: a
Gemma-3-shaped text model (5 sliding layers to 1 full, window 1024) holding one long
sequence, against the same model with every layer full, side by side in one run.

    python benchmarks/bench_hybrid_kv.py [--tokens 8192] [--window 1024] [--layers 6]

For generate() and for the engine (chunked prefill) it reports the KV bytes in use and the
blocks held (counted in blocks of all layers), and checks the tokens equal stock
Transformers' (DynamicCache) greedy ones. The model is tiny and random (hidden size 64):
the ratio depends only on the layer pattern, the window and the length.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

import hf_paged
from hf_paged import SamplingParams


def model_with(layer_types, window, tokens):
    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=len(layer_types),
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=window,
        layer_types=layer_types, max_position_embeddings=tokens + 256, pad_token_id=0,
        eos_token_id=1, bos_token_id=2, tie_word_embeddings=False)
    model = Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


def generate_stats(model, prompt, new_tokens):
    ids = torch.tensor([prompt])
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                  do_sample=False, eos_token_id=None)
    start = time.perf_counter()
    out = model.generate(ids, **kwargs, cache_implementation="paged",
                         return_dict_in_generate=True)
    seconds = time.perf_counter() - start
    stats = out.past_key_values.memory_stats()
    return out.sequences[0, len(prompt):].tolist(), stats, seconds


def engine_peak(model, prompt, new_tokens, chunk):
    llm = hf_paged.LLM(model, block_size=16, max_num_seqs=1, max_num_batched_tokens=chunk,
                       max_model_len=len(prompt) + new_tokens + 16)
    engine = llm.engine
    engine.add_request("r", prompt, SamplingParams(max_tokens=new_tokens, temperature=0.0,
                                                   ignore_eos=True))
    peak, tokens = 0, None
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = out.outputs[0].token_ids
        peak = max(peak, engine.stats().blocks_used)
    per_block = engine.pool.nbytes // engine.pool.blocks.num_blocks
    return tokens, peak * per_block


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=8192, help="prompt length")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=6, help="a multiple of 6 (5:1)")
    parser.add_argument("--chunk", type=int, default=512, help="engine prefill chunk")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    pattern = (["sliding_attention"] * 5 + ["full_attention"]) * (args.layers // 6)
    prompt = torch.randint(3, 256, (args.tokens,), generator=torch.Generator().manual_seed(1))
    prompt = prompt.tolist()
    results = {}
    for name, types in (("hybrid 5:1", pattern), ("all full", ["full_attention"] * len(pattern))):
        model = model_with(types, args.window, args.tokens + args.new_tokens)
        ids = torch.tensor([prompt])
        stock = model.generate(ids, attention_mask=torch.ones_like(ids),
                               max_new_tokens=args.new_tokens, do_sample=False,
                               eos_token_id=None)[0, len(prompt):].tolist()
        tokens, stats, seconds = generate_stats(model, prompt, args.new_tokens)
        engine_tokens, engine_bytes = engine_peak(model, prompt, args.new_tokens, args.chunk)
        results[name] = dict(
            generate_same_tokens=tokens == stock, engine_same_tokens=engine_tokens == stock,
            generate_kv_bytes=stats.kv_bytes_in_use, generate_blocks=stats.blocks_in_use,
            generate_seconds=round(seconds, 2), engine_peak_kv_bytes=engine_bytes,
            groups=[(g.window, len(g.layers), g.blocks_in_use) for g in stats.groups])
        print(name, json.dumps(results[name]))
    hybrid, full = results["hybrid 5:1"], results["all full"]
    summary = dict(
        tokens=args.tokens + args.new_tokens, window=args.window, layers=len(pattern),
        generate_kv_ratio=round(hybrid["generate_kv_bytes"] / full["generate_kv_bytes"], 3),
        engine_peak_kv_ratio=round(hybrid["engine_peak_kv_bytes"]
                                   / full["engine_peak_kv_bytes"], 3))
    print(json.dumps(summary))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(results=results, summary=summary), f, indent=1)


if __name__ == "__main__":
    main()
