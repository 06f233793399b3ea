"""The continuous-batching engine: `LLMEngine` (requests, steps), its `ModelRunner` (the
device side of a step), the sampler and output processing, and the `LLM` / `AsyncLLM`
front ends."""

from ..errors import IsolationError, RequestRejectedError  # noqa: F401  (0.2's hf_paged.engine names)
from .beam_search import BeamSearchParams
from .engine import BASE, EngineStats, LLMEngine, engine_options, step_budget
from .options import engine_generator
from .request import truncated as truncate_prompt
from .runner import ModelRunner
from .speculative import Speculator


def run_worker(model, **options) -> None:
    """A tensor-parallel rank above 0: builds only the model runner (from LLMEngine
    `options`, the others checked as rank 0 checks them, so that an option rank 0 refuses
    every rank refuses) and runs the steps rank 0 broadcasts until it stops."""
    from .llm import check_option_names

    check_option_names("run_worker", options)
    runner_options, scheduler_options = engine_options(options)
    runner = ModelRunner(model, **runner_options,
                         max_num_batched_tokens=scheduler_options.get("max_num_batched_tokens"))
    budget = step_budget(runner, scheduler_options.get("max_num_batched_tokens"),
                         runner_options.get("preemption_mode", "recompute"),
                         scheduler_options.get("admission_headroom", 1.0),
                         scheduler_options.get("async_scheduling", False),
                         scheduler_options.get("enable_prefix_caching", True))
    Speculator.build(scheduler_options.get("speculative_config"), runner, budget)  # (checked)
    engine_generator(scheduler_options.get("seed"), "cpu")  # (checked)
    runner.worker_loop()


__all__ = ["BASE", "EngineStats", "IsolationError", "LLMEngine", "ModelRunner",
           "RequestRejectedError", "engine_options", "run_worker", "truncate_prompt"]
