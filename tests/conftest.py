"""Tiny random models and an offline tokenizer shared by the tests."""

from __future__ import annotations

import os
import socket
import time

import sys as _sys
from pathlib import Path as _Path

# Tests mirror the package's subfolders and share helpers across them (`from test_engine import
# long_model`): every test folder is importable by module name (names are unique).
for _folder in sorted(p for p in _Path(__file__).resolve().parent.iterdir()
                      if p.is_dir() and p.name.isidentifier()):
    if str(_folder) not in _sys.path:
        _sys.path.append(str(_folder))


import pytest
import torch

# Without a GPU, Triton kernels run in its interpreter; it must be chosen before they load.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Every engine checks each step's tables and slots against the allocator (isolation).
os.environ.setdefault("HF_PAGED_DEBUG", "1")
from transformers import (
    FalconConfig, FalconForCausalLM, LlamaConfig, LlamaForCausalLM, MistralConfig,
    MistralForCausalLM, PreTrainedTokenizerFast,
)

import hf_paged  # noqa: F401  (registers the paged cache)

VOCAB = 96
PAD, EOS, BOS = 0, 1, 2


def _common(**kw):
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                max_position_embeddings=512, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS)
    base.update(kw)
    return base


def make_model(kind: str, seed: int = 0, sliding_window: int = 7, **overrides):
    """A tiny random model of one layout; `overrides` change its config (layers, context)."""
    torch.manual_seed(seed)
    if kind == "llama_gqa":
        model = LlamaForCausalLM(LlamaConfig(**_common(num_attention_heads=4,
                                                       num_key_value_heads=2, **overrides)))
    elif kind == "llama_mha":
        model = LlamaForCausalLM(LlamaConfig(**_common(num_attention_heads=4,
                                                       num_key_value_heads=4, **overrides)))
    elif kind == "mistral_sw":
        model = MistralForCausalLM(MistralConfig(**_common(
            num_attention_heads=4, num_key_value_heads=1, sliding_window=sliding_window,
            **overrides)))
    elif kind in FALCON_LAYOUTS:
        base = _common(num_attention_heads=4, **overrides)
        base.pop("intermediate_size")
        # Falcon ties its lm_head to the embeddings by default: sharpening the head below would
        # scale the embeddings too, and greedy output would repeat the last prompt token.
        base.setdefault("tie_word_embeddings", False)
        model = FalconForCausalLM(FalconConfig(**base, **FALCON_LAYOUTS[kind]))
    else:
        raise ValueError(kind)
    return sharpen_and_check(model, kind)


def sharpen_and_check(model, kind: str):
    """Random weights give near-flat logits: sharpens the lm_head so argmax ties are not an
    issue (refusing a head tied to the embeddings, which would scale them too), puts the
    model in eval mode and checks that its greedy continuation is varied."""
    with torch.no_grad():
        if model.lm_head.weight is model.get_input_embeddings().weight:
            raise ValueError(f"{kind}: sharpening a tied lm_head would scale the embeddings")
        model.lm_head.weight.mul_(8.0)
    model.eval()
    _assert_exercises_attention(model, kind)
    return model


def _assert_exercises_attention(model, kind: str) -> None:
    """A test model whose greedy continuation is one token repeated would make every parity
    test compare constant sequences: insist on a varied continuation of a random prompt."""
    high = min(VOCAB, model.config.get_text_config().vocab_size)
    prompt = torch.randint(3, high, (1, 12), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12,
                             do_sample=False, pad_token_id=PAD, eos_token_id=None)
    distinct = len(set(out[0, 12:].tolist()))
    assert distinct >= 3, f"{kind}: greedy continuation has {distinct} distinct tokens of 12"


FALCON_LAYOUTS = {
    "falcon_mq": dict(multi_query=True, new_decoder_architecture=False, alibi=False),
    "falcon_new": dict(new_decoder_architecture=True, num_kv_heads=2, alibi=False),
    "falcon_alibi": dict(alibi=True, multi_query=False, new_decoder_architecture=False,
                         parallel_attn=False, bias=True),
}
MODEL_KINDS = ["llama_gqa", "llama_mha", "mistral_sw", *FALCON_LAYOUTS]


@pytest.fixture(scope="session", params=MODEL_KINDS)
def model(request):
    return make_model(request.param)


@pytest.fixture(scope="session")
def llama():
    return make_model("llama_gqa")


def left_padded_batch(lengths, seed: int = 0):
    """input_ids / attention_mask of prompts with the given lengths, left-padded."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, width - n:] = torch.randint(3, VOCAB, (n,), generator=g)
        mask[i, width - n:] = 1
    return ids, mask


def grown_mask(mask: torch.Tensor, width: int) -> torch.Tensor:
    """`mask` [B, L] extended with ones to `width` columns (the tokens generate appended)."""
    return torch.cat([mask, mask.new_ones(mask.shape[0], width - mask.shape[1])], 1)


def assert_continues(model, first, mask, cache, new_tokens: int = 5):
    """Continuing `cache` from the output `first` of a call on prompts with `mask` gives the
    tokens of a fresh stock call on the whole sequence."""
    seq = first.sequences
    kwargs = dict(input_ids=seq, attention_mask=grown_mask(mask, seq.shape[1]),
                  max_new_tokens=new_tokens, do_sample=False)
    assert_same(model.generate(**kwargs), model.generate(**kwargs, past_key_values=cache))


def make_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the model's vocabulary, built offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": PAD, "</s>": EOS, "<s>": BOS}
    for i in range(3, VOCAB):
        vocab[f"w{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", bos_token="<s>",
        padding_side="left",
    )


@pytest.fixture(scope="session")
def tokenizer():
    return make_tokenizer()


def both(model, seed: int = 0, **kwargs):
    """(DynamicCache output, paged output) of one generate call; the seed is reset for each."""
    torch.manual_seed(seed)
    ref = model.generate(**kwargs)
    torch.manual_seed(seed)
    out = model.generate(cache_implementation="paged", **kwargs)
    return ref, out


def assert_same(ref, out):
    """Token-identical sequences (generate outputs or tensors)."""
    ref = getattr(ref, "sequences", ref)
    out = getattr(out, "sequences", out)
    assert ref.shape == out.shape
    assert torch.equal(ref, out), f"first mismatches at {(ref != out).nonzero()[:3].tolist()}"


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc, port: int, timeout: float = 120) -> None:
    """Waits until the server process `proc` answers /health on `port` with 200; fails with
    its output if it exits first, or after `timeout` seconds."""
    import httpx

    deadline = time.time() + timeout
    while True:
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.time() < deadline, "the server did not start"
        time.sleep(0.2)


BYTE_CORPUS = ["héllo wörld café naïve €5 日本語 テスト 😀 ünïcödé", "the quick brown fox jumps"]


def make_byte_tokenizer(vocab_size: int = 300) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (GPT-2 style) trained offline on a little text with
    accents, CJK and emoji: many characters span several tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "</s>", "<s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(BYTE_CORPUS * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>",
                                   bos_token="<s>")


def make_byte_fallback_tokenizer() -> PreTrainedTokenizerFast:
    """A SentencePiece-style tokenizer (Metaspace, byte fallback: unknown characters become
    <0xNN> byte tokens), over a small vocabulary of words."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    vocab = {"<pad>": PAD, "</s>": EOS, "<s>": BOS}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for word in ["▁the", "▁quick", "▁fox", "▁café", "▁a", "b", "c", "▁"]:
        vocab[word] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token=None))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first",
                                                 split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>",
                                   bos_token="<s>")


PUNCTUATION = ["hello", "world", "do", "n't", "'s", "'m", "'ve", "'re", ".", ",", "!", "?",
               "'", "-", "n", "v", "r", "a", "the"]


def make_punctuation_tokenizer(kind: str, cleanup: bool) -> PreTrainedTokenizerFast:
    """Word-level or WordPiece over words and the pieces Transformers' clean-up of spaces
    rewrites (" .", " ' ", " n't", " 's", ...), with the clean-up on or off."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"[PAD]": 0, "[UNK]": 1, "[SEP]": 2}
    for word in PUNCTUATION + (["##ing", "##s", "##'"] if kind == "wordpiece" else []):
        vocab[word] = len(vocab)
    if kind == "wordpiece":
        tok = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece(cleanup=False)
    else:
        tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                   sep_token="[SEP]", clean_up_tokenization_spaces=cleanup)
