"""The scheduler's budgets and policies, checked before anything is built. Plain Python."""

from __future__ import annotations


def check_options(max_num_seqs: int, max_num_batched_tokens: int,
                  preemption_mode: str, admission_headroom: float = 1.0) -> None:
    """Raises ValueError for budgets or a preemption mode the scheduler cannot run."""
    if max_num_batched_tokens < max_num_seqs:
        raise ValueError(
            f"max_num_batched_tokens ({max_num_batched_tokens}) must be at least "
            f"max_num_seqs ({max_num_seqs}): every running sequence decodes a token a step."
        )
    if preemption_mode not in ("recompute", "swap"):
        raise ValueError(f"preemption_mode must be 'recompute' or 'swap'; got {preemption_mode!r}.")
    if (isinstance(admission_headroom, bool) or not isinstance(admission_headroom, (int, float))
            or not 0 <= admission_headroom <= 64):
        raise ValueError("admission_headroom (free blocks kept per running sequence when "
                         f"admitting) must be a number in [0, 64]; got {admission_headroom!r}.")
