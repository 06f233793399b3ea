"""Per-request generation settings of the engine, in the style of vLLM's `SamplingParams`."""

from __future__ import annotations

import enum
import json as _json
import math
import numbers
from dataclasses import dataclass, field, fields, replace
from typing import Any

from .errors import InvalidRequestError
from .utils import out_of_vocab

# vLLM's defaults, for settings neither the request nor the model's generation_config gives.
FALLBACKS = dict(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0,
                 max_tokens=16)
# A temperature below this samples greedily (as vLLM): dividing logits by it would overflow.
GREEDY_BELOW = 1e-5
# Repetition penalties beyond these turn logits into infinities (and the softmax into NaN).
REPETITION_PENALTY_RANGE = (1e-4, 1e4)
SEED_RANGE = (-2**63, 2**64 - 1)  # what torch.Generator.manual_seed takes
FLOAT32_MAX = 3.4028234663852886e38
MAX_LOGPROBS = 20  # log-probabilities a request may ask for per token (vLLM's default cap)


class RequestOutputKind(str, enum.Enum):
    """What each output of a running request holds (vLLM's names)."""

    CUMULATIVE = "cumulative"  # everything so far
    DELTA = "delta"  # only what is new since the request's last output
    FINAL_ONLY = "final_only"  # nothing until the request has ended, then everything


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on a completion's text (vLLM's names; give exactly one):

    json:        a JSON schema (dict or JSON string): the text is a JSON value it validates
    regex:       the text matches this regular expression in full
    choice:      the text is one of these strings
    grammar:     the text is in the language of this EBNF grammar (GBNF, root rule `root`)
    json_object: the text is a JSON object (any)

    Decoding masks, at each step, the tokens no completion of the constraint can start
    with; EOS is allowed exactly when the text so far is complete. Needs the `structured`
    extra (xgrammar) and a tokenizer."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self):
        if not isinstance(self.json_object, bool):
            raise InvalidRequestError("structured_outputs.json_object must be true or false; "
                                      f"got {self.json_object!r:.100}.", "structured_outputs")
        given = [name for name in ("json", "regex", "choice", "grammar")
                 if getattr(self, name) is not None] + (["json_object"] if self.json_object
                                                        else [])
        if len(given) != 1:
            raise InvalidRequestError("StructuredOutputsParams takes exactly one of json, "
                                      f"regex, choice, grammar, json_object; got {given}.",
                                      "structured_outputs")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise InvalidRequestError("structured_outputs.json must be a JSON schema (an "
                                      f"object or a JSON string); got {type(self.json).__name__}.",
                                      "structured_outputs")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise InvalidRequestError(f"structured_outputs.{name} must be a non-empty "
                                          f"string; got {value!r:.100}.", "structured_outputs")
        if self.choice is not None:
            if not (isinstance(self.choice, (list, tuple)) and self.choice
                    and all(isinstance(c, str) and c for c in self.choice)):
                raise InvalidRequestError("structured_outputs.choice must be a list of "
                                          f"non-empty strings; got {self.choice!r:.100}.",
                                          "structured_outputs")
            object.__setattr__(self, "choice", list(self.choice))

    @property
    def key(self) -> tuple[str, str]:
        """(kind, text) naming the constraint (one compiled grammar per distinct key)."""
        if self.json is not None:
            text = self.json if isinstance(self.json, str) else _json.dumps(self.json,
                                                                            sort_keys=True)
            return "json", text
        if self.json_object:
            return "json_object", ""
        if self.choice is not None:
            return "choice", _json.dumps(self.choice)
        return ("regex", self.regex) if self.regex is not None else ("grammar", self.grammar)


@dataclass
class SamplingParams:
    """How one request is generated. Every setting is the request's own: requests with
    different settings share a batch.

    n:                  completions of the prompt (they share its cached blocks)
    max_tokens:         tokens to generate at most ("length" ends the completion)
    temperature:        0 (or below 1e-5) is greedy; otherwise logits are divided by it
    top_p, top_k, min_p: nucleus, top-k (0 or -1: off) and min-p filtering, as Transformers'
                        warpers do, in the order temperature, top-k, top-p, min-p
    repetition_penalty: Transformers' multiplicative penalty on prompt and output tokens
                        (1e-4 to 1e4)
    presence_penalty, frequency_penalty: OpenAI's additive penalties on output tokens
    seed:               a generator of the request's own: the same tokens alone or in a batch
                        (any integer torch takes, -2**63 .. 2**64-1; completion i uses seed + i)
    stop:               strings that end a completion ("stop"); they are not in the text
                        unless include_stop_str_in_output
    stop_token_ids:     token ids that end a completion ("stop"); they are in `token_ids`,
                        and their text (as an EOS's) is not in `text` unless
                        include_stop_str_in_output
    include_stop_str_in_output: keep the stop string or stop token that ended a completion
                        at the end of its text
    ignore_eos:         keep going past the model's EOS token
    min_tokens:         EOS and stop token ids are masked until this many tokens are out
                        (a structured output that is complete and allows nothing but its
                        end ends there, shorter)
    logprobs:           return the log-probabilities (of the model's raw distribution) of
                        this many most likely tokens at each step, plus the sampled one's
    prompt_logprobs:    the same for every prompt token after the first (the first has none),
                        given the tokens before it: `RequestOutput.prompt_logprobs`
    structured_outputs: a `StructuredOutputsParams` constraint on the text (JSON schema,
                        regex, choice, grammar); each completion follows it
    cache_salt:         prefix-cache namespace: prompts with different salts never share
                        cached blocks (one salt per tenant), as vLLM's `cache_salt`
    timeout:            seconds from arrival after which the request ends ("timeout"),
                        queued or running; its blocks are freed at once
    logit_bias:         {token id: bias} added to those tokens' logits before penalties and
                        sampling (greedy included), as vLLM's and OpenAI's `logit_bias`
    allowed_token_ids:  only these tokens may be generated (the others are masked)
    bad_words:          words never generated: the last token of each word's token ids (with
                        and without a leading space) is masked when the output ends with the
                        ones before it (vLLM's rule; needs a tokenizer)
    skip_special_tokens: leave special tokens out of the text (the token ids keep them)
    detokenize:         False: no text at all (token ids only; no stop strings)
    truncate_prompt_tokens: keep only the prompt's last k tokens (-1: the model's context)
    output_kind:        what the outputs of `LLMEngine.step` and `AsyncLLM` streams hold
                        (`RequestOutputKind` or its value): "cumulative" (everything so
                        far), "delta" (new tokens, text and logprobs only; completions with
                        nothing new left out; prompt logprobs in the first), "final_only"
                        (only the last output, cumulative). `LLM.generate` returns whole
                        requests whatever it is.
    Unset settings (None) take the model's generation_config values, else vLLM's defaults.
    Out-of-range settings raise InvalidRequestError (a ValueError) naming the setting.
    """

    n: int = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    cache_salt: str | None = None
    timeout: float | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    detokenize: bool = True
    truncate_prompt_tokens: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    _resolved: bool = field(default=False, repr=False, compare=False)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        ids = list(self.stop_token_ids or [])
        if not all(_is_int(t) for t in ids):
            raise InvalidRequestError(f"SamplingParams.stop_token_ids must be integers; got "
                                      f"{ids!r:.200}.", "stop_token_ids")
        self.stop_token_ids = [int(t) for t in ids]
        self._check_token_settings()
        check = check_setting
        check(self.n, "n", int, lambda v: v >= 1, "an integer >= 1")
        check(self.max_tokens, "max_tokens", int, lambda v: v >= 1, "an integer >= 1", none=True)
        check(self.temperature, "temperature", float, lambda v: v >= 0, "a number >= 0",
              none=True)
        check(self.top_p, "top_p", float, lambda v: 0 < v <= 1, "a number in (0, 1]", none=True)
        check(self.top_k, "top_k", int, lambda v: v >= -1, "an integer >= -1 (0 or -1: off)",
              none=True)
        check(self.min_p, "min_p", float, lambda v: 0 <= v <= 1, "a number in [0, 1]", none=True)
        low, high = REPETITION_PENALTY_RANGE
        check(self.repetition_penalty, "repetition_penalty", float, lambda v: low <= v <= high,
              f"a number in [{low}, {high}]", none=True)
        for name in ("presence_penalty", "frequency_penalty"):
            check(getattr(self, name), name, float, lambda v: -2 <= v <= 2, "a number in [-2, 2]")
        check(self.seed, "seed", int, lambda v: SEED_RANGE[0] <= v <= SEED_RANGE[1],
              "an integer in [-2**63, 2**64 - 1]", none=True)
        check(self.min_tokens, "min_tokens", int, lambda v: v >= 0, "an integer >= 0")
        for name in ("logprobs", "prompt_logprobs"):
            check(getattr(self, name), name, int, lambda v: 0 <= v <= MAX_LOGPROBS,
                  f"an integer in [0, {MAX_LOGPROBS}]", none=True)
        check(self.timeout, "timeout", float, lambda v: v > 0, "a number of seconds > 0",
              none=True)
        if isinstance(self.structured_outputs, dict):
            unknown = set(self.structured_outputs) - {f.name for f in fields(
                StructuredOutputsParams)}
            if unknown:
                raise InvalidRequestError(f"structured_outputs: unknown fields {sorted(unknown)}.",
                                          "structured_outputs")
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if not isinstance(self.structured_outputs, (StructuredOutputsParams, type(None))):
            raise InvalidRequestError("SamplingParams.structured_outputs must be a "
                                      "StructuredOutputsParams; got "
                                      f"{type(self.structured_outputs).__name__}.",
                                      "structured_outputs")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidRequestError(
                f"SamplingParams.stop must be non-empty strings; got {self.stop!r:.200}.", "stop")
        if self.cache_salt is not None and not (isinstance(self.cache_salt, str)
                                                and self.cache_salt):
            raise InvalidRequestError(f"SamplingParams.cache_salt must be a non-empty string; "
                                      f"got {self.cache_salt!r:.200}.", "cache_salt")
        if self.stop and not self.detokenize:
            raise InvalidRequestError("SamplingParams.stop needs detokenize=True: stop strings "
                                      "are found in the text.", "stop")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequestError(f"SamplingParams.min_tokens ({self.min_tokens}) must not "
                                      f"exceed max_tokens ({self.max_tokens}).", "min_tokens")

    def _check_token_settings(self) -> None:
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or not all(
                    _is_int(t) and _is_number(b) for t, b in self.logit_bias.items()):
                raise InvalidRequestError("SamplingParams.logit_bias must map token ids "
                                          "(integers) to finite float32 numbers; got "
                                          f"{self.logit_bias!r:.200}.", "logit_bias")
            self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items()} or None
        if self.allowed_token_ids is not None:
            allowed = self.allowed_token_ids
            if (not isinstance(allowed, (list, tuple, set)) or not allowed
                    or not all(_is_int(t) for t in allowed)):
                raise InvalidRequestError("SamplingParams.allowed_token_ids must be a non-empty "
                                          f"list of token ids; got {allowed!r:.200}.",
                                          "allowed_token_ids")
            self.allowed_token_ids = sorted({int(t) for t in allowed})
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        if self.bad_words is not None:
            if not (isinstance(self.bad_words, (list, tuple))
                    and all(isinstance(w, str) and w.strip() for w in self.bad_words)):
                raise InvalidRequestError("SamplingParams.bad_words must be a list of words "
                                          "(strings with more than whitespace); got "
                                          f"{self.bad_words!r:.200}.", "bad_words")
            self.bad_words = list(self.bad_words) or None
        check_setting(self.truncate_prompt_tokens, "truncate_prompt_tokens", int,
                      lambda v: v >= 1 or v == -1,
                      "an integer >= 1, or -1 (the model's context)", none=True)
        kind = self.output_kind
        if _is_int(kind) and 0 <= kind < len(RequestOutputKind):  # (vLLM's IntEnum values)
            kind = list(RequestOutputKind)[kind]
        try:
            self.output_kind = RequestOutputKind(kind)
        except ValueError:
            raise InvalidRequestError("SamplingParams.output_kind must be one of "
                                      f"{[k.value for k in RequestOutputKind]}; got "
                                      f"{self.output_kind!r:.100}.", "output_kind") from None
        for name in ("skip_special_tokens", "include_stop_str_in_output", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(f"SamplingParams.{name} must be True or False; got "
                                          f"{getattr(self, name)!r:.100}.", name)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def adjusts_logits(self) -> bool:
        """Whether a penalty, bias, allowed-token list or bad word changes the logits (of
        resolved params) before sampling."""
        return (self.repetition_penalty != 1.0 or bool(self.presence_penalty)
                or bool(self.frequency_penalty) or self.logit_bias is not None
                or self.allowed_token_ids is not None or self.bad_words is not None)

    def check_vocab(self, vocab_size: int) -> None:
        """Raises InvalidRequestError for token ids the model does not have."""
        for name, ids in (("stop_token_ids", self.stop_token_ids),
                          ("logit_bias", self.logit_bias or ()),
                          ("allowed_token_ids", self.allowed_token_ids or ())):
            bad = out_of_vocab(ids, vocab_size)
            if bad:
                raise InvalidRequestError(f"SamplingParams.{name} must name token ids in "
                                          f"[0, {vocab_size}); got {bad}.", name)

    def generator_seed(self, completion: int) -> int:
        """The seed of completion `completion`'s generator (wraps as torch does)."""
        return (self.seed + completion) % 2**64

    def resolved(self, defaults: dict[str, Any]) -> "SamplingParams":
        """A copy with every unset setting taken from `defaults`, then vLLM's."""
        if self._resolved:
            return self
        values = {}
        for name, fallback in FALLBACKS.items():
            value = getattr(self, name)
            values[name] = value if value is not None else defaults.get(name, fallback)
        out = replace(self, **values, _resolved=True)
        if out.min_tokens > out.max_tokens:
            raise InvalidRequestError(f"SamplingParams.min_tokens ({out.min_tokens}) must not "
                                      f"exceed max_tokens ({out.max_tokens}).", "min_tokens")
        return out


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value) -> bool:
    """A number float32 holds (a bias beyond it would be infinite in the logits)."""
    return (isinstance(value, numbers.Real) and not isinstance(value, bool)
            and math.isfinite(value) and abs(value) <= FLOAT32_MAX)


def check_setting(value, name, kind, ok, allowed, none=False, owner="SamplingParams"):
    """InvalidRequestError naming `owner.name` unless `value` is a finite `kind` (int, or
    float taking ints too) that `ok` accepts (or None, when `none`)."""
    if value is None and none:
        return
    numeric = (int, float) if kind is float else (int,)
    if (isinstance(value, bool) or not isinstance(value, numeric)
            or (isinstance(value, float) and not math.isfinite(value)) or not ok(value)):
        raise InvalidRequestError(f"{owner}.{name} must be {allowed}; got {value!r}.", name)


def generation_defaults(generation_config) -> dict[str, Any]:
    """The settings a model's generation_config sets explicitly, under SamplingParams names."""
    if generation_config is None:
        return {}
    given = generation_config.to_diff_dict()
    out = {k: given[k] for k in ("temperature", "top_p", "top_k", "min_p",
                                 "repetition_penalty") if given.get(k) is not None}
    if given.get("max_new_tokens") is not None:
        out["max_tokens"] = given["max_new_tokens"]
    if given.get("do_sample") is False:
        out["temperature"] = 0.0
    return out


def model_eos_ids(model, vocab: int) -> set[int]:
    """The model's end-of-sequence token ids below `vocab`: its generation_config's, else
    its text config's."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config.get_text_config(decoder=True), "eos_token_id", None)
    eos = eos if isinstance(eos, (list, tuple)) else [eos]
    return {e for e in eos if isinstance(e, int) and 0 <= e < vocab}


PARAM_NAMES = tuple(f.name for f in fields(SamplingParams) if not f.name.startswith("_"))
