"""A request's sequences as the scheduler sees them. Plain Python, no torch.

A sequence holds its prompt and the tokens generated so far; `num_computed` of them have
their keys and values in the pool. A running sequence has a row of the scheduler's block
tables. Each new token is computed (its K/V written) on the step after it was sampled.
Under async scheduling that step is planned before the host has seen the token: the
sequence counts it as `pending` (its value stays on the device) until the engine appends it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # not admitted yet, or preempted by recompute and back in line
    RUNNING = "running"  # holds a row and blocks
    SWAPPED = "swapped"  # preempted to the CPU pool; resumes before new requests
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One sequence of a request (a request with `n > 1` has n, forked after its prompt)."""

    seq_id: int
    request_id: str
    prompt: list[int]
    max_tokens: int
    priority: int = 0  # lower runs first
    arrival: int = 0  # order of arrival, the tie-break within a priority
    salt: bytes = b""  # prefix-cache namespace (prefix_cache.namespace: adapter, cache salt)
    output: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    row: int | None = None
    num_computed: int = 0
    block_hashes: list[bytes] = field(default_factory=list)  # content keys of full blocks
    registered: int = 0  # leading full blocks already offered to the prefix cache
    swapped: list[list[int]] | None = None  # CPU block tables (per KV group) when swapped
    swapped_length: int = 0
    forks: int = 0  # siblings to fork once the prompt is computed (n - 1)
    reserved_rows: list[int] = field(default_factory=list)  # rows kept for those siblings
    preemptions: int = 0
    lost_tokens: int = 0  # computed tokens dropped by its last recompute preemption
    cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission
    first_scheduled: float | None = None  # time.monotonic() of its first admission
    finish_reason: str | None = None
    adapter: str | None = None  # the PEFT adapter that runs it (None: the model as it is)
    pending: int = 0  # 1: a sampled token not appended yet (async scheduling)
    # Speculative decoding: tokens proposed to follow its newest one, verified (and kept or
    # dropped) by the step that computes them; never part of `output` until then.
    draft: list[int] = field(default_factory=list)
    speculation: object = None  # the engine's speculation state for it (opaque)
    sampling: object = None  # the engine's sampling row for it, once it has sampled (opaque)
    # Prompt log-probabilities: the logits of prompt positions from here on are wanted (None:
    # none are); a prefix-cache hit may not cover them.
    prompt_logits_from: int | None = None
    # The length its K/V's rotary frequencies follow where they depend on it (hf/rope.py):
    # its prompt's (None), or all it held when computed anew at LongRoPE's switch.
    rope_length: int | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output) + self.pending

    @property
    def to_compute(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def cacheable(self) -> int:
        """Tokens a prefix-cache hit may cover."""
        limit = self.prompt_logits_from
        return self.num_tokens if limit is None else limit

    def tokens(self, start: int, stop: int) -> list[int]:
        """Tokens [start, stop) of prompt + output."""
        p = len(self.prompt)
        if stop <= p:
            return self.prompt[start:stop]
        if start >= p:
            return self.output[start - p:stop - p]
        return self.prompt[start:] + self.output[:stop - p]

    @property
    def rank(self) -> tuple[int, int]:
        """Scheduling order: priority, then arrival."""
        return self.priority, self.arrival

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED
