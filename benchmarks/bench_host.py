"""Host-side cost of the engine with a tiny model (the forward is cheap, so what the host
does per token shows): tokens/s of `LLM.generate` (greedy, seeded sampling, with stop
strings) and of `AsyncLLM` streams, and what one failing request costs the step it fails in
(the forward is re-run on halves until the failing sequence is found).

    python benchmarks/bench_host.py                      # this checkout
    PYTHONPATH=/path/to/other/checkout python benchmarks/bench_host.py   # another one

Run both in one session to compare (the machine's noise is larger than small changes).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import time

os.environ.setdefault("HF_PAGED_DEBUG", "0")

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402

import hf_paged  # noqa: E402
from hf_paged import LLM, SamplingParams  # noqa: E402

VOCAB = 96


def tiny_model():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1100, pad_token_id=0, eos_token_id=1,
                         bos_token_id=2)
    return LlamaForCausalLM(config).eval()


def word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "</s>": 1, "<s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>")


def best_of(runs, fn):
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per request (64)")
    parser.add_argument("--runs", type=int, default=3, help="best of this many runs (3)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tok = tiny_model(), word_tokenizer()
    rng = random.Random(0)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(4, 40))]
               for _ in range(args.requests)]
    n, new = args.requests, args.tokens
    options = dict(block_size=16, num_blocks=4000, max_num_seqs=128, max_num_batched_tokens=4096)
    where = os.path.dirname(hf_paged.__file__)
    print(f"hf_paged from {where}; {n} requests x {new} tokens, tiny Llama, 1 thread")
    cases = {
        "greedy": SamplingParams(temperature=0, max_tokens=new, ignore_eos=True),
        "seeded sampling": [SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=new,
                                           ignore_eos=True) for i in range(n)],
        "stop strings": SamplingParams(temperature=0, max_tokens=new, ignore_eos=True,
                                       stop=["zz", "w999"]),
    }
    for name, params in cases.items():
        llm = LLM(model, tok, **options)
        seconds = best_of(args.runs, lambda: llm.generate(prompts, params, use_tqdm=False))
        print(f"  LLM.generate, {name:16s} {n * new / seconds:9.0f} tok/s")

    llm = hf_paged.AsyncLLM(model, tok, **options)
    params = SamplingParams(temperature=0, max_tokens=new * 4, ignore_eos=True)

    async def one(prompt):
        async for _ in llm.generate(prompt, params):
            pass

    async def streams():
        await asyncio.gather(*(one(p) for p in prompts[:32]))

    seconds = best_of(args.runs, lambda: asyncio.run(streams()))
    llm.shutdown()
    print(f"  AsyncLLM, 32 streams x {new * 4} tokens {32 * new * 4 / seconds:9.0f} tok/s")

    # One failing request among 64 decoding ones: the cost of finding it.
    engine = hf_paged.LLMEngine(model, tok, **options)
    if not hasattr(engine, "prepare_request"):
        return  # a checkout without per-request failure isolation
    poison, inner = 77, model.forward

    def forward(*a, input_ids=None, position_ids=None, **kw):
        if bool(((input_ids == poison) & (position_ids == 30)).any()):
            raise RuntimeError("poisoned")
        return inner(*a, input_ids=input_ids, position_ids=position_ids, **kw)

    clean = [[t if t != poison else 76 for t in p][:20] for p in prompts[:64]]
    for i, p in enumerate(clean):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=40,
                                                      ignore_eos=True))
    engine.add_request("bad", [3] * 29, SamplingParams(temperature=0, max_tokens=40,
                                                       ignore_eos=True))
    times = []
    model.forward = forward
    try:
        while engine.has_unfinished_requests():
            start = time.perf_counter()
            outs = engine.step()
            times.append((time.perf_counter() - start,
                          any(o.request_id == "bad" and o.finished for o in outs)))
    finally:
        del model.forward
    failing = [t for t, bad in times if bad][0]
    normal = statistics.median(t for t, bad in times[2:] if not bad)
    print(f"  one failing request among 65: its step {failing * 1e3:.1f} ms, a median step "
          f"{normal * 1e3:.1f} ms ({failing / normal:.1f}x, once)")


if __name__ == "__main__":
    main()
