"""The engine's counters, as `LLMEngine.stats()` reports them (and `/metrics` exports)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's state and counters."""

    running: int  # sequences (the completions of a request of n count apart once forked)
    waiting: int  # sequences to start: a waiting request of n completions counts n
    swapped: int
    num_preemptions: int
    recomputed_tokens: int  # tokens computed again after preemptions by recompute
    num_blocks: int
    blocks_used: int  # held by running sequences
    blocks_cached: int  # kept by the prefix cache, held by nobody (reused or evicted later)
    blocks_free: int
    block_size: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    prompt_tokens: int  # prompt tokens computed (prefix-cache hits excluded)
    generation_tokens: int  # tokens sampled
    spec_proposed_tokens: int = 0  # speculative decoding: drafts verified
    spec_accepted_tokens: int = 0  # drafts kept
    spec_verifications: int = 0  # (sequence, step) pairs that verified drafts

    @property
    def kv_usage(self) -> float:
        return self.blocks_used / self.num_blocks if self.num_blocks else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        q = self.prefix_cache_queried_tokens
        return self.prefix_cache_hit_tokens / q if q else 0.0

    @property
    def spec_acceptance_rate(self) -> float:
        """Drafts kept per draft verified."""
        p = self.spec_proposed_tokens
        return self.spec_accepted_tokens / p if p else 0.0

    @property
    def spec_mean_accepted_length(self) -> float:
        """Tokens a speculating sequence gains per step: its drafts kept, plus the one
        the step samples after them (1.0 without speculation)."""
        n = self.spec_verifications
        return 1.0 + self.spec_accepted_tokens / n if n else 1.0
