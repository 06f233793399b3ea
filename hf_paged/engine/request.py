"""A request as the engine keeps it, and the processing of its outputs: appending sampled
tokens, following its text as it grows, deciding when a completion stops, and the snapshot
a caller receives. The engine does the scheduling; this module only says which completion
ended and why (the engine then frees its sequence).
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import weakref
from collections.abc import Mapping
from numbers import Integral
from dataclasses import dataclass, field, replace

import torch

from .detokenizer import IncrementalText
from ..errors import InvalidRequestError, describe
from ..outputs import CompletionOutput, RequestMetrics, RequestOutput
from ..sampling_params import RequestOutputKind, SamplingParams
from ..core.sequence import Sequence
from ..utils import out_of_vocab

logger = logging.getLogger("hf_paged")


def prompt_ids(prompt, params: SamplingParams, tokenizer, vocab_size: int,
               context: int) -> tuple[str | None, list[int]]:
    """(the prompt's text or None, its token ids: tokenized if text, checked, its last
    `params.truncate_prompt_tokens` kept (-1: `context`)). `prompt`: text, token ids, or
    a dict as vLLM takes one (`prompt_fields`). What needs a tokenizer (a text prompt, stop
    strings) is refused without one."""
    text = None
    if params.stop and tokenizer is None:
        raise InvalidRequestError("stop strings are looked for in the text, which needs a "
                                  "tokenizer: give the engine one, or use stop_token_ids.",
                                  "stop")
    if isinstance(prompt, Mapping):
        text, prompt = prompt_fields(prompt)
    if isinstance(prompt, str):
        if tokenizer is None:
            raise InvalidRequestError("A text prompt needs a tokenizer; pass token ids, or "
                                      "give the engine a tokenizer.", "prompt")
        text, prompt = prompt, tokenizer(prompt)["input_ids"]
    if is_array(prompt):  # (a tokenizer's input_ids[0])
        prompt = tensor_ids(prompt)
    try:
        prompt = list(prompt)
    except TypeError:
        raise InvalidRequestError(f"a prompt is text, a list of token ids or a prompt dict; "
                                  f"got {type(prompt).__name__}.", "prompt") from None
    if not set(map(type, prompt)) <= {int}:  # (numpy's integers too)
        if not all(isinstance(t, Integral) and not isinstance(t, bool) for t in prompt):
            raise InvalidRequestError("prompt token ids must be integers.", "prompt")
        prompt = [int(t) for t in prompt]
    bad = out_of_vocab(prompt, vocab_size)
    if bad:
        raise InvalidRequestError(f"prompt token ids must be in [0, {vocab_size}); "
                                  f"got {bad}.", "prompt")
    return text, truncated(prompt, params.truncate_prompt_tokens, context)


def prompt_list(prompts) -> list:
    """`prompts` as a list of prompts: one prompt (text, token ids, a tensor or array of
    them, a prompt dict) becomes a list of one."""
    if is_array(prompts) or isinstance(prompts, (str, Mapping)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], Integral)):
        return [prompts]  # (a tensor's ids are read, and checked, as any)
    return list(prompts)


def is_array(prompt) -> bool:
    """Whether `prompt` is a tensor or a numpy array."""
    return isinstance(prompt, torch.Tensor) or type(prompt).__module__ == "numpy"


def tensor_ids(prompt) -> list[int]:
    """A prompt's token ids given as a tensor or numpy array [T] of integers -> list. A 2-D
    one is refused: a tokenizer's batch is padded, and its pad tokens would run as prompt."""
    prompt = torch.as_tensor(prompt)
    if prompt.dim() != 1 or prompt.dtype.is_floating_point or prompt.dtype.is_complex \
            or prompt.dtype == torch.bool:
        raise InvalidRequestError(
            f"a prompt tensor or array must hold one prompt's token ids, 1-D integers; got "
            f"shape {tuple(prompt.shape)} of {prompt.dtype}. For a batch, pass a list of "
            "prompts (a padded batch's rows would run its pad tokens as prompt).", "prompt")
    return prompt.tolist()


PROMPT_KEYS = ("prompt", "prompt_token_ids", "cache_salt")


def prompt_fields(prompt: Mapping) -> tuple[str | None, str | list[int]]:
    """A prompt dict, vLLM's TextPrompt / TokensPrompt: {"prompt": text} or
    {"prompt_token_ids": ids} (with "prompt", the text reported for them), and an optional
    "cache_salt" (`salted` reads it) -> (the text reported, the text or ids to run)."""
    other = sorted(set(prompt) - set(PROMPT_KEYS))
    if other:
        raise InvalidRequestError(f"a prompt dict takes {list(PROMPT_KEYS)}; got {other} "
                                  "(text-only models).", "prompt")
    text, ids = prompt.get("prompt"), prompt.get("prompt_token_ids")
    if text is not None and not isinstance(text, str):
        raise InvalidRequestError(f"a prompt dict's \"prompt\" is text; got "
                                  f"{type(text).__name__}.", "prompt")
    if ids is None:
        if text is None:
            raise InvalidRequestError('a prompt dict needs "prompt" (text) or '
                                      '"prompt_token_ids".', "prompt")
        return text, text
    if isinstance(ids, str):
        raise InvalidRequestError('"prompt_token_ids" is a list of token ids; got text.',
                                  "prompt")
    return text, ids


def salted(params: SamplingParams, prompt, cache_salt: str | None) -> SamplingParams:
    """`params` with the request's prefix-cache salt, which may also come as an argument of
    its own or in a prompt dict: given more than once, the values must agree."""
    given = {s for s in (params.cache_salt, cache_salt,
                         prompt.get("cache_salt") if isinstance(prompt, Mapping) else None)
             if s is not None}
    if len(given) > 1:
        raise InvalidRequestError("cache_salt is given twice, with different values.",
                                  "cache_salt")
    if given and params.cache_salt is None:
        params = replace(params, cache_salt=given.pop())  # checked as SamplingParams'
    return params


def truncated(ids: list[int], keep: int | None, context: int) -> list[int]:
    """A prompt's ids as `truncate_prompt_tokens` leaves them: the last `keep` (-1: the
    last `context`), all of them for None."""
    return ids if keep is None else ids[-(context if keep == -1 else keep):]


@dataclass
class EngineRequest:
    """One request (made by `LLMEngine.prepare_request`, queued by `add_prepared`)."""

    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams  # resolved
    priority: int
    adapter: str | None
    salt: bytes  # prefix-cache namespace
    completions: list[CompletionOutput]
    generators: list[torch.Generator | None]
    stop_ids: set[int]
    metrics: RequestMetrics
    texts: list[IncrementalText] | None  # per completion, when text is followed as it grows
    deadline: float | None = None  # time.monotonic() past which it ends ("timeout")
    seqs: list[Sequence] = field(default_factory=list)
    error: str | None = None
    unfinished: int = -1  # completions still running (counted down by _ended)
    prompt_logprobs: list | None = None  # per prompt token (prompt_logprobs.record fills it)
    matchers: list | None = None  # per completion, its structured-output constraint's state
    hold: int = 0  # trailing characters a running completion's snapshot leaves out
    bad_words: list[list[int]] | None = None  # the token ids of params.bad_words
    sent: list | None = None  # per completion, what its last delta output ended at

    def __post_init__(self):
        self.unfinished = sum(1 for c in self.completions if not c.finished)
        if self.params.stop and not self.params.include_stop_str_in_output:
            # What the next tokens may complete into a stop string, which the text is then
            # cut before: a stream shows it once no stop string can (a stream only grows).
            self.hold = max(len(s) for s in self.params.stop) - 1
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * len(self.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.unfinished == 0

    def append(self, seq: Sequence, k: int, token: int, logprobs, token_logprob,
               now: float) -> None:
        """Completion k (sequence `seq`) sampled `token`."""
        seq.output.append(token)
        out = self.completions[k]
        out.token_ids = seq.output
        if logprobs is not None:
            out.logprobs.append(logprobs)
            out.cumulative_logprob += token_logprob
        if self.metrics.first_token_time is None:
            self.metrics.first_token_time = now

    def stop(self, seq: Sequence, k: int, eos_ids: set[int]) -> str | None:
        """After completion k's newest token: "stop" or "length" if it has ended (its
        finish_reason, stop_reason and text then set), else None."""
        out, params = self.completions[k], self.params
        token = seq.output[-1]
        if self.matchers is not None and not self.matchers[k].accept(token):
            raise ValueError(f"token {token} breaks its structured-output constraint")
        before = 0
        stopping = token in self.stop_ids  # (masked until min_tokens, so never too early)
        if self.texts is not None:  # the text grows with each token (held back while later
            before = len(out.text)  # tokens may change it); the last token settles it, so
            if stopping:  # that stop strings below see every character
                self.texts[k].finish(seq.output if params.include_stop_str_in_output
                                     else seq.output[:-1])
            elif len(seq.output) >= seq.max_tokens:
                self.texts[k].finish(seq.output)
            else:
                self.texts[k].update(seq.output)
            out.text = self.texts[k].text
        if (params.stop and self.texts is not None and len(out.text) > before
                and len(seq.output) > params.min_tokens):  # (vLLM's rule for stop strings)
            # A stop string ends in the new text (also text that only a stop token's end of
            # the completion settled): one wholly before it was there before min_tokens (as
            # vLLM), and a stream may have shown it.
            hits = [(at, s) for at, s in ((out.text.find(s, max(0, before - len(s) + 1)), s)
                                          for s in params.stop) if at >= 0]
            if hits:
                # The one that ends first, of those ending together the first listed: what
                # vLLM finds when the text comes a character at a time, however it comes.
                at, out.stop_reason = min(hits, key=lambda hit: hit[0] + len(hit[1]))
                # cut before the stop string, or after it
                out.text = out.text[:at + (len(out.stop_reason)
                                           if params.include_stop_str_in_output else 0)]
                return self._ended(k, "stop", flush=False)
        if stopping:
            eos = token in eos_ids and token not in params.stop_token_ids
            out.stop_reason = None if eos else token
            return self._ended(k, "stop")
        if self.matchers is not None and self.matchers[k].done:  # (ended by an EOS it took)
            return self._ended(k, "stop")
        if len(seq.output) >= seq.max_tokens:
            return self._ended(k, "length")
        return None

    def end(self, reason: str) -> None:
        """Ends every completion still running with `reason` (its text as far as it got;
        a failed one's text is not decoded further)."""
        for k, out in enumerate(self.completions):
            if out.finish_reason is None:
                with contextlib.suppress(Exception):  # its text so far stands
                    self._ended(k, reason, flush=reason != "error")

    def _ended(self, k: int, reason: str, flush: bool = True) -> str:
        out = self.completions[k]
        if out.finish_reason is None:
            self.unfinished -= 1
        out.finish_reason = reason
        if self.texts is not None and flush:
            out.text = self.texts[k].text  # kept if finishing the decode raises
            self.texts[k].finish(self._text_ids(out))
            out.text = self.texts[k].text
        return reason

    def _text_ids(self, out: CompletionOutput) -> list[int]:
        """The tokens whose text is the completion's: all of them but a stop token (EOS or
        one of stop_token_ids) that ended it, which is kept only with
        include_stop_str_in_output (as vLLM)."""
        ids = out.token_ids
        if (out.finish_reason == "stop" and ids and ids[-1] in self.stop_ids
                and not isinstance(out.stop_reason, str)
                and not self.params.include_stop_str_in_output):
            return ids[:-1]
        return ids

    def output(self, tokenizer) -> RequestOutput:
        """A snapshot (later steps do not change it), of everything or, for output_kind
        "delta", of what is new since the last. Text not followed token by token is decoded
        once its completion has ended; if that fails, the request ends with the error (its
        tokens stand)."""
        delta = self.params.output_kind is RequestOutputKind.DELTA
        first = self.sent is None
        if delta and first:
            self.sent = [(0, 0, False)] * len(self.completions)
        completions = []
        for out in self.completions:
            if (self.texts is None and tokenizer is not None and out.finished
                    and out.token_ids and not out.text and self.params.detokenize):
                try:
                    out.text = tokenizer.decode(self._text_ids(out), skip_special_tokens=(
                        self.params.skip_special_tokens))
                except Exception as err:  # noqa: BLE001 (this request's text alone)
                    self.error = self.error or f"its text could not be decoded: {describe(err)}"
                    logger.warning("hf-paged: request %s: %s", self.request_id, self.error)
            text = out.text
            if self.hold and not out.finished:
                text = text[:max(0, len(text) - self.hold)]
            tokens = chars = 0  # where this output starts (a delta: where the last ended)
            if delta:
                tokens, chars, ended = self.sent[out.index]
                if len(out.token_ids) == tokens and len(text) == chars and out.finished == ended:
                    continue  # nothing new: left out
                self.sent[out.index] = (len(out.token_ids), len(text), out.finished)
            completions.append(CompletionOutput(  # field by field: replace() is slow
                out.index, text[chars:], out.token_ids[tokens:], out.cumulative_logprob,
                None if out.logprobs is None else out.logprobs[tokens:], out.finish_reason,
                out.stop_reason))
        prompt_logprobs = None  # (a delta stream's come with its first output)
        if self.prompt_logprobs is not None and (first or not delta):
            prompt_logprobs = list(self.prompt_logprobs)
        seq = self.seqs[0] if self.seqs else None
        m = self.metrics
        return RequestOutput(self.request_id, self.prompt, self.prompt_ids, completions,
                             self.finished, self.error, seq.cached_tokens if seq else 0,
                             RequestMetrics(m.arrival_time, seq and seq.first_scheduled,
                                            m.first_token_time, m.finished_time),
                             prompt_logprobs)


class Deadlines:
    """The deadlines of the requests that have one, soonest first. Entries hold their
    requests weakly, so a request that ends early is let go at once rather than at its
    deadline; entries of ended requests are dropped once they outnumber the live ones."""

    def __init__(self):
        self._heap: list = []  # (deadline, tie-break, weakref to the EngineRequest)
        self._ties = itertools.count()

    def add(self, request: EngineRequest, live: int) -> None:
        """`live`: how many requests the engine holds (for pruning)."""
        heapq.heappush(self._heap, (request.deadline, next(self._ties), weakref.ref(request)))
        if len(self._heap) > 2 * live + 64:
            self._heap = [e for e in self._heap if _running(e[2]())]
            heapq.heapify(self._heap)

    def due(self, now: float) -> bool:
        return bool(self._heap) and self._heap[0][0] <= now

    def expired(self, now: float) -> list[EngineRequest]:
        """Pops the requests past their deadline that are still running."""
        out = []
        while self.due(now):
            request = heapq.heappop(self._heap)[2]()
            if _running(request):
                out.append(request)
        return out


def _running(request: EngineRequest | None) -> bool:
    return request is not None and not request.finished
