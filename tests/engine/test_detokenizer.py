"""Incremental detokenization and token display strings: the text only grows, text that later
tokens may change is held back (an incomplete character, an open run of byte-fallback tokens,
a tail that space clean-up may rewrite), so that no text a stream sent is ever revised and the
pieces add up to a full decode; the engine's text is the same whether it is followed token by
token (streams, stop strings) or decoded once. Single tokens are named the way the OpenAI API
names them (`bytes:\\xNN` for part of a character) with their own bytes. With a byte-level
BPE tokenizer, a SentencePiece-style byte-fallback one, a word-level one and WordPiece, with
and without Transformers' clean-up of spaces before punctuation."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

import hf_paged
from hf_paged import LLM, SamplingParams
from hf_paged.detokenizer import IncrementalText, TokenPieces
from conftest import (
    BYTE_CORPUS, make_byte_fallback_tokenizer, make_byte_tokenizer, make_punctuation_tokenizer,
    make_tokenizer,
)

TOKENIZERS = {"byte-level": make_byte_tokenizer, "byte-fallback": make_byte_fallback_tokenizer,
              "word-level": make_tokenizer,
              "word-level clean-up": lambda: make_punctuation_tokenizer("word-level", True),
              "wordpiece clean-up": lambda: make_punctuation_tokenizer("wordpiece", True),
              "wordpiece": lambda: make_punctuation_tokenizer("wordpiece", False)}


def grow(tok, ids, skip_special_tokens=True):
    """The settled text after each token, then after finish(). Each is a prefix of the full
    decode (a stream never sends text that a later token rewrites), the last is all of it."""
    full = tok.decode(ids, skip_special_tokens=skip_special_tokens)
    text = IncrementalText(tok, skip_special_tokens)
    seen = []
    for k in range(1, len(ids) + 1):
        delta = text.update(ids[:k])
        assert text.text.endswith(delta)
        assert full.startswith(text.text), (ids[:k], text.text, full)
        seen.append(text.text)
    assert seen[-1] + text.finish(ids) == text.text == full
    return seen, text.text


def sentences(rng, count):
    chars = sorted(set("".join(BYTE_CORPUS)))
    return ["".join(rng.choice(chars) for _ in range(rng.randint(1, 30))) for _ in range(count)]


@pytest.mark.parametrize("name", TOKENIZERS)
def test_text_grows_and_adds_up_to_a_full_decode(name):
    tok = TOKENIZERS[name]()
    rng = random.Random(0)
    cases = [tok(s)["input_ids"] for s in sentences(rng, 100)] if "word" not in name else []
    # Random ids, special tokens and ids past the vocabulary (a model's padded embedding)
    # among them: byte runs that are not UTF-8 at all (a byte-fallback run turns into
    # replacement characters only once an invalid byte joins it, across the tokens a decode
    # leaves out), punctuation that the clean-up joins to the word before.
    cases += [[rng.randrange(len(tok) + 4) for _ in range(rng.randint(1, 40))]
              for _ in range(300)]
    for ids in cases:
        for skip in (True, False):
            grow(tok, ids, skip)


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


def test_engine_text_is_the_same_followed_or_decoded_once():
    """One request's text does not depend on how it is watched: `LLM.generate` decodes it
    once at the end, a stop string that never matches makes the engine follow it token by
    token, and an `AsyncLLM` stream sends it piece by piece (each snapshot's text a prefix of
    the last). A random model over a byte-fallback vocabulary emits byte runs that are not
    UTF-8, whose full decode differs from decoding them a few tokens at a time."""
    import asyncio

    tok = make_byte_fallback_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2)).eval()
    prompts = [[5 + i, 40 + 3 * i, 7] for i in range(24)]
    params = dict(temperature=0, max_tokens=24, ignore_eos=True)
    llm = LLM(model, tokenizer=tok, block_size=4)
    once = llm.generate(prompts, SamplingParams(**params), use_tqdm=False)
    followed = llm.generate(prompts, SamplingParams(**params, stop=["\x00never"]),
                            use_tqdm=False)
    texts = [o.outputs[0].text for o in once]
    assert texts == [tok.decode(o.outputs[0].token_ids, skip_special_tokens=True) for o in once]
    assert [o.outputs[0].text for o in followed] == texts
    # (the case this is about: texts a window of tokens would have decoded differently)
    assert any("\ufffd" in text for text in texts)

    engine = hf_paged.AsyncLLM(model, tok, block_size=4)

    async def stream(prompt):
        snapshots = []
        async for out in engine.generate(prompt, SamplingParams(**params)):
            snapshots.append(out.outputs[0].text)
        return snapshots

    async def main():
        return await asyncio.gather(*(stream(p) for p in prompts))

    try:
        for snapshots, text in zip(asyncio.run(main()), texts):
            assert snapshots[-1] == text
            assert all(text.startswith(s) for s in snapshots)  # nothing sent is revised
    finally:
        engine.shutdown()


def test_a_stop_string_in_the_last_tokens_text_is_found():
    """Text held back at the last token (an open byte run) is settled before the stop strings
    are looked for: a completion whose last token completes a stop string ends with "stop"."""
    tok = make_byte_fallback_tokenizer()
    torch.manual_seed(1)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2)).eval()
    llm = LLM(model, tokenizer=tok, block_size=4)
    base = dict(temperature=0, ignore_eos=True)
    checked = 0
    for i in range(40):
        prompt = [5 + i, 9, 60 + i]
        out = llm.generate([prompt], SamplingParams(**base, max_tokens=12),
                           use_tqdm=False)[0].outputs[0]
        if not tok.convert_ids_to_tokens(out.token_ids[-1]).startswith("<0x"):
            continue  # wanted: the last token is a byte, so that its run was held back
        # The shortest end of the text found nowhere before it.
        size = next((n for n in range(1, len(out.text) + 1)
                     if out.text.find(out.text[-n:]) == len(out.text) - n), 0)
        if not size:
            continue
        stop = out.text[-size:]
        got = llm.generate([prompt], SamplingParams(**base, max_tokens=12, stop=[stop]),
                           use_tqdm=False)[0].outputs[0]
        assert (got.finish_reason, got.stop_reason) == ("stop", stop)
        assert got.text == out.text[:-size] and got.token_ids == out.token_ids
        checked += 1
    assert checked >= 3


def test_clean_up_holds_back_only_where_the_decode_cleans_up():
    """A tail such as " '" waits for the next token where decode() cleans up spaces; a BPE
    tokenizer's decode skips the clean-up (Transformers' rule), so its text is not delayed."""
    words = make_punctuation_tokenizer("word-level", True)
    ids = words("hello '")["input_ids"]
    text = IncrementalText(words)
    text.update(ids)
    assert text.text == "hello"  # " '" may still become "'" (" ' " -> "'")
    ids += words("the")["input_ids"]
    text.update(ids)
    assert text.text == words.decode(ids) == "hello'the"
    bpe = PreTrainedTokenizerFast(tokenizer_object=make_byte_tokenizer().backend_tokenizer,
                                  clean_up_tokenization_spaces=True)
    ids = bpe("hello ")["input_ids"]
    text = IncrementalText(bpe)
    text.update(ids)
    assert text.text == bpe.decode(ids) == "hello "
