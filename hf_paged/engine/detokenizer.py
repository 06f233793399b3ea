"""Token ids -> text, for streams and log-probabilities.

`IncrementalText` turns a growing list of generated ids into text that only ever grows and
ends as the tokenizer's full decode of the ids: text that later tokens could still change is
held back until they settle it. That is a character whose bytes span several tokens (byte-level
BPE), a run of SentencePiece byte-fallback tokens (a later invalid byte turns the whole run into
replacement characters), and, for tokenizers that clean up spaces before punctuation, a tail
such as " '" that the next characters may rewrite. Each update decodes a window of a few tokens
(the ids since the last settled text, and the ones before them for context), not the whole
output.

`TokenPieces` names single tokens the way the OpenAI API reports them in log-probabilities:
the token's text, or `bytes:\\xe2\\x82` for a token that is only part of a character, and the
token's own bytes.
"""

from __future__ import annotations

import copy
import re
import weakref
from collections.abc import Container

_REPLACEMENT = "\ufffd"
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte fallback
# Transformers' clean_up_tokenization rewrites " .", " ?", " !", " ,", " ' ", " n't", " 'm",
# " 's", " 've" and " 're"; text ending in a proper prefix of one of them is not settled.
_CLEANUP_HEADS = frozenset({" ", " '", " n", " n'", " 'v", " 'r"})


class IncrementalText:
    """The text of one completion, kept up to date token by token.

    text:   the settled text so far (what a stream may send); every later text extends it
    update(ids) appends the settled part of the new tokens and returns it; finish(ids) appends
    the rest, so that `text` is then `tokenizer.decode(ids, skip_special_tokens=...)` (the
    sum of the deltas a stream sent).
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.text = ""
        self._prefix = 0  # window start: the text of the tokens before it is settled
        self._read = 0  # tokens before it have been decoded ...
        self._held = 0  # ... all but this many trailing characters of them into `text`
        self._traits = _traits(tokenizer)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def update(self, ids: list[int]) -> str:
        """ids: every generated token so far. Returns the text this call appended."""
        if len(ids) == self._read or self._byte_run_open(ids):
            return ""
        before = self._decode(ids[self._prefix:self._read])
        now = self._decode(ids[self._prefix:])
        start = len(before) - self._held  # where the text not yet appended begins in `now`
        end = len(now) - self._unsettled(now)
        if end <= start or now[:start] != before[:start]:
            return ""  # nothing settled yet (or the decoder rewrote sent text: wait for finish)
        delta = now[start:end]
        self.text += delta
        self._held = len(now) - end
        if self._held:  # the window keeps the held characters' tokens
            self._read = len(ids)
        else:
            self._prefix, self._read = self._read, len(ids)
        return delta

    def finish(self, ids: list[int]) -> str:
        """Appends the rest of `ids`, an incomplete character included (the completion has
        ended): one full decode, whose text extends what was sent wherever the decoder's
        rewrites stayed within what was held back. Again on the same ids: nothing to do."""
        if self._prefix == self._read == len(ids):  # (finished there: update never leaves
            return ""  # the window empty)
        full = self._decode(ids)
        if full.startswith(self.text):
            delta = full[len(self.text):]
        else:  # (a decoder rewriting further back: the sent text stands, the window adds on)
            before = self._decode(ids[self._prefix:self._read])
            delta = self._decode(ids[self._prefix:])[len(before) - self._held:]
        self.text += delta
        self._prefix = self._read = len(ids)
        self._held = 0
        return delta

    def _unsettled(self, text: str) -> int:
        """How many trailing characters of the window's text later tokens may still change."""
        kept = len(text.rstrip(_REPLACEMENT))  # a character still missing bytes
        if kept < len(text):
            return len(text) - kept
        if self._traits.cleanup:
            for k in (3, 2, 1):
                if text[-k:] in _CLEANUP_HEADS:
                    return k
        return 0

    def _byte_run_open(self, ids: list[int]) -> bool:
        """Whether the newest token is a byte-fallback token (tokens the decode leaves out
        aside: skipped special tokens, ids the vocabulary lacks): its run's text is not
        settled until a token of another kind ends the run."""
        if not self._traits.byte_fallback:
            return False
        skipped = self._traits.special if self.skip else ()
        for i in range(len(ids) - 1, self._read - 1, -1):
            if ids[i] not in skipped:
                kind = self._traits.kind(ids[i])
                if kind is not None:
                    return kind
        return False


class TokenPieces:
    """Display strings and bytes of single tokens: alone (cached per id), or as the text a
    token adds after the ones before it (`after`), in a text that leaves special tokens out
    (the default) or keeps them (`reading`)."""

    CONTEXT = 4  # tokens before a token that its text is decoded after

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, bytes]] = {}
        traits = _traits(tokenizer) if tokenizer is not None else None
        self._byte_level = traits is not None and traits.byte_level
        self._special = traits.special if traits is not None else frozenset()
        self._skipped = self._special  # special tokens the text leaves out
        self._left_out: Container[tuple[int, int]] = ()  # and (position, token)s it leaves out
        # A byte-level BPE token's own text is already the text it adds (its space is in it).
        self._alone = traits is None or (traits.byte_level and not traits.cleanup)

    def reading(self, skip_special_tokens: bool = True,
                left_out: Container[tuple[int, int]] = ()) -> TokenPieces:
        """These pieces (one cache) for a text decoded with `skip_special_tokens` that also
        leaves out the tokens `left_out`, as (position, token) (a text prompt's special tokens
        its tokenizer added, which the text as written does not hold; the stop token or EOS
        that ended a completion; other tokens in their place, as alternatives, are shown)."""
        view = copy.copy(self)
        view._skipped = self._special if skip_special_tokens else frozenset()
        view._left_out = left_out
        return view

    def shown(self, at: int, token: int) -> bool:
        """Whether the text holds token `token` at position `at` (a token it leaves out
        keeps its name in log-probabilities and adds nothing to the text)."""
        return token not in self._skipped and (at, token) not in self._left_out

    def after(self, ids: list[int], asked: list[tuple[int, list[int]]]
              ) -> list[list[tuple[str, bytes]]]:
        """For each (position, tokens) in `asked`: (text, bytes) of each of `tokens` as if
        at `position` of `ids`, i.e. the text it adds to the ids before it, as the decoded
        text has it (two batched decodes in all). Decoded alone, a SentencePiece word's
        token loses its leading space and a word-level one its separator, so the tokens of a
        text would not add up to it. Tokens the text leaves out (`shown`: they are left out
        of the context too) and parts of a character keep their own pieces; so does a
        text's first token."""
        if self._alone:
            return [[self._piece(t) for t in tokens] for _, tokens in asked]
        out, bases, windows, where = [], [], [], []
        for at, tokens in asked:
            out.append([self._piece(t) for t in tokens])
            start = max(at - 2 * self.CONTEXT, 0)
            base = [t for j, t in enumerate(ids[start:at], start)
                    if self.shown(j, t)][-self.CONTEXT:]
            todo = [i for i, t in enumerate(tokens)
                    if self.shown(at, t) and not out[-1][i][0].startswith("bytes:")]
            if base and todo:
                bases.append(base)
                for i in todo:
                    where.append((len(out) - 1, i, len(bases) - 1))
                    windows.append(base + [tokens[i]])
        if where:
            heads, texts = self._decode_all(bases), self._decode_all(windows)
            for (k, i, b), text in zip(where, texts):
                if text.startswith(heads[b]) and _REPLACEMENT not in text[len(heads[b]):]:
                    piece = text[len(heads[b]):]
                    out[k][i] = (piece, piece.encode("utf-8", "surrogatepass"))
        return out

    def _decode_all(self, ids: list[list[int]]) -> list[str]:
        batch = getattr(self.tokenizer, "batch_decode", None)
        return batch(ids) if batch is not None else [self.tokenizer.decode(x) for x in ids]

    def _piece(self, token: int) -> tuple[str, bytes]:
        hit = self._cache.get(token)
        if hit is None:
            if self.tokenizer is None:
                hit = (f"token_id:{token}", f"token_id:{token}".encode())
            else:
                text = self.tokenizer.decode([token])
                if _REPLACEMENT in text:  # part of a character: report its bytes
                    raw = self._raw_bytes(token) or text.encode("utf-8", "replace")
                    hit = ("bytes:" + "".join(f"\\x{b:02x}" for b in raw), raw)
                else:
                    hit = (text, text.encode("utf-8", "surrogatepass"))
            if len(self._cache) < 1 << 20:
                self._cache[token] = hit
        return hit

    def text(self, token: int) -> str:
        return self._piece(token)[0]

    def bytes(self, token: int) -> list[int]:
        return list(self._piece(token)[1])

    def _raw_bytes(self, token: int) -> bytes | None:
        piece = self.tokenizer.convert_ids_to_tokens(token)
        if not isinstance(piece, str):
            return None
        match = _BYTE_PIECE.fullmatch(piece)
        if match:
            return bytes([int(match.group(1), 16)])
        if self._byte_level and all(c in _BYTE_DECODER for c in piece):
            return bytes(_BYTE_DECODER[c] for c in piece)
        return None


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character standing for each byte."""
    keep = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
            + list(range(ord("®"), ord("ÿ") + 1)))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_DECODER = _byte_decoder()


class _Traits:
    """What `IncrementalText` needs to know of a tokenizer (found once per tokenizer)."""

    def __init__(self, tokenizer):
        decoder = _decoder_json(tokenizer)
        self.byte_level = "ByteLevel" in decoder
        self.byte_fallback = "ByteFallback" in decoder
        # Whether decode() cleans up spaces: Transformers skips it for BPE models unless
        # forced (holding back there would only delay text, and stop strings with it).
        model = getattr(getattr(tokenizer, "backend_tokenizer", None), "model", None)
        self.cleanup = bool(getattr(tokenizer, "clean_up_tokenization_spaces", False)) and (
            type(model).__name__ != "BPE" or bool(getattr(
                tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_"
                "output", False)))
        self.special = frozenset(getattr(tokenizer, "all_special_ids", None) or ())
        try:  # (no strong reference: the traits are cached per tokenizer, weakly)
            self._tokenizer = weakref.ref(tokenizer)
        except TypeError:
            self._tokenizer = lambda: tokenizer
        self._kinds: dict[int, bool | None] = {}

    def kind(self, token: int) -> bool | None:
        """Whether `token` is a byte-fallback piece such as <0xE6>; None for an id the
        vocabulary lacks (which a decode leaves out)."""
        try:
            return self._kinds[token]
        except KeyError:
            piece = self._tokenizer().convert_ids_to_tokens(token)
            kind = None if piece is None else _BYTE_PIECE.fullmatch(str(piece)) is not None
            if len(self._kinds) < 1 << 20:
                self._kinds[token] = kind
            return kind


_TRAITS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _traits(tokenizer) -> _Traits:
    try:
        return _TRAITS[tokenizer]
    except KeyError:
        traits = _TRAITS[tokenizer] = _Traits(tokenizer)
        return traits
    except TypeError:  # (not weakly referenceable: found anew)
        return _Traits(tokenizer)


def _decoder_json(tokenizer) -> str:
    """The fast tokenizer's decoder as JSON text ("" without one)."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    try:
        return decoder.__getstate__().decode() if decoder is not None else ""
    except (AttributeError, TypeError, ValueError):
        return ""
