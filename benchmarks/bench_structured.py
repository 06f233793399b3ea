"""What structured outputs cost: decode throughput of the engine with and without a JSON
schema on every request (the engine benchmark's 168M random Llama, greedy), measured in one
run, and the per-row time of each grammar engine's token mask.

    python benchmarks/bench_structured.py            # 168M model, 32 requests
    python benchmarks/bench_structured.py --quick    # a tiny model

The tokenizer is a byte-level BPE trained here on a little text (vocabulary 1,000); the
model's 32,000 logits are all masked against it, as with any model whose head is wider than
its tokenizer. Each request's answer is a JSON object with one free string, so it goes on
until max_tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("HF_PAGED_DEBUG", "0")

import torch  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

from common import random_llama  # noqa: E402
from hf_paged import LLM, SamplingParams  # noqa: E402
from hf_paged.engine import structured  # noqa: E402
from hf_paged.sampling_params import StructuredOutputsParams  # noqa: E402

# One long free string: every request decodes max_tokens tokens with and without it, so
# the two runs do the same work but for the constraint.
SCHEMA = {"type": "object", "properties": {"text": {"type": "string", "minLength": 1000}},
          "required": ["text"]}
CORPUS = ["the quick brown fox jumps over the lazy dog", '{"text": "a JSON value", "n": 12}',
          "héllo wörld café naïve €5 日本語 テスト"]


def byte_tokenizer(vocab: int = 1000) -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 50, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>")


class _Timed:
    """Adds up the seconds spent building and applying the masks."""

    def __init__(self):
        self.seconds, self._inner = 0.0, structured.mask_rows

    def __call__(self, *args):
        start = time.perf_counter()
        try:
            return self._inner(*args)
        finally:
            self.seconds += time.perf_counter() - start


def engine_rows(model, tok, requests: int, new_tokens: int, runs: int) -> list[dict]:
    prompts = [[(7 * i + j) % 900 + 3 for j in range(32)] for i in range(requests)]
    llm = LLM(model, tok, max_num_seqs=requests)
    rows = []
    timed = _Timed()
    from hf_paged.engine import sampler

    sampler.mask_rows = timed  # the sampler's own reference
    configs = (("no constraint", None), ("JSON schema", StructuredOutputsParams(json=SCHEMA)))
    best = {name: (float("inf"), 0.0) for name, _ in configs}
    try:
        for name, spec in configs:  # warm-up (and the grammar's compile)
            llm.generate(prompts[:2], _params(spec, new_tokens), use_tqdm=False)
        for _ in range(runs):  # interleaved: this machine's speed drifts
            for name, spec in configs:
                timed.seconds = 0.0
                start = time.perf_counter()
                outs = llm.generate(prompts, _params(spec, new_tokens), use_tqdm=False)
                seconds = time.perf_counter() - start
                tokens = sum(len(o.outputs[0].token_ids) for o in outs)
                assert tokens == requests * new_tokens, (name, tokens)  # the same work
                best[name] = min(best[name], (seconds, timed.seconds))
        for name, _ in configs:
            seconds, mask = best[name]
            rows.append(dict(method=name, seconds=round(seconds, 2),
                             tokens=requests * new_tokens,
                             tokens_per_s=round(requests * new_tokens / seconds, 1),
                             mask_seconds=round(mask, 3)))
            print(f"  {name:14} {seconds:8.2f} s  {requests * new_tokens / seconds:9.1f} output "
                  f"tokens/s  (masks {mask:.3f} s, {mask / seconds:.1%})", flush=True)
    finally:
        sampler.mask_rows = timed._inner
    return rows


def _params(spec, new_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True,
                          structured_outputs=spec)


def mask_microbench(tok, vocab: int, steps: int = 200) -> dict:
    """Seconds per row and step to fill one token mask, per grammar engine."""
    out = {}
    import xgrammar as xgr

    vocab = len(tok)  # (as the engine masks: the tokenizer's vocabulary)
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA),
                                                             any_whitespace=False)
    matcher, bitmask = xgr.GrammarMatcher(compiled), xgr.allocate_token_bitmask(1, vocab)
    out["xgrammar"] = _walk(lambda: matcher.fill_next_token_bitmask(bitmask),
                            matcher.accept_token, matcher.reset, bitmask, vocab, steps)
    try:
        import llguidance
        import llguidance.hf
        import llguidance.torch as lgt
    except ImportError:
        print("  (llguidance is not installed: pip install llguidance to compare)")
        return out
    ltok = llguidance.hf.from_tokenizer(tok, vocab)
    lmatch = llguidance.LLMatcher(ltok, llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(SCHEMA), defaults={"whitespace_flexible": False}))
    lmask = lgt.allocate_token_bitmask(1, vocab)
    out["llguidance"] = _walk(lambda: lgt.fill_next_token_bitmask(lmatch, lmask, 0),
                              lmatch.consume_token, lmatch.reset, lmask, vocab, steps)
    return out


def _walk(fill, accept, reset, bitmask, vocab: int, steps: int) -> float:
    """Follows an allowed token `steps` times (from the start again once the text is
    complete); mean seconds of `fill`."""
    total = 0.0
    for step in range(steps):
        start = time.perf_counter()
        fill()
        total += time.perf_counter() - start
        allowed = ((bitmask[0, :, None] >> torch.arange(32)) & 1).flatten()[:vocab].nonzero()
        token = int(allowed[step % len(allowed)])
        if not accept(token) or len(allowed) == 1:  # (the end: only EOS is left)
            reset()
    return total / steps


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3, help="best of (3)")
    parser.add_argument("--out", help="also write the rows as JSON here")
    args = parser.parse_args()
    model = random_llama(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128) \
        if args.quick else random_llama()
    tok = byte_tokenizer()
    vocab = model.config.vocab_size
    print(f"random Llama {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M, float32, "
          f"threads {torch.get_num_threads()}; {args.requests} requests x {args.new_tokens} "
          f"greedy tokens, best of {args.runs}:")
    rows = engine_rows(model, tok, args.requests, args.new_tokens, args.runs)
    ratio = rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"]
    print(f"  with the schema: {ratio:.3f}x the throughput without")
    per_row = mask_microbench(tok, vocab)
    for name, seconds in per_row.items():
        print(f"  {name:10} token mask: {seconds * 1e6:7.1f} us per row and step "
              f"(tokenizer vocabulary {len(tok)})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(engine=rows, ratio=ratio, mask_us_per_row={
                k: v * 1e6 for k, v in per_row.items()}), f, indent=2)


if __name__ == "__main__":
    main()
