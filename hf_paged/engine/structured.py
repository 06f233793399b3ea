"""Structured outputs (`SamplingParams.structured_outputs`): decoding constrained to a JSON
schema, a regular expression, a list of choices or an EBNF grammar.

The grammar engine is xgrammar (the `structured` extra). It was picked over llguidance by
measurement (`benchmarks/bench_structured.py`): on a JSON schema its token mask took 2 to
5 µs per row and step against 35 to 50 µs on this CPU, and it compiles JSON schemas,
regular expressions and GBNF grammars alike. A constraint is compiled once per distinct
constraint (`Grammars.compile`, when a request is prepared, off the step loop and before it
is queued, so a bad schema is the request's own 400; the last `MAX_COMPILED` are kept);
each completion then has a matcher that follows its tokens. Before sampling, the rows with a matcher get a bitmask of the tokens
their constraint allows next; the model's EOS is allowed exactly when the text so far is
complete, and the completion stops ("stop") when its matcher has accepted it.
"""

from __future__ import annotations

import itertools
import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future

import numpy
import torch

from ..errors import InvalidRequestError
from ..sampling_params import StructuredOutputsParams
from .schema_support import refusal

EXTRA = "pip install 'hf-paged[structured]'"
MAX_COMPILED = 256  # distinct constraints kept compiled (clients may send any number)
_BITS = torch.arange(32, dtype=torch.int32)


def _xgrammar():
    try:
        import xgrammar
    except ImportError as err:
        raise InvalidRequestError(f"structured outputs need xgrammar: {EXTRA}.",
                                  "structured_outputs") from err
    return xgrammar


# The UTF-8 form of a UTF-16 surrogate (U+D800..DFFF), which is not UTF-8.
_SURROGATE = re.compile(rb"\xed[\xa0-\xbf]")
_SURROGATE_TEXT = re.compile(r"[\ud800-\udfff]|\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
# Where xgrammar's messages say they come from: "[12:00:00] /project/cpp/x.cc:94: ".
_SOURCE = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


def _special_matches_no_text(xgr, info, tokenizer):
    """`info` with the tokenizer's special tokens (those a decode with skip_special_tokens
    leaves out) matching no text: xgrammar reads some as their literal text (a byte-level
    BPE's "<s>"), which would satisfy a constraint with text the completion then lacks.
    (For every request: one that keeps special tokens in its text spells that text with
    ordinary tokens too.)"""
    special = {i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()
               if t.special} | set(tokenizer.all_special_ids)
    special = {i for i in special if i < info.vocab_size and info.decoded_vocab[i]}
    if not special:
        return info
    vocab = [b"" if i in special else piece for i, piece in enumerate(info.decoded_vocab)]
    return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=info.vocab_size,
                             stop_token_ids=info.stop_token_ids,
                             add_prefix_space=info.add_prefix_space)


class Grammars:
    """Compiles constraints for one tokenizer and vocabulary, once per distinct constraint
    (any thread may call `compile`; matchers belong to the engine's thread)."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: set[int]):
        """vocab_size: the model's logits; ids past the tokenizer's are never allowed (a
        mask over the tokenizer's alone costs a tenth where a head is padded wide)."""
        if tokenizer is None:
            raise InvalidRequestError("structured outputs need the engine's tokenizer (the "
                                      "constraint is on text).", "structured_outputs")
        xgr = _xgrammar()
        vocab_size = min(vocab_size, max(len(tokenizer), max(eos_ids, default=0) + 1))
        # The model's own EOS ids end a completion (a tokenizer may name another one).
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=sorted(eos_ids) or None)
        info = _special_matches_no_text(xgr, info, tokenizer)
        self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        # xgrammar's character classes take the UTF-8 form of a UTF-16 surrogate (ED A0-BF
        # xx, not UTF-8): its 3 bytes decode to 3 replacement characters, and the text
        # breaks a length, enum or pattern. Never a token holding one; after a token ending
        # in the lead ED, none starting A0-BF. And JSON text (compact, as compiled here)
        # never holds a byte below 0x20: xgrammar's strings would take raw control
        # characters, which JSON parsers refuse (bit set: the token may come).
        words = -(-vocab_size // 32) * 32
        valid, safe, second = (numpy.ones(words, dtype=bool) for _ in range(3))
        self._ends_in_lead = numpy.full(vocab_size, -1, dtype=numpy.int8)  # -1: no text
        special = set(info.special_token_ids)
        for token, piece in enumerate(info.decoded_vocab[:vocab_size]):
            if token in special or not piece:
                continue
            valid[token] = _SURROGATE.search(piece) is None
            safe[token] = valid[token] and not any(b < 0x20 for b in piece)
            second[token] = not 0xA0 <= piece[0] <= 0xBF
            self._ends_in_lead[token] = piece[-1] == 0xED
        self._valid, self._json_safe, self._after_lead = (
            torch.from_numpy(numpy.packbits(m, bitorder="little").view("<i4"))
            for m in (valid, safe, second))
        if valid.all():  # (a vocabulary trained on text: nothing to mask every step)
            self._valid = None
        self._compiled: OrderedDict[tuple[str, str], object] = OrderedDict()  # LRU
        self._pending: dict[tuple[str, str], Future] = {}  # constraints being compiled
        self._lock = threading.Lock()  # (never held while compiling)
        self.vocab_size = vocab_size
        self.compiles = 0  # distinct constraints compiled (for tests and stats)

    def compile(self, spec: StructuredOutputsParams):
        """The compiled grammar of `spec`; InvalidRequestError if it does not compile or no
        token can start it. Distinct constraints compile at once on their callers' threads
        (a large schema takes seconds: nobody else's waits on it); callers of one that is
        compiling wait for it."""
        key = spec.key
        with self._lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)
                return self._compiled[key]
            pending, mine = self._pending.get(key), key not in self._pending
            if mine:
                pending = self._pending[key] = Future()
        if not mine:
            return pending.result()
        try:
            compiled = self._checked(spec)
        except BaseException as err:
            with self._lock:
                del self._pending[key]
            pending.set_exception(err)
            raise
        with self._lock:
            del self._pending[key]
            self._compiled[key] = compiled
            if len(self._compiled) > MAX_COMPILED:  # (running matchers keep theirs)
                self._compiled.popitem(last=False)
        pending.set_result(compiled)
        return compiled

    def _checked(self, spec: StructuredOutputsParams):
        key = spec.key
        try:
            compiled = self._compile(spec)
        except Exception as err:  # noqa: BLE001 (xgrammar raises RuntimeError et al.)
            first = str(err).strip().splitlines()[0] if str(err).strip() else repr(err)
            raise InvalidRequestError(  # (without xgrammar's "[time] file.cc:line: ")
                f"structured_outputs: the {key[0]} constraint does not compile: "
                f"{_SOURCE.sub('', first)}", "structured_outputs") from err
        with self._lock:
            self.compiles += 1
        if not self._startable(compiled, spec):
            raise InvalidRequestError(
                f"structured_outputs: no token of the tokenizer's vocabulary can start the "
                f"{key[0]} constraint (the vocabulary cannot spell its first character)",
                "structured_outputs")
        return compiled

    def _startable(self, compiled, spec: StructuredOutputsParams) -> bool:
        """Whether any token may come first: one that may not would fail its request at its
        first sample, so it is refused up front (a dead end later fails only then)."""
        bitmask = torch.zeros(1, -(-self.vocab_size // 32), dtype=torch.int32)
        self.matcher(compiled, spec).fill(bitmask, 0)
        return bool(bitmask.any())

    def _compile(self, spec: StructuredOutputsParams):
        c = self._compiler
        given = [spec.regex, spec.grammar, spec.choice,
                 None if spec.json is None else json.loads(spec.json) if isinstance(
                     spec.json, str) else spec.json]
        if _names_surrogates(given):
            raise ValueError("it names UTF-16 surrogates (U+D800 to U+DFFF), which are not "
                             "characters: no UTF-8 text holds one (xgrammar would emit "
                             "invalid bytes). Write a character above U+FFFF as itself, not "
                             "as a surrogate pair")
        if spec.json is not None:
            schema = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
            reason = refusal(json.loads(schema))
            if reason is not None:
                raise ValueError(reason)
            return c.compile_json_schema(schema, any_whitespace=False)
        if spec.json_object:
            return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if spec.regex is not None:
            return c.compile_regex(spec.regex)
        if spec.choice is not None:
            return c.compile_grammar("root ::= " + " | ".join(
                json.dumps(choice, ensure_ascii=False) for choice in spec.choice))
        return c.compile_grammar(spec.grammar)

    def matcher(self, compiled, spec: StructuredOutputsParams) -> "Matcher":
        json_text = spec.json is not None or spec.json_object
        return Matcher(_xgrammar().GrammarMatcher(compiled), self.vocab_size,
                       self._json_safe if json_text else self._valid, self._ends_in_lead,
                       self._after_lead)


def _names_surrogates(value) -> bool:
    """Whether a string in `value` (nested lists and dicts, keys too) holds a surrogate, or
    a regular expression's escape of one (`\\ud800`, the JavaScript spelling of a pair)."""
    todo = [value]
    while todo:
        item = todo.pop()
        if isinstance(item, str):
            if _SURROGATE_TEXT.search(item):
                return True
        elif isinstance(item, dict):
            todo += list(item) + list(item.values())
        elif isinstance(item, (list, tuple)):
            todo += item
    return False


class Matcher:
    """One completion's place in its constraint."""

    def __init__(self, matcher, vocab: int, allowed: torch.Tensor | None,
                 ends_in_lead: numpy.ndarray, after_lead: torch.Tensor):
        self._m, self._allowed = matcher, allowed  # [words] int32: tokens it may ever take
        self.vocab, self.words = vocab, -(-vocab // 32)  # its tokens, and bitmask words
        # [vocab] int8: whether a token ends in the lead byte ED (-1: it has no text);
        # [words] int32: the tokens that may follow one
        self._ends_in_lead, self._after_lead = ends_in_lead, after_lead
        self._in_lead = [False]  # per accepted token: whether the text then ends in ED

    def accept(self, token: int) -> bool:
        """Advances past `token`; False if the constraint does not allow it there (a token
        past the grammars' vocabulary never is)."""
        if not self._m.accept_token(token):
            return False
        ends = self._ends_in_lead[token]
        self._in_lead.append(self._in_lead[-1] if ends < 0 else bool(ends))
        return True

    @property
    def done(self) -> bool:
        """The constraint has accepted its end (EOS)."""
        return self._m.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)
        if self._allowed is not None:
            bitmask[row] &= self._allowed
        if self._in_lead[-1]:
            bitmask[row] &= self._after_lead

    def allows(self, tokens) -> int:
        """How many of `tokens`, in order, the constraint takes from here (it stays here),
        short of the one that ends it: nothing may be masked after that one."""
        if self._m.is_terminated():
            return 0
        n = 0
        while n < len(tokens) and tokens[n] < self.vocab and self._m.accept_token(tokens[n]):
            if self._m.is_terminated():  # it ends the constraint: not taken
                self._m.rollback(1)
                break
            n += 1
        if n:
            self._m.rollback(n)
        return n

    def rollback(self, n: int) -> None:
        """Steps back over the last `n` tokens it accepted."""
        if n:
            self._m.rollback(n)
            del self._in_lead[max(1, len(self._in_lead) - n):]

    def ahead(self, tokens) -> "Matcher":
        """This matcher as it will be after `tokens` (which it allows), for masking a
        speculative position: its `fill` takes them, fills, and steps back."""
        return self if not tokens else _Ahead(self, list(tokens))


class _Ahead:
    def __init__(self, matcher: Matcher, tokens: list[int]):
        self._matcher, self._tokens = matcher, tokens
        self.vocab, self.words = matcher.vocab, matcher.words

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        m = self._matcher
        taken = sum(1 for _ in itertools.takewhile(m.accept, self._tokens))  # (all: `allows`)
        try:
            m.fill(bitmask, row)
        finally:  # (the matcher is the completion's own: never left ahead)
            m.rollback(taken)


@torch.inference_mode()  # (a forward's logits are inference tensors: changed in place)
def mask_rows(logits: torch.Tensor, rows: list[int], matchers: list[Matcher],
              ends: list[list[int] | None] | None = None) -> list[int]:
    """In place: logits [S, V] float32; `rows[j]` may only take the tokens `matchers[j]`
    allows next (the others become -inf). The bitmask is built on the host (int32 words,
    bit b of word w is token 32 w + b, over the grammars' vocabulary), then unpacked:
    by numpy on a CPU, on the device on a GPU (only the packed words travel).

    ends[j]: the stop tokens row j masks for now (min_tokens), if any. Returns the j whose
    constraint allows nothing but those: it is complete, and its end must come now."""
    vocab, device = logits.shape[1], logits.device
    bitmask = torch.zeros(len(rows), matchers[0].words, dtype=torch.int32)
    for j, matcher in enumerate(matchers):
        matcher.fill(bitmask, j)
    known = min(matchers[0].vocab, vocab)
    ends = ends or []
    host = None  # [R, 32 W] bool: the bitmask unpacked on the host
    if device.type == "cpu" or any(ends):
        host = numpy.unpackbits(bitmask.numpy().view(numpy.uint8), axis=1,
                                bitorder="little").view(bool)
    ending = [j for j, tokens in enumerate(ends) if tokens and not numpy.delete(
        host[j, :known], [t for t in tokens if t < known]).any()]
    if device.type == "cpu":
        allowed = torch.from_numpy(host)
    else:
        bits = bitmask.to(device, non_blocking=True)
        allowed = ((bits[:, :, None] >> _BITS.to(device)) & 1).bool().flatten(1)
    blocked = ~allowed[:, :known]  # (bits past the grammars' vocabulary are not tokens)
    if len(rows) == logits.shape[0]:  # every row (the usual case): in place
        logits[:, :known].masked_fill_(blocked, float("-inf"))
        logits[:, known:] = float("-inf")  # ids the tokenizer does not have: never
        return ending
    index = torch.tensor(rows, device=device)
    part = logits[index]
    part[:, :known].masked_fill_(blocked, float("-inf"))
    part[:, known:] = float("-inf")
    logits[index] = part
    return ending
