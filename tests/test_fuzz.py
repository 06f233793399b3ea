"""Differential fuzz: random generate calls, paged vs DynamicCache, token for token.

Each case draws a model layout, block size, pool sizing, batch with random padding (left,
inner, right, all-padding rows), decoding mode, EOS token and, for some, a second turn on the
returned cache, assisted decoding, a PEFT adapter (LoRA, prompt or prefix tuning) or a model
left in training mode. `HF_PAGED_FUZZ_CASES` sets how many cases run (default
300) and `HF_PAGED_FUZZ_SEED` where they start, so a failing case can be rerun alone. The
`_zoo` tests draw the same cases over every architecture of tests/zoo.py
(`HF_PAGED_FUZZ_ZOO_CASES`, default 500).
"""

from __future__ import annotations

import contextlib
import os
import random
import warnings

import pytest
import torch

import hf_paged
from conftest import MODEL_KINDS, PAD, VOCAB, grown_mask, make_model
from zoo import NAMES, make_arch

NUM_CASES = int(os.environ.get("HF_PAGED_FUZZ_CASES", "300"))
FIRST_SEED = int(os.environ.get("HF_PAGED_FUZZ_SEED", "0"))
ZOO_CASES = int(os.environ.get("HF_PAGED_FUZZ_ZOO_CASES", "500"))
# Zoo models that PEFT's adapters do not fit (stock fails too): LoRA on fused expert
# weights, prompt and prefix tuning on their attention configs.
NO_PEFT = {"mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "phimoe", "dbrx", "gpt_neox"}

_models: dict = {}


def build(kind, seed=0):
    return make_model(kind, seed=seed) if kind in MODEL_KINDS else make_arch(kind)


def model_for(kind):
    if kind not in _models:
        _models[kind] = build(kind)
    return _models[kind]


def random_batch(rng: random.Random, rows: int, width: int):
    """Token ids and a mask with left padding, and sometimes inner zeros, right padding or
    an all-padding row."""
    g = torch.Generator().manual_seed(rng.randrange(10**6))
    ids = torch.randint(3, VOCAB, (rows, width), generator=g)
    mask = torch.ones(rows, width, dtype=torch.long)
    for r in range(rows):
        kind = rng.choices(["left", "inner", "right", "none", "empty"], [6, 2, 1, 2, 0.3])[0]
        n = rng.randint(1, width)
        if kind in ("left", "inner"):
            mask[r, : width - n] = 0
        if kind == "inner" and n > 2:
            a = rng.randrange(width - n + 1, width - 1)
            mask[r, a: a + rng.randint(1, 2)] = 0
        if kind == "right":
            mask[r, n:] = 0
        if kind == "empty":
            mask[r] = 0
    ids[mask == 0] = PAD
    return ids, mask


def draw_case(seed: int, kinds=MODEL_KINDS) -> dict:
    rng = random.Random(seed)
    kind = rng.choice(kinds)
    mode = rng.choice(["greedy", "greedy", "sample", "beam", "beam_sample", "nrs", "assisted",
                       "lookup"])
    rows = 1 if mode in ("assisted", "lookup") else rng.randint(1, 4)
    width = rng.randint(1, 24)
    options = dict(max_new_tokens=rng.randint(1, 12))
    if mode in ("sample", "beam_sample", "nrs"):
        options.update(do_sample=True, top_k=rng.choice([0, 5]))
    else:
        options.update(do_sample=False)
    if mode in ("beam", "beam_sample"):
        options["num_beams"] = rng.randint(2, 4)
        options["num_return_sequences"] = rng.randint(1, options["num_beams"])
    if mode == "nrs":
        options["num_return_sequences"] = rng.randint(2, 3)
    if mode == "lookup":
        options["prompt_lookup_num_tokens"] = rng.randint(1, 4)
    if rng.random() < 0.3:
        options["eos_token_id"] = rng.randrange(3, VOCAB)  # rows may stop early
    cache_config = {"block_size": rng.choice([1, 2, 3, 4, 7, 16, 64])}
    if rng.random() < 0.3:
        cache_config["num_blocks"] = 600
    adapter = None  # a PEFT adapter around the model, or a model left in training mode
    if mode not in ("assisted", "lookup") and rng.random() < 0.25:
        adapter = rng.choice(["lora", "prompt", "prefix", "train"])
        if adapter == "prefix" and kind in ("falcon_mq", "falcon_new"):
            adapter = "lora"  # their caches hold other heads than a prefix has (stock fails)
        if kind in NO_PEFT:
            adapter = "train"
    return dict(seed=seed, kind=kind, mode=mode, rows=rows, width=width, options=options,
                cache_config=cache_config, second_turn=mode in ("greedy", "sample") and
                adapter is None and rng.random() < 0.5, assistant=rng.choice(MODEL_KINDS),
                adapter=adapter, rng=rng)


@contextlib.contextmanager
def stock_transformers():
    """Transformers exactly as shipped: the reference must not see any hf-paged patch."""
    hf_paged.disable()
    try:
        yield
    finally:
        hf_paged.enable()


def generate_both(model, seed, **kwargs):
    outs = []
    for paged in (False, True):
        torch.manual_seed(seed)
        extra = dict(cache_implementation="paged") if paged else {}
        if paged and "cache_config" in kwargs:
            extra["cache_config"] = kwargs["cache_config"]
        kw = {k: v for k, v in kwargs.items() if k != "cache_config"}
        if paged and "past_key_values" in kw:
            kw["past_key_values"] = kwargs["past_key_values"][1]
            extra = {}
        elif "past_key_values" in kw:
            kw["past_key_values"] = kwargs["past_key_values"][0]
        if paged:
            outs.append(model.generate(**kw, **extra))
        else:
            with stock_transformers():
                outs.append(model.generate(**kw))
    return outs


def adapted(kind: str, adapter: str):
    """A fresh model of `kind` under a PEFT adapter (LoRA dropout on), or in training mode
    with dropout outside attention."""
    key = (kind, adapter)
    if key not in _models:
        from peft import (LoraConfig, PrefixTuningConfig, PromptTuningConfig, TaskType,
                          get_peft_model)

        model = build(kind, seed=7)
        if adapter == "train":
            for name, module in model.named_modules():
                if isinstance(module, torch.nn.Dropout) and "attention" not in name:
                    module.p = 0.1
            _models[key] = model.train()
            return _models[key]
        config = {
            "lora": LoraConfig(task_type=TaskType.CAUSAL_LM, r=4, target_modules="all-linear",
                               init_lora_weights=False, lora_dropout=0.1),
            "prompt": PromptTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=3),
            "prefix": PrefixTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=3),
        }[adapter]
        model = get_peft_model(model, config)
        if adapter != "lora":
            with torch.no_grad():
                for p in model.prompt_encoder.parameters():
                    p.normal_(0, 1)
        _models[key] = model.train() if adapter == "lora" else model.eval()
    return _models[key]


def check(case: dict) -> None:
    model = model_for(case["kind"])
    if case["adapter"] is not None:
        model = adapted(case["kind"], case["adapter"])
    rng = case["rng"]
    ids, mask = random_batch(rng, case["rows"], case["width"])
    options = dict(case["options"])
    if case["mode"] == "assisted":
        options["assistant_model"] = model_for(case["assistant"])
        if "eos_token_id" not in options and rng.random() < 0.5:
            options["pad_token_id"] = rng.randrange(3, VOCAB)  # the assistant may see it
    keep = case["second_turn"]
    ref, out = generate_both(model, case["seed"], input_ids=ids, attention_mask=mask,
                             return_dict_in_generate=keep, cache_config=case["cache_config"],
                             **options)
    a, b = (ref.sequences, out.sequences) if keep else (ref, out)
    assert a.shape == b.shape, f"first call differs: {case_repr(case)}"
    rows = defined_rows(model, mask).repeat_interleave(a.shape[0] // ids.shape[0])
    assert torch.equal(a[rows], b[rows]), f"first call differs: {case_repr(case)}"
    if not keep:
        return
    seq = a
    new = rng.randint(1, 5)
    turn = torch.randint(3, VOCAB, (seq.shape[0], new),
                         generator=torch.Generator().manual_seed(case["seed"]))
    turn_mask = torch.ones_like(turn)
    for r in range(seq.shape[0]):
        turn_mask[r, : rng.randint(0, new)] = 0  # each row's turn is left-padded (maybe empty)
    turn[turn_mask == 0] = PAD
    ids2 = torch.cat([seq, turn], 1)
    if rng.random() < 0.5:
        mask2 = torch.cat([grown_mask(mask, seq.shape[1]), turn_mask], 1)
    else:
        mask2 = (ids2 != PAD).long()  # the usual rebuild: pads after an early stop hide too
    ref2, out2 = generate_both(model, case["seed"] + 1, input_ids=ids2, attention_mask=mask2,
                               max_new_tokens=rng.randint(1, 6),
                               do_sample=options.get("do_sample", False),
                               eos_token_id=options.get("eos_token_id"),
                               past_key_values=(ref.past_key_values, out.past_key_values))
    assert ref2.shape == out2.shape, f"second turn differs: {case_repr(case)}"
    rows = defined_rows(model, mask2) & defined_rows(model, mask)
    assert torch.equal(ref2[rows], out2[rows]), f"second turn differs: {case_repr(case)}"


def defined_rows(model, mask: torch.Tensor) -> torch.Tensor:
    """[rows] bool: the rows whose continuation is defined. Under eager attention (Gemma 2's
    softcap) the prompt's last column, when it is padding and sees no real token in the
    model's smallest window (or at all), averages padding the paged cache does not store;
    the tokens of such rows may differ (README, "Where the tokens may differ"). Sink logits
    (gpt-oss) take all of such a query's weight instead: its output is 0, as paged."""
    sinks = any(hasattr(m, "sinks") for m in model.modules())
    if model.config._attn_implementation != "eager" or sinks:
        return torch.ones(mask.shape[0], dtype=torch.bool)
    window = getattr(model.config.get_text_config(), "sliding_window", None) or mask.shape[1]
    return (mask[:, -1] == 1) | (mask[:, -window:].sum(1) > 0)


def case_repr(case):
    return {k: v for k, v in case.items() if k != "rng"}


@pytest.mark.parametrize("seed", range(FIRST_SEED, FIRST_SEED + NUM_CASES))
def test_fuzz_case(seed):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Transformers' right-padding warning and the like
        check(draw_case(seed))


def logits_of(model, cache, ids, mask, positions, paged):
    kw = dict(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache)
    with torch.no_grad():
        if not paged:
            with stock_transformers():
                return model(**kw).logits
        hf_paged.prepare_model(model)  # (stock_transformers() unwrapped the zoo's classes)
        own = model.config._attn_implementation_internal
        model.config._attn_implementation_internal = "paged"
        try:
            return model(**kw).logits
        finally:
            model.config._attn_implementation_internal = own


def test_fuzz_direct_forwards(seed):
    """Random forwards, crops and reorders on a DynamicCache and a PagedCache side by side,
    with masks that hide and show cached columns: logits agree at every step."""
    direct_forwards(seed, MODEL_KINDS)


def direct_forwards(seed: int, kinds) -> None:
    from transformers import DynamicCache

    from hf_paged import PagedCache

    rng = random.Random(10_000 + seed)
    kind = rng.choice(kinds)
    model = model_for(kind)
    rows = rng.randint(1, 3)
    caches = [DynamicCache(config=model.config),
              PagedCache(model.config, {"block_size": rng.choice([1, 2, 3, 5, 16])})]
    for cache in caches:
        cache.activate_past_recording()  # crops may reach behind a sliding window
    mask = torch.zeros(rows, 0, dtype=torch.long)
    positions = torch.zeros(rows, 0, dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    for _ in range(rng.randint(2, 7)):
        op = rng.choices(["forward", "crop", "reorder"], [6, 1, 1])[0]
        seen = mask.shape[1]
        if op == "crop" and seen > 1:
            k = rng.randint(1, seen - 1)
            for cache in caches:
                cache.crop(-k)
            mask, positions = mask[:, :-k], positions[:, :-k]
            continue
        if op == "reorder" and seen:
            index = torch.tensor([rng.randrange(rows) for _ in range(rows)])
            for cache in caches:
                cache.reorder_cache(index)
            mask, positions = mask[index], positions[index]
            continue
        q = rng.randint(1, 5)
        new = (torch.rand(rows, q, generator=g) < 0.75).long()
        mask = torch.cat([mask, new], 1)
        started = mask.cummax(1).values.bool()
        flips = (torch.rand(rows, seen, generator=g) < 0.15) & started[:, :seen]
        if model.config._attn_implementation == "eager" and kind != "falcon_alibi":
            # Eager attention gives a padding query that sees no key in its window a uniform
            # average of padding the paged cache does not store: a column written so keeps
            # other states in its later layers, and stays hidden.
            mask[:, :seen] &= ~flips.long()
        else:
            mask[:, :seen] ^= flips.long()  # hide or show cached columns of started rows
        mask[:, :seen][~started[:, :seen]] = 0
        new_pos = positions[:, -1:] + 1 + torch.arange(q) if seen else torch.arange(q).expand(rows, q)
        positions = torch.cat([positions, new_pos], 1)
        ids = torch.randint(3, VOCAB, (rows, q), generator=g)
        try:
            ref = logits_of(model, caches[0], ids, mask, positions[:, -q:], paged=False)
        except RuntimeError:
            # DynamicCache's sliding-window layers shrink to the window on some crops and
            # then cannot take a mask over every column: no reference beyond this point.
            assert model.config.get_text_config().sliding_window
            return
        out = logits_of(model, caches[1], ids, mask, positions[:, -q:], paged=True)
        if kind == "falcon_alibi" and seen or model.config._attn_implementation == "eager":
            # Falcon-RW's float mask, and eager attention (Gemma 2's softcap), make a query
            # that sees no key (in its window) attend uniformly to every column; the
            # padding it would average is not stored (Falcon: after the first forward).
            # Such queries sit on padding, whose logits nothing reads (generate's last
            # column on right padding: tests/generate/test_architectures.py).
            keep = mask.cummax(1).values.bool()[:, -q:]
            if kind != "falcon_alibi":  # (a window: masked queries after real ones too)
                keep = mask[:, -q:].bool()
            out, ref = out[keep], ref[keep]
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4,
                                   msg=lambda m: f"{kind}, mask {mask.tolist()}: {m}")


test_fuzz_direct_forwards = pytest.mark.parametrize(
    "seed", range(FIRST_SEED, FIRST_SEED + NUM_CASES))(test_fuzz_direct_forwards)


@pytest.mark.parametrize("seed", range(FIRST_SEED, FIRST_SEED + ZOO_CASES))
def test_fuzz_case_zoo(seed):
    """`test_fuzz_case` over every architecture of the zoo."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check(draw_case(seed, NAMES))


@pytest.mark.parametrize("seed", range(FIRST_SEED, FIRST_SEED + ZOO_CASES))
def test_fuzz_direct_forwards_zoo(seed):
    """`test_fuzz_direct_forwards` over every architecture of the zoo."""
    direct_forwards(seed, NAMES)
