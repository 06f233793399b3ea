"""The engine's options: which of them the model runner takes (the rest are the
scheduler's), and the step's token budget, checked with the scheduler's options."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..config import flag, positive
from ..core.scheduler import Scheduler

if TYPE_CHECKING:
    from .runner import ModelRunner

RUNNER_OPTIONS = ("block_size", "num_blocks", "kv_cache_bytes", "gpu_memory_utilization",
                  "max_num_seqs", "max_model_len", "preemption_mode", "swap_space_bytes",
                  "backend", "compile", "kv_cache_dtype", "cuda_graphs", "onednn_linear")


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


def engine_options(options: dict) -> tuple[dict, dict]:
    """Splits LLMEngine options into (the model runner's, the scheduler's)."""
    runner = {k: v for k, v in options.items() if k in RUNNER_OPTIONS}
    return runner, {k: v for k, v in options.items() if k not in RUNNER_OPTIONS}
