"""Next tokens from a step's logits, each row with its request's own settings.

Rows are processed together: `penalize` applies, in vLLM's order, the allowed-token mask,
the logit bias, Transformers' repetition penalty, OpenAI's presence/frequency penalties and
the min-tokens mask; `warp` then applies, to sampled rows,
temperature, top-k, top-p and min-p (Transformers' warpers, in its order, with its tie and
minimum-kept rules). Greedy rows take the argmax of the penalized logits. Sampling draws one
exponential per vocabulary entry and takes argmax(p / e), which is a draw from p; a seeded
request draws its exponentials from a generator of its own, so its tokens do not depend on
the batch. A row whose distribution is not a distribution (NaN, +inf, or nothing left to
draw from) gets no token: it is reported in `SampleResult.failed`, and the other rows are
not affected.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..errors import InvalidRequestError, describe
from ..kernels import cpu_ops
from ..outputs import logprob_entries
from ..sampling_params import SamplingParams
from .structured import Matcher, mask_rows

logger = logging.getLogger("hf_paged")


NOT_FINITE = ("its next-token distribution is not finite (NaN or infinity from the model's "
              "logits or its sampling settings)")
MASKED = ("; its settings may allow no token here (allowed_token_ids, logit_bias, bad_words, "
          "min_tokens and stop_token_ids, its structured output)")


def failure(row: "SampleRow") -> str:
    """Why a row had nothing to sample from, naming its masks if it has any."""
    params = row.params
    masks = (row.grammar is not None or row.suppress or row.bad_words
             or params.allowed_token_ids is not None or params.logit_bias)
    return NOT_FINITE + MASKED if masks else NOT_FINITE


@dataclass
class SampleRow:
    """One row of the logits: the request's settings and what it has seen so far."""

    params: SamplingParams  # resolved
    prompt: list[int]
    output: list[int]
    generator: torch.Generator | None = None
    suppress: list[int] | None = None  # token ids masked at this step (min_tokens; ended
    # by `lift_suppression`, which keeps `plain` true to it)
    grammar: Matcher | None = None  # its completion's structured-output constraint
    bad_words: list[list[int]] | None = None  # token ids of words never generated

    def __post_init__(self):  # read per row per step: plain attributes, not properties
        self.states = None  # a list: the generator's state is added after each draw
        self.greedy = self.params.greedy
        self.logprobs = self.params.logprobs is not None
        self.penalized = self.params.adjusts_logits
        self._plain()

    def _plain(self) -> None:
        # Greedy with nothing to apply first and nothing to report: the argmax alone.
        self.plain = (self.greedy and not self.logprobs and not self.penalized
                      and self.suppress is None and self.grammar is None)

    def lift_suppression(self) -> None:
        """Its completion reached min_tokens: stop tokens are no longer masked."""
        self.suppress = None
        self._plain()


@dataclass
class SampleResult:
    tokens: list[int]
    logprobs: list[dict[int, float] | None]  # per row, when asked for
    token_logprobs: list[float | None]
    failed: list[int]  # rows with no valid distribution (their tokens are meaningless)


def _padded(lists: list[list[int]], fill: int, device) -> torch.Tensor:
    """[len(lists), longest] int64: each list, then `fill`."""
    width = max(1, max(len(x) for x in lists))
    return torch.tensor([x + [fill] * (width - len(x)) for x in lists], dtype=torch.long,
                        device=device)


class Sampled:
    """A step's tokens as sampled on the device: `tokens` [R] (long) stays there, where the
    next step's inputs can read it (async scheduling); `collect()` brings tokens, validity
    and logprobs to the host, waiting only for the sampling (copies queued right after it)."""

    def __init__(self, tokens: torch.Tensor, valid: torch.Tensor | None, raw, rows, want,
                 done: tuple | None = None, tokenizer=None):
        self.tokens, self._rows, self._want, self._done = tokens, rows, want, done
        self.tokenizer = tokenizer  # (the logprobs' decoded_token)
        if done is not None:  # sampled row by row, already on the host
            return
        self._event, self._on_host = None, not want and tokens.device.type == "cpu"
        if self._on_host:  # nothing to copy (nor to stack first)
            self._host = [tokens, valid]
            return
        host = [torch.stack([tokens, valid.long()])]
        if want:
            idx = torch.tensor(want, device=tokens.device)
            lp = raw[idx]
            k = min(max(rows[i].params.logprobs for i in want), lp.shape[1])
            top = lp.topk(max(k, 1), -1)
            chosen = lp.gather(1, tokens[idx][:, None])
            host += [top.values, top.indices, chosen[:, 0], (lp >= chosen).sum(1)]
        # Non-blocking copies: a later wait covers them and nothing queued after them.
        self._host = [t.to("cpu", non_blocking=True) for t in host]
        if tokens.is_cuda:
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(tokens.device))  # the copies' stream

    def collect(self) -> tuple["SampleResult", dict[int, str]]:
        """(the rows' tokens and logprobs, {row: error} for rows with no distribution)."""
        if self._done is not None:
            return self._done
        if self._event is not None:
            self._event.synchronize()
        token_list, valid_list = ([t.tolist() for t in self._host] if self._on_host
                                  else self._host[0].tolist())
        failed = [] if all(valid_list) else [i for i, ok in enumerate(valid_list) if not ok]
        rows = self._rows
        logprobs: list = [None] * len(rows)
        token_logprobs: list = [None] * len(rows)
        if self._want:
            values, indices, chosen, ranks = (t.tolist() for t in self._host[1:])
            for j, i in enumerate(self._want):
                n = rows[i].params.logprobs
                logprobs[i] = logprob_entries(indices[j][:n], values[j][:n], token_list[i],
                                              chosen[j], ranks[j], self.tokenizer)
                token_logprobs[i] = chosen[j]
        result = SampleResult(token_list, logprobs, token_logprobs, failed)
        return result, {j: failure(rows[j]) for j in failed}


class Sampler:
    """generator: where the rows without a seed of their own draw from (None: torch's
    default generator)."""

    def __init__(self, tokenizer=None, generator: torch.Generator | None = None):
        self.tokenizer = tokenizer  # (what the logprobs' decoded_token decodes with)
        self.generator = generator

    def __call__(self, logits: torch.Tensor, rows: list[SampleRow],
                 noise: torch.Tensor | None = None) -> SampleResult:
        """logits [S, V] (any float dtype) -> one token per row. noise: the rows'
        exponentials [S, V] drawn beforehand by `noise` (drawn here if not given), so that
        a caller sampling the rows again draws nothing twice from a seeded generator."""
        return self.launch(logits, rows, noise).collect()[0]

    def launch(self, logits: torch.Tensor, rows: list[SampleRow],
               noise: torch.Tensor | None = None) -> Sampled:
        """`__call__` without waiting for the device: the tokens as a `Sampled`."""
        if all([r.plain for r in rows]):  # (most steps: one pass over the rows)
            return Sampled(*greedy(logits), None, rows, [])
        logits = logits.float()
        want_logprobs = [i for i, r in enumerate(rows) if r.logprobs]
        raw = torch.log_softmax(logits, -1) if want_logprobs else None
        constrained = [i for i, r in enumerate(rows) if r.grammar is not None]
        if constrained:  # in place: masking again (rows sampled apart) changes nothing
            complete = mask_rows(logits, constrained, [rows[i].grammar for i in constrained],
                                 [rows[i].suppress for i in constrained])
            for j in complete:  # its constraint allows nothing but its end: min_tokens
                rows[constrained[j]].lift_suppression()  # does not hold that back
        if any([r.penalized or r.suppress for r in rows]):  # (a list: faster than a generator)
            logits = self.penalize(logits.clone(), rows)  # the caller's logits stay as given
        greedy_rows = [r.greedy for r in rows]
        if all(greedy_rows):
            tokens, valid = greedy(logits)
        else:
            scores = self.warp(logits, rows)
            if noise is None:
                noise = self.noise(logits.shape[0], logits.shape[1], rows, logits.device)
            tokens = self._draw(logits, scores, noise, greedy_rows)
            valid = torch.where(torch.tensor(greedy_rows, device=logits.device), _valid(logits),
                                _valid(scores))
        return Sampled(tokens, valid, raw, rows, want_logprobs, tokenizer=self.tokenizer)

    # -- processors -----------------------------------------------------------------------
    def sample_isolated(self, logits: torch.Tensor, rows: list[SampleRow]) -> Sampled:
        """The rows' tokens for logits [S, V] (`collect()` also names the rows that failed).
        If sampling the rows together raises, each row is sampled alone with the same noise
        (drawn once, before, so a seeded generator is never drawn from twice): one row's
        failure costs only its own request, and every other row gets the token it would
        have got."""
        noise = self.noise(logits.shape[0], logits.shape[1], rows, logits.device)
        try:
            return self.launch(logits, rows, noise)
        except Exception as err:  # noqa: BLE001
            logger.warning("hf-paged: sampling %d rows together failed (%s); sampling them "
                           "apart", len(rows), describe(err))
        tokens, lps, tlps, errors = [], [], [], {}
        for j, row in enumerate(rows):
            try:
                one = self(logits[j:j + 1], [row], None if noise is None else noise[j:j + 1])
                if one.failed:
                    errors[j] = failure(row)
            except Exception as row_err:  # noqa: BLE001
                one, errors[j] = None, f"sampling failed: {describe(row_err)}"
            tokens.append(one.tokens[0] if one else 0)
            lps.append(one.logprobs[0] if one else None)
            tlps.append(one.token_logprobs[0] if one else None)
        result = SampleResult(tokens, lps, tlps, sorted(errors))
        return Sampled(torch.tensor(tokens, device=logits.device), None, None, rows, [],
                       done=(result, errors))

    def penalize(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """Allowed tokens, bias, penalties and min-tokens masking, in place: [S, V] float32
        -> the same."""
        vocab, device = logits.shape[1], logits.device
        allowing = [i for i, r in enumerate(rows) if r.params.allowed_token_ids is not None]
        if allowing:
            idx = torch.tensor(allowing, device=device)
            ids = _stacked([_token_tensors(rows[i].params, device)[0] for i in allowing], vocab)
            keep = torch.zeros(len(allowing), vocab + 1, dtype=torch.bool, device=device)
            keep.scatter_(1, ids, True)
            logits[idx] = logits[idx].masked_fill(~keep[:, :vocab], float("-inf"))
        biased = [i for i, r in enumerate(rows) if r.params.logit_bias is not None]
        if biased:
            idx = torch.tensor(biased, device=device)
            pairs = [_token_tensors(rows[i].params, device)[1:] for i in biased]
            ids = _stacked([p[0] for p in pairs], vocab)
            values = _stacked([p[1] for p in pairs], 0).to(logits.dtype)
            ext = torch.cat([logits[idx], logits.new_zeros(len(biased), 1)], 1)
            logits[idx] = ext.scatter_add(1, ids, values)[:, :vocab]
        rep = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
        if rep:
            idx = torch.tensor(rep, device=device)
            ids = _padded([rows[i].prompt + rows[i].output for i in rep], vocab, device)
            ext = torch.cat([logits[idx], logits.new_zeros(len(rep), 1)], 1)
            scores = ext.gather(1, ids)
            penalty = torch.tensor([rows[i].params.repetition_penalty for i in rep],
                                   device=device)[:, None]
            scores = torch.where(scores < 0, scores * penalty, scores / penalty)
            logits[idx] = ext.scatter(1, ids, scores)[:, :vocab]
        additive = [i for i, r in enumerate(rows)
                    if r.params.presence_penalty or r.params.frequency_penalty]
        if additive:
            idx = torch.tensor(additive, device=device)
            ids = _padded([rows[i].output for i in additive], vocab, device)
            counts = torch.zeros(len(additive), vocab + 1, device=device)
            counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=counts.dtype))
            counts = counts[:, :vocab]
            presence = torch.tensor([rows[i].params.presence_penalty for i in additive],
                                    device=device)[:, None]
            frequency = torch.tensor([rows[i].params.frequency_penalty for i in additive],
                                     device=device)[:, None]
            logits[idx] -= frequency * counts + presence * (counts > 0)
        masked = []  # (row, its masked tokens): one entry per row, both masks in it
        for i, r in enumerate(rows):
            if r.suppress or r.bad_words:
                tokens = (r.suppress or []) + (_banned(r.bad_words, r.output) if r.bad_words
                                               else [])
                if tokens:
                    masked.append((i, tokens))
        if masked:
            idx = torch.tensor([i for i, _ in masked], device=device)
            ids = _padded([tokens for _, tokens in masked], vocab, device)
            ext = torch.cat([logits[idx], logits.new_zeros(len(masked), 1)], 1)
            logits[idx] = ext.scatter(1, ids, float("-inf"))[:, :vocab]
        return logits

    def warp(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p of sampled rows: penalized logits [S, V] -> scores
        whose softmax is the distribution drawn from (greedy rows pass unchanged)."""
        device = logits.device
        params = [r.params for r in rows]
        greedy = [p.greedy for p in params]
        vocab = logits.shape[1]
        temperature = torch.tensor([1.0 if g else p.temperature for g, p in zip(greedy, params)],
                                   device=device)
        scores = logits / temperature[:, None]
        # top_k at or above the vocabulary keeps every token (as vLLM).
        top_k = [0 if g or p.top_k in (0, -1) or p.top_k >= vocab else p.top_k
                 for g, p in zip(greedy, params)]
        if any(top_k):
            k = torch.tensor([k or vocab for k in top_k], device=device)
            kth = scores.topk(int(k.max()), -1).values.gather(1, (k - 1)[:, None])
            scores = scores.masked_fill(scores < kth, float("-inf"))
        top_p = [1.0 if g else p.top_p for g, p in zip(greedy, params)]
        if any(p < 1.0 for p in top_p):
            sorted_scores, order = scores.sort(-1)  # ascending, as Transformers
            cumulative = sorted_scores.softmax(-1).cumsum(-1)
            remove = cumulative <= 1 - torch.tensor(top_p, device=device)[:, None]
            remove[:, -1] = False  # keep at least one token
            scores = scores.masked_fill(remove.scatter(1, order, remove), float("-inf"))
        min_p = [0.0 if g else p.min_p for g, p in zip(greedy, params)]
        if any(min_p):
            probs = scores.softmax(-1)
            floor = torch.tensor(min_p, device=device)[:, None] * probs.amax(-1, keepdim=True)
            remove = probs < floor
            remove.scatter_(1, probs.argmax(-1, keepdim=True), False)  # keep at least one
            scores = scores.masked_fill(remove, float("-inf"))
        return scores

    def noise(self, count: int, vocab: int, rows: list[SampleRow],
              device) -> torch.Tensor | None:
        """One exponential per row and vocabulary entry [count, V] (None if every row is
        greedy); a seeded row's come from its own generator, the only draw from it."""
        if all([r.greedy for r in rows]):
            return None
        noise = torch.empty(count, vocab, device=device).exponential_(generator=self.generator)
        for i, row in enumerate(rows):
            if row.generator is not None and not row.greedy:
                noise[i] = torch.empty(vocab, device=device).exponential_(
                    generator=row.generator)
                if row.states is not None:  # (speculation rewinds past unused draws)
                    row.states.append(row.generator.get_state())
        return noise

    @staticmethod
    def _draw(logits, scores, noise, greedy):
        sampled = (scores.softmax(-1) / noise).argmax(-1)
        return torch.where(torch.tensor(greedy, device=logits.device), logits.argmax(-1),
                           sampled)


def greedy(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [S, V] -> (tokens [S] int64: each row's first maximum, valid [S] bool: that
    maximum is finite, which a NaN anywhere in the row spoils)."""
    fast = cpu_ops.greedy(logits)  # (torch.max's indices run a scalar loop on CPU)
    if fast is not None:
        return fast
    best, tokens = logits.max(-1)  # argmax's first-maximum index, and the maximum itself
    return tokens, torch.isfinite(best)


def _token_tensors(params: SamplingParams, device) -> tuple:
    """(allowed token ids [A] or None, biased token ids [B], their biases [B] float32) of a
    request's settings, made once per request and device (kept on the params object)."""
    cache = params.__dict__.setdefault("_token_tensors", {})
    hit = cache.get(device)
    if hit is None:
        allowed = params.allowed_token_ids
        bias = params.logit_bias or {}
        hit = cache[device] = (
            None if allowed is None else torch.tensor(allowed, dtype=torch.long, device=device),
            torch.tensor(list(bias), dtype=torch.long, device=device),
            torch.tensor(list(bias.values()), dtype=torch.float32, device=device))
    return hit


def _stacked(tensors: list[torch.Tensor], fill) -> torch.Tensor:
    """1-D tensors -> [len(tensors), longest], each padded with `fill`."""
    return torch.nn.utils.rnn.pad_sequence(tensors, batch_first=True, padding_value=fill)


def bad_word_ids(words: list[str], tokenizer, vocab_size: int) -> list[list[int]]:
    """The token ids of each word as the text's first word and, where that gives as many
    tokens and a different first one, after a space (vLLM's rule). InvalidRequestError
    without a tokenizer, or for a word whose tokens the model does not have."""
    if tokenizer is None:
        raise InvalidRequestError("bad_words needs a tokenizer: give the engine one.",
                                  "bad_words")
    out = []
    for word in words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        out += [bare] if bare else []
        if spaced and len(spaced) == len(bare) and spaced[0] != bare[0]:
            out.append(spaced)
    unknown = sorted({t for ids in out for t in ids if not 0 <= t < vocab_size})
    if unknown:
        raise InvalidRequestError(f"bad_words: the tokenizer gives token ids the model does "
                                  f"not have (its vocabulary is [0, {vocab_size})): "
                                  f"{unknown[:5]}.", "bad_words")
    return out


def _banned(words: list[list[int]], output: list[int]) -> list[int]:
    """The tokens that would end one of `words` after `output`."""
    n = len(output)
    return [w[-1] for w in words if len(w) - 1 <= n and output[n - len(w) + 1:] == w[:-1]]


def _valid(scores: torch.Tensor) -> torch.Tensor:
    """[S, V] -> [S] bool: the row is a distribution to draw from (no NaN or +inf, and at
    least one finite entry): exactly when its maximum, which NaN propagates to, is finite."""
    return torch.isfinite(scores.amax(-1))
