"""The engine's options: which of them the model runner takes (the rest are the
scheduler's), the KV pool's blocks from a memory budget, and the step's token budget,
checked with the scheduler's options."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from ..config import flag, positive
from ..core.scheduler import Scheduler
from ..sampling_params import SEED_RANGE

if TYPE_CHECKING:
    from .runner import ModelRunner

RUNNER_OPTIONS = ("block_size", "num_blocks", "kv_cache_bytes", "gpu_memory_utilization",
                  "max_num_seqs", "max_model_len", "preemption_mode", "swap_space_bytes",
                  "backend", "compile", "kv_cache_dtype", "cuda_graphs", "onednn_linear")


def pool_blocks(num_blocks: int | None, kv_cache_bytes: int | None, utilization: float,
                per_layer: int, placement, most: int) -> int:
    """Blocks of the pool. per_layer: bytes of one block of one layer; most: blocks every
    sequence at full length would hold (never more). kv_cache_bytes bounds all devices
    together; a CUDA budget from free memory holds on every device."""
    if num_blocks is not None and kv_cache_bytes is not None:
        raise ValueError("Give one of num_blocks and kv_cache_bytes, not both.")
    if num_blocks is not None:
        return positive("num_blocks", num_blocks)
    per_block = per_layer * placement.num_layers
    if kv_cache_bytes is None:
        budgets = []
        for device, layers in zip(placement.devices, placement.layers):
            if device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(device)
                budgets.append(int(free * utilization) // len(layers) * placement.num_layers)
            else:
                physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
                budgets.append(min(2**30, physical // 4) // len(layers) * placement.num_layers)
        kv_cache_bytes = min(budgets)
    blocks = positive("kv_cache_bytes", kv_cache_bytes) // per_block
    if blocks == 0:
        raise ValueError(f"kv_cache_bytes={kv_cache_bytes} is smaller than one KV block "
                         f"({per_block} bytes).")
    return min(blocks, most)


def step_budget(runner: ModelRunner, max_num_batched_tokens: int | None,
                preemption_mode: str = "recompute", admission_headroom: float = 1.0,
                async_scheduling: bool = False, enable_prefix_caching: bool = True) -> int:
    """Tokens per step (default 8192 on CUDA, 2048 elsewhere), with the scheduler's options
    checked: the same check on every tensor-parallel rank, so all fail alike."""
    tokens = positive("max_num_batched_tokens", max_num_batched_tokens,
                      8192 if runner.on_cuda else 2048)
    flag("async_scheduling", async_scheduling)
    flag("enable_prefix_caching", enable_prefix_caching)
    if async_scheduling and runner.tp_size > 1:
        raise ValueError("async_scheduling keeps a step's tokens on the device of one process; "
                         "under tensor parallelism every rank needs them. Use "
                         "async_scheduling=False.")
    Scheduler.check_options(runner.max_num_seqs, tokens, preemption_mode, admission_headroom)
    return tokens


def engine_generator(seed: int | None, device) -> torch.Generator | None:
    """The engine's generator for requests without a seed (None: torch's default one)."""
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, int) \
            or not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise ValueError(f"seed must be an integer in [{SEED_RANGE[0]}, {SEED_RANGE[1]}] or "
                         f"None; got {seed!r}.")
    return torch.Generator(device).manual_seed(seed % 2**64)


def engine_options(options: dict) -> tuple[dict, dict]:
    """Splits LLMEngine options into (the model runner's, the scheduler's)."""
    runner = {k: v for k, v in options.items() if k in RUNNER_OPTIONS}
    return runner, {k: v for k, v in options.items() if k not in RUNNER_OPTIONS}
