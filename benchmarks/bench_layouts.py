"""Seconds of a paged generate() call and of an engine run on Llama, Mistral (sliding
window) and Falcon (new decoder architecture) models of one small shape, one thread, best of
a few repeats; one JSON line. Made for A/B runs of two checkouts, interleaved:

    git worktree add /tmp/base <rev>
    for i in 1 2 3 4 5; do
      PYTHONPATH=/tmp/base python benchmarks/bench_layouts.py
      python benchmarks/bench_layouts.py
    done

generate: a batch of 4 prompts of 40 tokens (one left-padded), 64 new tokens, greedy;
engine: 32 prompts of 20 to 36 tokens, 32 new tokens each.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import warnings

import torch
from transformers import (
    FalconConfig, FalconForCausalLM, LlamaConfig, LlamaForCausalLM, MistralConfig,
    MistralForCausalLM,
)

import hf_paged


def make(kind):
    torch.manual_seed(0)
    common = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                  num_attention_heads=8, max_position_embeddings=1024, tie_word_embeddings=False)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(num_key_value_heads=2, **common)).eval()
    if kind == "mistral":
        return MistralForCausalLM(MistralConfig(num_key_value_heads=2, sliding_window=48,
                                                **common)).eval()
    if kind != "falcon":
        raise ValueError(f"unknown model kind {kind!r}: llama, mistral or falcon")
    common.pop("intermediate_size")
    return FalconForCausalLM(FalconConfig(new_decoder_architecture=True, num_kv_heads=2,
                                          **common)).eval()


def best(fn, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return round(min(times), 4)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    os.environ.setdefault("HF_PAGED_DEBUG", "0")
    torch.set_num_threads(1)
    results = {}
    for kind in ("llama", "mistral", "falcon"):
        model = make(kind)
        ids = torch.randint(3, 500, (4, 40), generator=torch.Generator().manual_seed(1))
        mask = torch.ones_like(ids)
        mask[0, :10] = 0
        results[f"{kind}_generate_s"] = best(lambda: model.generate(
            ids, attention_mask=mask, max_new_tokens=64, do_sample=False, eos_token_id=None,
            pad_token_id=0, cache_implementation="paged"), args.repeats + 1)
        llm = hf_paged.LLM(model, block_size=16, num_blocks=512, max_num_seqs=32)
        g = torch.Generator().manual_seed(2)
        prompts = [torch.randint(3, 500, (20 + i % 17,), generator=g).tolist()
                   for i in range(32)]
        params = hf_paged.SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
        results[f"{kind}_engine_s"] = best(
            lambda: llm.generate(prompts, params, use_tqdm=False), args.repeats)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
