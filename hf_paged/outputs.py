"""What the engine returns for a request, in the style of vLLM's `RequestOutput`."""

from __future__ import annotations

from dataclasses import dataclass, field, replace


class Logprob(float):
    """A token's log-probability: a float that also reads as vLLM's `Logprob`, with
    `.logprob` (the value), `.rank` (1 for the most likely token; ties rank alike low, as
    vLLM counts) and `.decoded_token` (the token's own text, decoded on access; None
    without a tokenizer)."""

    __slots__ = ("rank", "_token", "_tokenizer", "_text")

    def __new__(cls, value: float, rank: int | None = None, token: int | None = None,
                tokenizer=None, text: str | None = None):
        self = super().__new__(cls, value)
        self.rank, self._token, self._tokenizer, self._text = rank, token, tokenizer, text
        return self

    @property
    def logprob(self) -> float:
        return float(self)

    @property
    def decoded_token(self) -> str | None:
        if self._text is None and self._tokenizer is not None and self._token is not None:
            self._text = self._tokenizer.decode([self._token])
        return self._text

    def __reduce__(self):  # (a copy or a pickle keeps the text, not the tokenizer)
        return Logprob, (float(self), self.rank, self._token, None, self.decoded_token)


def logprob_entries(ids: list[int], values: list[float], token: int, value: float,
                    rank: int, tokenizer=None) -> dict[int, Logprob]:
    """{token id: Logprob} of the most likely `ids` (ranks 1, 2, ...) and of the `token`
    chosen (its own `rank`)."""
    entry = {t: Logprob(v, r, t, tokenizer) for r, (t, v) in enumerate(zip(ids, values), 1)}
    entry[token] = Logprob(value, rank, token, tokenizer)
    return entry


@dataclass
class CompletionOutput:
    """One of a request's `n` completions (its fields in vLLM's order).

    token_ids:          generated tokens (an EOS or stop token that ended it included)
    text:               their text (empty without a tokenizer); a stop string is cut off
    cumulative_logprob: the sum of the generated tokens' log-probabilities, when asked for
    logprobs:           per generated token, {token id: log-probability (a `Logprob`)} of
                        the `logprobs` most likely tokens and the sampled one, when asked for
    finish_reason:      None while running, else "stop", "length", "abort" or "error"
    stop_reason:        the stop string or token id that ended it, if any
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

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
                c.index, mine.text + c.text, mine.token_ids + c.token_ids, c.cumulative_logprob,
                None if c.logprobs is None else (mine.logprobs or []) + c.logprobs,
                c.finish_reason, c.stop_reason)
        prompt_logprobs = later.prompt_logprobs if self.prompt_logprobs is None \
            else self.prompt_logprobs
        return replace(later, outputs=[joined[i] for i in sorted(joined)],
                       prompt_logprobs=prompt_logprobs)
