"""Structured outputs (`SamplingParams.structured_outputs`): decoding constrained to a JSON
schema, a regular expression, a list of choices or an EBNF grammar.

The grammar engine is xgrammar (the `structured` extra). It was picked over llguidance by
measurement: on a JSON schema its token mask took about 5 µs per row and step against
30 µs (byte-level vocabulary of 320 tokens, this CPU), and it compiles JSON schemas, regular
expressions and GBNF grammars alike. A constraint is compiled once per distinct constraint
(`Grammars.compile`, when a request is prepared, off the step loop and before it is
queued, so a bad schema is the request's own 400); each completion then has a matcher that
follows its tokens. Before sampling, the rows with a matcher get a bitmask of the tokens
their constraint allows next; the model's EOS is allowed exactly when the text so far is
complete, and the completion stops ("stop") when its matcher has accepted it.
"""

from __future__ import annotations

import json
import threading

import numpy
import torch

from ..errors import InvalidRequestError
from ..sampling_params import StructuredOutputsParams

EXTRA = "pip install 'hf-paged[structured]'"
_BITS = torch.arange(32, dtype=torch.int32)


def _xgrammar():
    try:
        import xgrammar
    except ImportError as err:
        raise InvalidRequestError(f"structured outputs need xgrammar: {EXTRA}.",
                                  "structured_outputs") from err
    return xgrammar


class Grammars:
    """Compiles constraints for one tokenizer and vocabulary, once per distinct constraint
    (any thread may call `compile`; matchers belong to the engine's thread)."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: set[int]):
        if tokenizer is None:
            raise InvalidRequestError("structured outputs need the engine's tokenizer (the "
                                      "constraint is on text).", "structured_outputs")
        xgr = _xgrammar()
        # The model's own EOS ids end a completion (a tokenizer may name another one).
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=sorted(eos_ids) or None)
        self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        # JSON text (compact, as compiled here) never holds a byte below 0x20: xgrammar's
        # strings would take raw control characters, which JSON parsers refuse. Tokens
        # with one are masked for JSON constraints (bit set: the token may come).
        safe = numpy.ones(-(-vocab_size // 32) * 32, dtype=bool)
        special = set(info.special_token_ids)
        for token, piece in enumerate(info.decoded_vocab[:vocab_size]):
            if token not in special and any(b < 0x20 for b in piece):
                safe[token] = False
        self._json_safe = torch.from_numpy(numpy.packbits(safe, bitorder="little").view("<i4"))
        self._compiled: dict[tuple[str, str], object] = {}
        self._lock = threading.Lock()
        self.vocab_size = vocab_size
        self.compiles = 0  # distinct constraints compiled (for tests and stats)

    def compile(self, spec: StructuredOutputsParams):
        """The compiled grammar of `spec`; InvalidRequestError if it does not compile."""
        key = spec.key
        with self._lock:
            if key not in self._compiled:
                try:
                    self._compiled[key] = self._compile(spec)
                except Exception as err:  # noqa: BLE001 (xgrammar raises RuntimeError et al.)
                    raise InvalidRequestError(
                        f"structured_outputs: the {key[0]} constraint does not compile: "
                        f"{str(err).strip().splitlines()[0] if str(err).strip() else err!r}",
                        "structured_outputs") from err
                self.compiles += 1
            return self._compiled[key]

    def _compile(self, spec: StructuredOutputsParams):
        c = self._compiler
        if spec.json is not None:
            schema = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
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
        return Matcher(_xgrammar().GrammarMatcher(compiled),
                       self._json_safe if json_text else None)


class Matcher:
    """One completion's place in its constraint."""

    def __init__(self, matcher, allowed: torch.Tensor | None = None):
        self._m, self._allowed = matcher, allowed  # [words] int32: tokens it may ever take

    def accept(self, token: int) -> bool:
        """Advances past `token`; False if the constraint does not allow it there."""
        return self._m.accept_token(token)

    @property
    def done(self) -> bool:
        """The constraint has accepted its end (EOS)."""
        return self._m.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)
        if self._allowed is not None:
            bitmask[row] &= self._allowed


def mask_rows(logits: torch.Tensor, rows: list[int], matchers: list[Matcher]) -> None:
    """In place: logits [S, V] float32; `rows[j]` may only take the tokens `matchers[j]`
    allows next (the others become -inf). The bitmask is built on the host (int32
    words, bit b of word w is token 32 w + b) and unpacked on the logits' device."""
    vocab = logits.shape[1]
    bitmask = torch.zeros(len(rows), -(-vocab // 32), dtype=torch.int32)
    for j, matcher in enumerate(matchers):
        matcher.fill(bitmask, j)
    bits = bitmask.to(logits.device, non_blocking=True)
    allowed = ((bits[:, :, None] >> _BITS.to(logits.device)) & 1).bool().flatten(1)[:, :vocab]
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
