"""Prompt log-probabilities (`SamplingParams.prompt_logprobs`): how likely the model found
each prompt token given the ones before it, as evaluation harnesses score a continuation.

A forward over a prompt chunk keeps the logits of the positions a request still needs
(`Forward.prompt_rows`, from `Sequence.prompt_logits_from` on); the logits of position p
score prompt token p + 1. Recorded here right after the forward; the sequence then wants
the positions after them, so a chunk recomputed after a preemption adds nothing twice,
and a prefix-cache hit never covers a position still wanted (`Sequence.cacheable`).
"""

from __future__ import annotations

import torch

from .request import EngineRequest
from ..outputs import logprob_entries


def start(request: EngineRequest) -> int | None:
    """`Sequence.prompt_logits_from` of the request's first sequence: 0 if it wants prompt
    log-probabilities (and its prompt has a second token to score), else None."""
    if request.params.prompt_logprobs is None or len(request.prompt_ids) < 2:
        return None
    return 0


def record(spans: list[tuple], logits: torch.Tensor, requests: dict[str, EngineRequest],
           tokenizer=None) -> None:
    """logits [P, V]: rows of the positions of `spans` ((sequence, first position, count)
    each, back to back). Fills the requests' `prompt_logprobs` and moves each sequence's
    `prompt_logits_from` on. Raises ValueError (changing nothing) if a row is NaN, so that
    the engine's bisection ends that request alone."""
    logprobs = torch.log_softmax(logits.float(), -1)
    targets = [t for seq, first, count in spans for t in seq.prompt[first + 1:first + 1 + count]]
    chosen = logprobs.gather(1, torch.tensor(targets, device=logits.device)[:, None])
    if torch.isnan(chosen).any():
        raise ValueError("the model's logits of a prompt position are not a number (NaN)")
    ranks, chosen = (logprobs >= chosen).sum(1).tolist(), chosen[:, 0]
    top_k = max(requests[seq.request_id].params.prompt_logprobs for seq, _, _ in spans)
    values, indices = ([], []) if top_k == 0 else \
        (t.tolist() for t in logprobs.topk(min(top_k, logprobs.shape[1]), -1))
    chosen = chosen.tolist()
    row = 0
    for seq, first, count in spans:
        request = requests[seq.request_id]
        k = request.params.prompt_logprobs
        for p in range(first, first + count):
            request.prompt_logprobs[p + 1] = logprob_entries(
                indices[row][:k] if k else [], values[row][:k] if k else [], seq.prompt[p + 1],
                chosen[row], ranks[row], tokenizer)
            row += 1
        done = first + count
        seq.prompt_logits_from = None if done >= len(seq.prompt) - 1 else done
