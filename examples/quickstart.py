"""hf-paged in one screen: the same generate() call with and without the paged KV cache.

    python examples/quickstart.py

Builds a small random Llama and a word-level tokenizer offline (no downloads), generates
for a left-padded batch of prompts of different lengths with Transformers' DynamicCache
and with `cache_implementation="paged"`, and prints both outputs and their KV memory.
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

import hf_paged  # registers cache_implementation="paged"

WORDS = ("the a cat dog sat ran on under mat log tree house and then quickly slowly big small "
         "red blue it was is saw near far over jumped walked home garden").split()


def build_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>", padding_side="left")


def kv_bytes(cache) -> int:
    if isinstance(cache, hf_paged.PagedCache):
        return cache.memory_stats().pool_bytes
    return sum(t.numel() * t.element_size() for layer in cache.layers
               for t in (layer.keys, layer.values))


def main():
    torch.manual_seed(0)
    tokenizer = build_tokenizer()
    config = LlamaConfig(vocab_size=len(WORDS) + 3, hidden_size=256, intermediate_size=512,
                         num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(config).eval()
    prompts = [
        "the cat sat",
        "a big red dog ran under the tree and then it saw the cat near the house " * 3,
        "it was",
        "the small blue cat walked home slowly " * 6,
    ]
    inputs = tokenizer(prompts, return_tensors="pt", padding=True)
    kwargs = dict(max_new_tokens=12, do_sample=False, return_dict_in_generate=True)

    stock = model.generate(**inputs, **kwargs)
    paged = model.generate(**inputs, **kwargs, cache_implementation="paged")

    width = inputs["input_ids"].shape[1]
    print("The model's weights are random (nothing is downloaded), so the words below are noise;")
    print("what matters is that both caches give the same ones.\n")
    print("prompt tokens per row:", inputs["attention_mask"].sum(1).tolist(), f"(padded to {width})\n")
    for i, (a, b) in enumerate(zip(stock.sequences, paged.sequences)):
        print(f"row {i} DynamicCache: {tokenizer.decode(a[width:], skip_special_tokens=True)}")
        print(f"row {i} paged       : {tokenizer.decode(b[width:], skip_special_tokens=True)}")
    same = torch.equal(stock.sequences, paged.sequences)
    print(f"\nidentical tokens: {same}")

    stats = paged.past_key_values.memory_stats()
    print(f"paged attention backend: {paged.past_key_values.backend.name}")
    dyn = kv_bytes(stock.past_key_values)
    print(f"\n{'':24}{'KV bytes':>12}  real tokens / KV slots")
    real = stats.tokens_stored
    dyn_slots = dyn // stats.bytes_per_token
    print(f"{'DynamicCache':24}{dyn:>12,}  {real}/{dyn_slots} = {real / dyn_slots:.2f}")
    print(f"{'PagedCache (pool)':24}{stats.pool_bytes:>12,}  {real}/{stats.blocks_in_use * stats.block_size}"
          f" = {stats.utilization:.2f}")
    print(f"paged / dynamic KV bytes: {stats.pool_bytes / dyn:.2f}")
    if not same:
        raise SystemExit("outputs differ")


if __name__ == "__main__":
    main()
