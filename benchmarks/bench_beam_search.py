"""What prefix caching saves `LLM.beam_search`: each step is one engine call over every live
beam, whose earlier tokens are the prompt plus the beam's own; with prefix caching the call
finds all their full blocks and computes about one block per beam, without it every step
computes every beam whole. Both engines run the same search in one process.

    python benchmarks/bench_beam_search.py              # tiny Llama (hidden 64, 2 layers)
    python benchmarks/bench_beam_search.py --hidden 512 --layers 4
"""

from __future__ import annotations

import argparse

import torch

from common import random_llama, timed
from hf_paged import LLM, BeamSearchParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=200)
    parser.add_argument("--beam-width", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    model = random_llama(hidden=args.hidden, layers=args.layers, heads=4, kv_heads=2,
                         intermediate=2 * args.hidden, vocab=1000)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 1000, (args.prompt_len,), generator=gen).tolist()
               for _ in range(args.prompts)]
    params = BeamSearchParams(beam_width=args.beam_width, max_tokens=args.max_tokens,
                              ignore_eos=True)
    results, seconds = {}, {}
    for caching in (True, False):
        llm = LLM(model, block_size=16, enable_prefix_caching=caching)
        llm.beam_search(prompts[:1], BeamSearchParams(beam_width=2, max_tokens=2))  # warm-up
        results[caching], seconds[caching] = timed(lambda: llm.beam_search(prompts, params))
    same = all([s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
               for a, b in zip(results[True], results[False]))
    print(f"{args.prompts} prompts x {args.prompt_len} tokens, {args.beam_width} beams, "
          f"{args.max_tokens} tokens: prefix caching {seconds[True]:.2f} s, without "
          f"{seconds[False]:.2f} s ({seconds[False] / seconds[True]:.1f}x); same sequences: "
          f"{same}")


if __name__ == "__main__":
    main()
