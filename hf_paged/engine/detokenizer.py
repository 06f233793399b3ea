"""Token ids -> text, for streams and log-probabilities.

`IncrementalText` turns a growing list of generated ids into text that only ever grows: a
character whose bytes span several tokens (byte-level BPE, SentencePiece byte fallback) is
held back until its last byte arrives, so the deltas a stream sends add up to the final text.
Each update decodes a window of a few tokens (the ids since the last complete character, and
the ones before them for context), not the whole output.

`TokenPieces` names single tokens the way the OpenAI API reports them in log-probabilities:
the token's text, or `bytes:\\xe2\\x82` for a token that is only part of a character, and the
token's own bytes.
"""

from __future__ import annotations

import json
import re

_REPLACEMENT = "\ufffd"
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece byte fallback


class IncrementalText:
    """The text of one completion, kept up to date token by token.

    text:   the stable text so far (what a stream may send)
    update(ids) appends the stable part of the new tokens and returns it; finish(ids)
    appends whatever is left, an incomplete character included (as a full decode shows it).
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.text = ""
        self._prefix = 0  # window start: tokens before it are text already
        self._read = 0  # tokens before it are in `text`

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def update(self, ids: list[int]) -> str:
        """ids: every generated token so far. Returns the text this call appended."""
        if len(ids) == self._read:
            return ""
        before = self._decode(ids[self._prefix:self._read])
        now = self._decode(ids[self._prefix:])
        if len(now) <= len(before) or now.endswith(_REPLACEMENT):
            return ""  # nothing new yet, or a character still incomplete
        delta = now[len(before):]
        self.text += delta
        self._prefix, self._read = self._read, len(ids)
        return delta

    def finish(self, ids: list[int]) -> str:
        """Appends the rest of `ids`, complete or not (the completion has ended)."""
        before = self._decode(ids[self._prefix:self._read])
        now = self._decode(ids[self._prefix:])
        delta = now[len(before):] if len(now) > len(before) else ""
        self.text += delta
        self._prefix = self._read = len(ids)
        return delta


class TokenPieces:
    """Display strings and bytes of single tokens (cached per id)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, bytes]] = {}
        self._byte_level = _is_byte_level(tokenizer)

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


def _is_byte_level(tokenizer) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    try:
        decoder = json.loads(backend.to_str()).get("decoder")
    except (ValueError, AttributeError):
        return False
    return "ByteLevel" in json.dumps(decoder)
