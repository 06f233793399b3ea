"""Shared helpers of the benchmarks: random Llama models and timing."""

from __future__ import annotations

import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def check_device(device: str, needs_cuda: bool = False) -> None:
    """Ends the run at once, saying why, when `device` (or a mode that `needs_cuda`) asks
    for a GPU this torch does not see, rather than after minutes of work or in a torch
    traceback."""
    if (needs_cuda or str(device).startswith("cuda")) and not torch.cuda.is_available():
        raise SystemExit(f"this mode needs a CUDA device (--device {device}), and this "
                         f"torch ({torch.__version__}) sees none: run it on a GPU machine.")
    if needs_cuda and not str(device).startswith("cuda"):
        raise SystemExit(f"this mode runs on a GPU: add --device cuda (got --device {device}).")


def random_llama(hidden: int = 1024, layers: int = 8, heads: int = 16, kv_heads: int = 16,
                 intermediate: int = 2816, vocab: int = 32000, seed: int = 0,
                 dtype: torch.dtype = torch.float32, device: str = "cpu") -> LlamaForCausalLM:
    """A random Llama, built directly on `device` in `dtype`; the defaults give about 168M
    parameters."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=2048, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    return model.eval()


def left_padded(lengths: list[int], vocab: int, seed: int = 0):
    """input_ids, attention_mask for left-padded random prompts of the given lengths."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, width - n:] = torch.randint(3, vocab, (n,), generator=g)
        mask[i, width - n:] = 1
    return ids, mask


def timed(fn):
    """(result, seconds) of one call."""
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def cache_tensor_bytes(cache) -> int:
    """Bytes of the K/V tensors a Transformers cache holds."""
    total = 0
    for layer in getattr(cache, "layers", []):
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total
