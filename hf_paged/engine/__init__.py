"""The continuous-batching engine: `LLMEngine` (requests, steps), its `ModelRunner` (the
device side of a step), the sampler and output processing, and the `LLM` / `AsyncLLM`
front ends."""

from .engine import BASE, EngineStats, LLMEngine, engine_options
from .runner import ModelRunner


def run_worker(model, **options) -> None:
    """A tensor-parallel rank above 0: builds only the model runner (LLMEngine `options`;
    the scheduler's are ignored) and runs the steps rank 0 broadcasts until it stops."""
    ModelRunner(model, **engine_options(options)[0]).worker_loop()


__all__ = ["BASE", "EngineStats", "LLMEngine", "ModelRunner", "engine_options", "run_worker"]
