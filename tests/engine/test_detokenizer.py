"""Incremental detokenization and token display strings: the text only grows, an incomplete
character is held back, the pieces add up to a full decode; single tokens are named the way
the OpenAI API names them (`bytes:\\xNN` for part of a character) with their own bytes. With
a byte-level BPE tokenizer, a SentencePiece-style byte-fallback one and a word-level one."""

from __future__ import annotations

import random

import pytest

from hf_paged.detokenizer import IncrementalText, TokenPieces
from conftest import (
    BYTE_CORPUS, make_byte_fallback_tokenizer, make_byte_tokenizer, make_tokenizer,
)

TOKENIZERS = {"byte-level": make_byte_tokenizer, "byte-fallback": make_byte_fallback_tokenizer,
              "word-level": make_tokenizer}


def grow(tok, ids):
    """The stable text after each token, then after finish()."""
    text = IncrementalText(tok)
    seen = []
    for k in range(1, len(ids) + 1):
        delta = text.update(ids[:k])
        assert text.text.endswith(delta)
        seen.append(text.text)
    text.finish(ids)
    return seen, text.text


def sentences(rng, count):
    chars = sorted(set("".join(BYTE_CORPUS)))
    return ["".join(rng.choice(chars) for _ in range(rng.randint(1, 30))) for _ in range(count)]


@pytest.mark.parametrize("name", TOKENIZERS)
def test_text_grows_and_adds_up_to_a_full_decode(name):
    tok = TOKENIZERS[name]()
    rng = random.Random(0)
    cases = [tok(s)["input_ids"] for s in sentences(rng, 100)] if name != "word-level" else []
    if name != "byte-fallback":  # random ids: byte runs that are not UTF-8 at all
        cases += [[rng.randrange(3, len(tok)) for _ in range(rng.randint(1, 40))]
                  for _ in range(200)]
    for ids in cases:
        seen, final = grow(tok, ids)
        assert all(b.startswith(a) for a, b in zip(seen, seen[1:] + [final]))
        assert final == tok.decode(ids, skip_special_tokens=True)


def test_an_incomplete_character_is_held_back():
    tok = make_byte_tokenizer()
    ids = tok("日本語 😀 €")["input_ids"]
    pieces = [tok.decode([i]) for i in ids]
    assert any("\ufffd" in p for p in pieces)  # characters do span tokens here
    seen, final = grow(tok, ids)
    assert final == "日本語 😀 €"
    assert not any(s.endswith("\ufffd") for s in seen)


def test_special_tokens_are_skipped_as_a_full_decode_skips_them():
    tok = make_tokenizer()
    ids = [5, 1, 6, 2, 7]
    assert grow(tok, ids)[1] == tok.decode(ids, skip_special_tokens=True) == "w5 w6 w7"


def test_token_pieces_name_partial_characters_by_their_bytes():
    tok = make_byte_tokenizer()
    pieces = TokenPieces(tok)
    ids = tok("日本語 😀")["input_ids"]
    raw = b""
    for i in ids:
        text, data = pieces.text(i), bytes(pieces.bytes(i))
        if "\ufffd" in tok.decode([i]):
            assert text == "bytes:" + "".join(f"\\x{b:02x}" for b in data)
        else:
            assert text == tok.decode([i]) and data == text.encode()
        raw += data
    assert raw.decode() == "日本語 😀"  # each token's own bytes, in order
    fallback = make_byte_fallback_tokenizer()
    sp = TokenPieces(fallback)
    ids = fallback("é")["input_ids"]
    assert b"".join(bytes(sp.bytes(i)) for i in ids).decode().strip() == "é"
    assert TokenPieces(None).text(5) == "token_id:5"
