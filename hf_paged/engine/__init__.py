"""The continuous-batching engine: `LLMEngine` (scheduling, requests, outputs), its model
runner (the device side of a step), the sampler, and the `LLM` / `AsyncLLM` front ends."""

from .engine import BASE, EngineStats, LLMEngine

__all__ = ["BASE", "EngineStats", "LLMEngine"]
