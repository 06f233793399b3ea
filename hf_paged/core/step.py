"""A step's plan, as the scheduler hands it to the engine. Plain Python, no torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from .sequence import Sequence


@dataclass(slots=True)
class Scheduled:
    """One sequence's share of a step.

    A speculating decode computes its newest token and then `draft` (tokens proposed for
    the positions after it, `count == 1 + len(draft)`); the forward's logits at all of them
    decide how many drafts the sequence keeps (engine/speculative.py)."""

    seq: Sequence
    start: int  # tokens already cached (the context before this step)
    count: int  # tokens computed this step
    sample: bool  # the step reaches the sequence's last token: a new token is sampled
    forks: int = 0  # siblings its sampled token starts (n - 1 once its prompt is computed)
    draft: tuple[int, ...] = ()  # proposed tokens verified by this step

    @classmethod
    def of(cls, seq: Sequence, count: int) -> "Scheduled":
        sample = count == seq.to_compute
        return cls(seq, seq.num_computed, count, sample, seq.forks if sample else 0)


@dataclass
class Step:
    """What the engine does for one step, in order: swaps and copies, table entries, then
    one forward over `scheduled` (in batch order)."""

    scheduled: list[Scheduled] = field(default_factory=list)
    entries: list[tuple[int, int, int]] = field(default_factory=list)  # (row, col, block)
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (pool block, CPU block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (CPU block, pool block)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.count for s in self.scheduled)
