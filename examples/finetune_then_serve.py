"""Fine-tune with Trainer and a LoRA adapter, then generate on the paged cache.

    python examples/finetune_then_serve.py [--steps 200] [--out DIR]

Everything is built offline: a tiny Llama with random weights and a word-level tokenizer
whose words are "n0" ... "n63". The task is counting: after "n5 n6 n7" comes "n8 n9 ...".
The random model continues with noise; after a few seconds of LoRA training with
Transformers' `Trainer` it counts. The adapter is saved, reloaded unmerged on the saved base
model, and used with `cache_implementation="paged"` for a padded batch, beam search and a
pipeline, each checked token for token against Transformers' own cache.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import warnings
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, TaskType, get_peft_model
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Trainer,
    TrainingArguments, pipeline,
)

import hf_paged  # registers cache_implementation="paged"

NUMBERS = 64
PROMPTS = ["n5 n6 n7", "n20 n21 n22 n23 n24 n25 n26", "n40", "n11 n12 n13 n14"]


def build_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"n{i}": i + 3 for i in range(NUMBERS)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>", padding_side="left")


def build_base_model(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=NUMBERS + 3, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
                         eos_token_id=2)
    return LlamaForCausalLM(config)


class CountingTask(torch.utils.data.Dataset):
    """Runs of consecutive numbers, "<s> n{k} n{k+1} ... n{k+11}", from a random start."""

    def __init__(self, size: int, length: int = 12):
        self.size, self.length = size, length

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        start = random.Random(i).randrange(NUMBERS - self.length)
        ids = torch.tensor([1] + [3 + start + j for j in range(self.length)])
        return {"input_ids": ids, "labels": ids}


def lora_config(**overrides) -> LoraConfig:
    settings = dict(task_type=TaskType.CAUSAL_LM, r=16, lora_alpha=32,
                    target_modules="all-linear", lora_dropout=0.05)
    settings.update(overrides)
    return LoraConfig(**settings)


def train_adapter(base, steps: int, path: Path, seed: int = 0):
    """Trains a LoRA adapter on the counting task with Trainer and saves it to `path`.

    Returns the PEFT model as training left it (still in training mode)."""
    model = get_peft_model(base, lora_config())
    args = TrainingArguments(output_dir=str(path / "trainer"), per_device_train_batch_size=32,
                             max_steps=steps, learning_rate=3e-3, logging_steps=max(steps // 4, 1),
                             report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True,
                             seed=seed)
    Trainer(model=model, args=args, train_dataset=CountingTask(steps * 32)).train()
    model.save_pretrained(path)
    return model


def completions(model, tokenizer, **kwargs) -> list[str]:
    inputs = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    out = model.generate(**inputs, max_new_tokens=6, do_sample=False, **kwargs)
    sequences = getattr(out, "sequences", out)
    return tokenizer.batch_decode(sequences[:, inputs["input_ids"].shape[1]:],
                                  skip_special_tokens=True)


def check_same(name: str, stock, paged) -> None:
    same = stock == paged if isinstance(stock, list) else torch.equal(stock, paged)
    print(f"  {name}: same tokens as Transformers' cache: {same}")
    if not same:
        raise SystemExit(f"{name}: the paged cache gave other tokens")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="training steps (default 200)")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for the base model and the adapter (default: a temporary one)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", category=FutureWarning)
    out = args.out or Path(tempfile.mkdtemp(prefix="hf_paged_finetune_"))
    tokenizer = build_tokenizer()
    base = build_base_model()
    base.save_pretrained(out / "base")
    tokenizer.save_pretrained(out / "base")

    print("Random base model (weights are random: noise):")
    for prompt, text in zip(PROMPTS, completions(base.eval(), tokenizer,
                                                 cache_implementation="paged")):
        print(f"  {prompt:28} -> {text}")

    print(f"\nTraining a LoRA adapter with Trainer for {args.steps} steps ...")
    adapter = out / "adapter"
    train_adapter(base.train(), args.steps, adapter)
    print(f"saved the adapter to {adapter}")

    reloaded = AutoModelForCausalLM.from_pretrained(out / "base")
    model = PeftModel.from_pretrained(reloaded, adapter).eval()  # unmerged LoRA
    print("\nFine-tuned, reloaded, paged cache:")
    paged = completions(model, tokenizer, cache_implementation="paged")
    for prompt, text in zip(PROMPTS, paged):
        print(f"  {prompt:28} -> {text}")
    check_same("padded batch", completions(model, tokenizer), paged)

    kwargs = dict(num_beams=4, num_return_sequences=2, return_dict_in_generate=True)
    beams = completions(model, tokenizer, cache_implementation="paged", **kwargs)
    check_same("beam search", completions(model, tokenizer, **kwargs), beams)

    pipe = pipeline("text-generation", model=model, tokenizer=tokenizer)
    stock_texts = [r[0]["generated_text"] for r in pipe(PROMPTS, max_new_tokens=6,
                                                        do_sample=False, batch_size=4)]
    paged_texts = [r[0]["generated_text"] for r in pipe(PROMPTS, max_new_tokens=6,
                                                        do_sample=False, batch_size=4,
                                                        cache_implementation="paged")]
    check_same("pipeline", stock_texts, paged_texts)

    inputs = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    result = model.generate(**inputs, max_new_tokens=6, do_sample=False,
                            cache_implementation="paged", return_dict_in_generate=True)
    cache = result.past_key_values
    stats = cache.memory_stats()
    print(f"\npaged cache ({cache.backend.name} attention backend): {stats.tokens_stored} tokens "
          f"in {stats.blocks_in_use} blocks of {stats.block_size}, utilization "
          f"{stats.utilization:.2f}, {stats.pool_bytes:,} pool bytes")
    print(f"(Transformers' cache would hold {inputs['input_ids'].numel() + 4 * 5} token slots "
          f"for the same batch, padding included; the paged cache stores no left padding.)")


if __name__ == "__main__":
    main()
