"""What the engine returns for a request, in the style of vLLM's `RequestOutput`."""

from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass
class CompletionOutput:
    """One of a request's `n` completions.

    token_ids:     generated tokens (an EOS or stop token that ended it included)
    text:          their text (empty without a tokenizer); a stop string is cut off
    finish_reason: None while running, else "stop", "length", "abort" or "error"
    stop_reason:   the stop string or token id that ended it, if any
    logprobs:      per generated token, {token id: log-probability} of the `logprobs` most
                   likely tokens and the sampled one, when asked for
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Times (time.monotonic seconds) of one request's life, for latency figures."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    """The state of a request: its prompt and completions so far (`finished` once all
    completions have ended). `error` says why a request was rejected or failed.
    `prompt_logprobs` (when asked for): per prompt token, None for the first, else
    {token id: log-probability} of the `prompt_logprobs` most likely tokens at its position
    and of the prompt's own token."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    error: str | None = None
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None

    def add(self, later: "RequestOutput") -> "RequestOutput":
        """This delta output (output_kind "delta") and `later`, a later delta of the same
        request, as one delta: texts, tokens and logprobs joined, the rest `later`'s."""
        joined = {c.index: c for c in self.outputs}
        for c in later.outputs:
            mine = joined.get(c.index)
            joined[c.index] = c if mine is None else CompletionOutput(
                c.index, mine.text + c.text, mine.token_ids + c.token_ids, c.finish_reason,
                c.stop_reason, None if c.logprobs is None else (mine.logprobs or []) + c.logprobs,
                c.cumulative_logprob)
        prompt_logprobs = later.prompt_logprobs if self.prompt_logprobs is None \
            else self.prompt_logprobs
        return replace(later, outputs=[joined[i] for i in sorted(joined)],
                       prompt_logprobs=prompt_logprobs)
