"""A sequence computed anew at LongRoPE's switch, as Phi-3's generate computes it.

Phi-3, Phi-3.5-MoE and Phi-4-mini generate with LongRoPE: their short factors while a
sequence holds at most `original_max_position_embeddings` tokens, the long ones after. Their
`generate` drops the cache when a sequence grows past that length and computes all of it
again, so every token's K/V then has the long factors. The scheduler does the same: such a
sequence gives back its blocks and waits to prefill prompt and output again, with the
rotary length of all it holds (`Sequence.rope_length`), under a prefix-cache namespace of
long K/V (blocks of its short past are never found for it). Plain Python, no torch.
"""

from __future__ import annotations

from .sequence import Sequence


class RopeSwitch:
    """limit: the length past which the long factors apply; salt: the prefix-cache namespace
    part of long K/V (`prefix_cache.rope_namespace`)."""

    def __init__(self, limit: int, salt: bytes):
        self.limit, self.salt = limit, salt

    def due(self, running: list[Sequence]) -> tuple[list[Sequence], list[Sequence]]:
        """(sequences to compute anew: computed short, now longer than the limit; those to
        leave out of this step: the same, with their newest token still on the device
        under async scheduling). Drafts of the others stop at the limit: a token past it
        is computed only with all the sequence's K/V long."""
        anew, held, limit = [], [], self.limit
        for seq in running:
            total = seq.num_tokens
            if total <= limit:
                if seq.draft:
                    del seq.draft[limit - total:]
            elif (seq.rope_length or len(seq.prompt)) <= limit:
                (held if seq.pending else anew).append(seq)
        return anew, held

    def apply(self, scheduler) -> list[Sequence]:
        """Before a step: the sequences past the switch go back in line, to be computed anew
        and long (not a preemption: admission goes on); returns those left out of it."""
        anew, held = self.due(scheduler.running)
        for seq in anew:
            scheduler.running.remove(seq)
            scheduler.requeue(seq)
            seq.rope_length, seq.salt, seq.block_hashes = seq.num_tokens, seq.salt + self.salt, []
            seq.draft.clear()
        return held
