"""Engine options combined: async scheduling, speculative decoding (prompt lookup and a
draft model), 8-bit KV blocks, both preemption modes under a pool too small for the
workload, chunked prefill, prefix-cache hits, decode graphs and a compiled forward, on
several architectures (sliding windows, hybrid KV groups, sinks, soft-capping, ALiBi).

What each combination must keep:
- greedy tokens equal stock `generate` (float32, DynamicCache), whatever the options;
- seeded sampling (n > 1, stops, penalties, logprobs) equal to the same run without the
  option: async scheduling, speculation and preemption change no draw;
- 8-bit KV runs equal the 8-bit run without the other options (8 bits change the logits);
- once every request has ended: no block used, nothing running, waiting or swapped, every
  block-table row and CPU block given back, nothing in flight.
"""

from __future__ import annotations

import random

import pytest
import torch

from hf_paged import LLMEngine, SamplingParams
from hf_paged.engine import graphs as graphs_module
from conftest import VOCAB, make_tokenizer
from test_engine import long_model, run_engine, stock_greedy
from zoo import make_arch

NGRAM = dict(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1,
             prompt_lookup_max=3, min_acceptance=0.0)
_models: dict = {}
_stock: dict = {}


def model_of(name: str):
    """The engine tests' models (room for long prompts) or a zoo architecture."""
    if name in ("llama_gqa", "mistral_sw", "falcon_mq", "falcon_new", "falcon_alibi"):
        return long_model(name)
    if name not in _models:
        _models[name] = make_arch(name)
    return _models[name]


def stock(name: str, prompts, max_tokens):
    """Stock greedy tokens of each prompt alone (kept: parametrizations share them)."""
    key = (name, tuple(map(tuple, prompts)), tuple(max_tokens))
    if key not in _stock:
        model = model_of(name)
        _stock[key] = [stock_greedy(model, p, m) for p, m in zip(prompts, max_tokens)]
    return _stock[key]


def greedy_but_one(count: int, first: int, at: int, seeded: SamplingParams):
    """Greedy params of `first`, `first` + 1, ... tokens, row `at` sampling as `seeded`."""
    params = [SamplingParams(temperature=0, max_tokens=first + i, ignore_eos=True)
              for i in range(count)]
    params[at] = seeded
    return params


def repetitive_prompts(seed: int, count: int, shared: list[int] | None = None):
    """Prompts repeating a span (prompt lookup proposes), every other one after `shared`."""
    rng = random.Random(seed)
    prompts = []
    for i in range(count):
        span = [rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 7))]
        prompt = span * rng.randint(1, 3) + [rng.randrange(3, VOCAB)
                                             for _ in range(rng.randint(0, 5))]
        prompts.append(shared + prompt if shared and i % 2 else prompt)
    return prompts


def tight_blocks(model, prompts, max_tokens, block_size, max_num_batched_tokens,
                 extra=1) -> int:
    """`num_blocks` for a pool that holds the largest request alone and little more (a
    hybrid model's num_blocks counts blocks of all layers: converted through a probe)."""
    probe = LLMEngine(model, block_size=block_size, num_blocks=1000,
                      max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=8)
    need = max(probe.scheduler.blocks_at_once(len(p) + m) for p, m in zip(prompts, max_tokens))
    per = probe.num_blocks / 1000  # pool blocks per num_blocks
    return int(-(-need // per)) + extra


def assert_drained(engine: LLMEngine) -> None:
    s = engine.stats()
    assert (s.blocks_used, s.running, s.waiting, s.swapped) == (0, 0, 0, 0), s
    assert sorted(engine.scheduler._free_rows) == list(range(engine.max_num_seqs))
    assert engine.cpu_pool is None or engine.cpu_pool.blocks.num_used == 0
    assert engine._in_flight is None and not engine.requests


def run(model, prompts, params, arrivals=None, tokenizer=None, **options):
    """Outputs (by prompt) and stats of one engine over the requests; checks it drained."""
    engine = LLMEngine(model, tokenizer, **options)
    done = run_engine(engine, prompts, params, arrivals)
    outs = [done[str(i)] for i in range(len(prompts))]
    assert [o.error for o in outs] == [None] * len(outs)
    assert_drained(engine)
    return outs, engine.stats()


def tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def assert_same_outputs(got, want, logprob_tol=1e-4):
    """Tokens, text, finish and stop reasons equal; logprobs within `logprob_tol`."""
    for i, (a, b) in enumerate(zip(got, want)):
        assert len(a.outputs) == len(b.outputs), i
        for x, y in zip(a.outputs, b.outputs):
            assert (x.token_ids, x.text, x.finish_reason, x.stop_reason) == \
                (y.token_ids, y.text, y.finish_reason, y.stop_reason), (i, x.index)
            assert (x.logprobs is None) == (y.logprobs is None)
            for p, q in zip(x.logprobs or [], y.logprobs or []):
                assert p.keys() == q.keys(), (i, x.index)
                assert all(abs(p[t] - q[t]) <= logprob_tol for t in p), (i, x.index)
        assert (a.prompt_logprobs is None) == (b.prompt_logprobs is None)
        for p, q in zip(a.prompt_logprobs or [], b.prompt_logprobs or []):
            assert (p is None) == (q is None)
            if p is not None:
                assert p.keys() == q.keys() and all(abs(p[t] - q[t]) <= logprob_tol for t in p)


# -- greedy: every combination equals stock generate ---------------------------------------

COMBOS = {
    # async scheduling with swaps (the in-flight token of a sequence swapped out lands)
    "async+swap": dict(async_scheduling=True, preemption_mode="swap", max_num_batched_tokens=16),
    # async scheduling, recompute preemption and prompts chunked 8 tokens at a time
    "async+recompute+chunk8": dict(async_scheduling=True, preemption_mode="recompute",
                                   max_num_batched_tokens=8),
    # speculation with swaps (drafts cleared when blocks run short)
    "ngram+swap": dict(speculative_config=NGRAM, preemption_mode="swap",
                       max_num_batched_tokens=16),
    # speculation with drafts trimmed by a small budget and recompute preemption
    "ngram+recompute+chunk8": dict(speculative_config=NGRAM, preemption_mode="recompute",
                                   max_num_batched_tokens=8),
}


@pytest.mark.parametrize("name, combo", [
    *[("llama_gqa", c) for c in COMBOS],
    ("mistral_sw", "async+swap"), ("mistral_sw", "ngram+recompute+chunk8"),
    ("falcon_mq", "async+recompute+chunk8"), ("falcon_alibi", "ngram+swap"),
    ("qwen3", "ngram+swap"), ("phi3", "async+swap"),
    ("gemma2", "ngram+recompute+chunk8"), ("gemma3", "async+swap"), ("gemma3", "ngram+swap"),
    ("gpt_oss", "async+recompute+chunk8"), ("gpt_oss", "ngram+swap"),
])
def test_greedy_equals_stock_with_options_combined(name, combo):
    model = model_of(name)
    system = [random.Random(1).randrange(3, VOCAB) for _ in range(9)]
    prompts = repetitive_prompts(2, 8, shared=system)
    max_tokens = [4 + (i * 5) % 11 for i in range(len(prompts))]
    refs = stock(name, prompts, max_tokens)
    options = dict(COMBOS[combo], block_size=4, max_num_seqs=6, admission_headroom=0)
    options["num_blocks"] = tight_blocks(model, prompts, max_tokens, 4,
                                         options["max_num_batched_tokens"])
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    outs, stats = run(model, prompts, params, [(i * 3) % 7 for i in range(len(prompts))],
                      **options)
    assert tokens(outs) == [[r] for r in refs]
    # (Sliding windows give blocks back as they go: a hybrid model's pool can keep up.)
    assert stats.num_preemptions > 0 or name in ("gemma3", "gpt_oss", "gemma2")
    if "ngram" in combo:
        assert stats.spec_accepted_tokens > 0


# -- seeded sampling: each option changes no token -----------------------------------------

def sampling_workload(seed: int = 4):
    """Seeded n > 1 with top-p / top-k, greedy rows, stop strings and stop token ids, EOS,
    min_tokens, penalties, logprobs and prompt logprobs, a shared prefix."""
    system = [random.Random(seed).randrange(3, VOCAB) for _ in range(10)]
    prompts = repetitive_prompts(seed, 8, shared=system)
    params = []
    for i, p in enumerate(prompts):
        sampled = i % 4 != 3
        params.append(SamplingParams(
            n=1 + i % 3, temperature=0.8 if sampled else 0, seed=100 + i if sampled else None,
            top_p=0.9 if i % 2 else 1.0, top_k=30 if i % 3 == 1 else 0, max_tokens=5 + (3 * i) % 11,
            stop=[f"w{p[1]}"] if i % 4 == 0 else None,
            stop_token_ids=[p[0]] if i % 4 == 1 else None, ignore_eos=i % 2 == 0,
            min_tokens=2 if i % 5 == 0 else 0, repetition_penalty=1.2 if i % 3 == 0 else 1.0,
            presence_penalty=0.4 if i % 4 == 2 else 0.0, logprobs=2 if i % 2 else None,
            prompt_logprobs=1 if i == 5 else None))
    return prompts, params, [i % 4 for i in range(len(prompts))]


VARIANTS = {
    "async": dict(async_scheduling=True),
    "ngram": dict(speculative_config=NGRAM),
    "tight+swap": dict(preemption_mode="swap", tight=True),
    "tight+recompute+async": dict(async_scheduling=True, tight=True),
    "tight+swap+ngram": dict(preemption_mode="swap", speculative_config=NGRAM, tight=True),
}


@pytest.mark.parametrize("name", ["llama_gqa", "gpt_oss"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_seeded_sampling_is_unchanged_by_each_combination(name, variant):
    model, tok = model_of(name), make_tokenizer()
    prompts, params, arrivals = sampling_workload()
    eos = stock(name, prompts[:1], [6])[0][3]  # a token the model emits: some rows stop
    common = dict(block_size=4, max_num_seqs=8, max_num_batched_tokens=16,
                  admission_headroom=0)
    options = dict(VARIANTS[variant])
    tight = options.pop("tight", False)
    max_tokens = [p.max_tokens for p in params]
    blocks = tight_blocks(model, prompts, max_tokens, 4, 16) if tight else 400

    def go(**extra):
        engine = LLMEngine(model, tok, **common, **extra)
        engine.eos_ids = {eos}
        done = run_engine(engine, prompts, params, arrivals)
        assert_drained(engine)
        outs = [done[str(i)] for i in range(len(prompts))]
        assert [o.error for o in outs] == [None] * len(outs)
        return outs, engine.stats()

    want, _ = go(num_blocks=400)
    got, stats = go(num_blocks=blocks, **options)
    assert_same_outputs(got, want)
    reasons = {c.finish_reason for o in want for c in o.outputs}
    assert reasons == {"stop", "length"}
    if tight:
        assert stats.num_preemptions > 0
    if "ngram" in variant:
        assert stats.spec_accepted_tokens > 0


# -- 8-bit KV: compared with 8-bit KV ---------------------------------------------------------

@pytest.mark.parametrize("name", ["llama_gqa", "mistral_sw", "falcon_alibi", "gpt_oss"])
def test_int8_kv_with_speculation_async_and_preemption(name):
    """Greedy and seeded n > 1 tokens of the 8-bit engine alone, with speculation under
    swaps, and with async scheduling under recomputation."""
    model = model_of(name)
    prompts = repetitive_prompts(5, 7, shared=[5, 6, 7, 8, 9, 10, 11])
    params = greedy_but_one(len(prompts), 6, 1, SamplingParams(
        n=2, temperature=0.9, seed=7, max_tokens=9, ignore_eos=True))
    max_tokens = [p.max_tokens for p in params]
    common = dict(block_size=4, max_num_seqs=6, max_num_batched_tokens=16, admission_headroom=0,
                  kv_cache_dtype="int8")
    tight = tight_blocks(model, prompts, max_tokens, 4, 16)
    arrivals = [i % 3 for i in range(len(prompts))]
    alone, _ = run(model, prompts, params, arrivals, num_blocks=400, **common)
    spec, spec_stats = run(model, prompts, params, arrivals, num_blocks=tight,
                           preemption_mode="swap", speculative_config=NGRAM, **common)
    overlap, overlap_stats = run(model, prompts, params, arrivals, num_blocks=tight,
                                 async_scheduling=True, **common)
    assert tokens(spec) == tokens(overlap) == tokens(alone)
    assert spec_stats.num_preemptions > 0 and overlap_stats.num_preemptions > 0
    assert spec_stats.spec_accepted_tokens > 0


# -- decode graphs (traced on CPU), a draft model, a compiled forward -------------------------

@pytest.fixture
def traced(monkeypatch):
    """Graphs on CPU: aten traces stand in for CUDA graphs (see test_cuda_graphs.py)."""
    monkeypatch.setattr(graphs_module, "capture_for", lambda device: graphs_module.TracedGraph)


@pytest.mark.parametrize("options", [
    dict(speculative_config=NGRAM, preemption_mode="swap"),
    dict(async_scheduling=True, kv_cache_dtype="int8"),
], ids=["ngram+swap", "async+int8"])
def test_decode_graphs_with_speculation_or_async_and_int8(traced, options):
    model = model_of("mistral_sw")
    prompts = repetitive_prompts(6, 7)
    params = greedy_but_one(len(prompts), 5, 2, SamplingParams(
        n=2, temperature=0.8, seed=3, max_tokens=8, logprobs=1))
    common = dict(block_size=4, max_num_seqs=6, max_num_batched_tokens=16, admission_headroom=0,
                  num_blocks=24, **options)
    arrivals = [i % 3 for i in range(len(prompts))]
    eager, _ = run(model, prompts, params, arrivals, **common)
    engine = LLMEngine(model, cuda_graphs=True, **common)
    done = run_engine(engine, prompts, params, arrivals)
    assert_drained(engine)
    assert engine.runner.graphs.stats()["replays"] > 0
    graphed = [done[str(i)] for i in range(len(prompts))]
    assert tokens(graphed) == tokens(eager)
    if "kv_cache_dtype" not in options:
        assert tokens(eager)[:2] == [[r] for r in stock("mistral_sw", prompts[:2], [5, 6])]


def test_draft_model_on_a_hybrid_target_with_forks_and_swaps():
    """A draft model (a sliding-window Mistral) for Gemma 3 (hybrid KV groups), with seeded
    n > 1 and a pool that swaps: greedy equals stock, sampling equals no speculation."""
    model, draft = model_of("gemma3"), model_of("mistral_sw")
    prompts = repetitive_prompts(8, 6)
    params = greedy_but_one(len(prompts), 6, 3, SamplingParams(
        n=3, temperature=0.8, seed=9, max_tokens=8, ignore_eos=True))
    max_tokens = [p.max_tokens for p in params]
    common = dict(block_size=4, max_num_seqs=6, max_num_batched_tokens=16, admission_headroom=0,
                  preemption_mode="swap")
    common["num_blocks"] = tight_blocks(model, prompts, max_tokens, 4, 16)
    arrivals = [i % 2 for i in range(len(prompts))]
    plain, _ = run(model, prompts, params, arrivals, **common)
    spec, stats = run(model, prompts, params, arrivals, speculative_config=dict(
        method="draft_model", model=draft, num_speculative_tokens=2, min_acceptance=0.0),
        **common)
    assert tokens(spec) == tokens(plain)
    refs = stock("gemma3", prompts, max_tokens)
    assert [t for i, t in enumerate(tokens(spec)) if i != 3] == \
        [[r] for i, r in enumerate(refs) if i != 3]
    assert stats.num_preemptions > 0 and stats.spec_proposed_tokens > 0


def test_compiled_forward_with_speculation_int8_swaps_and_sampling():
    """compile (Dynamo's "eager" backend: the whole graph captured, PyTorch's kernels) with
    verification rows, 8-bit reads, swaps and seeded n > 1: the eager engine's tokens."""
    model = model_of("mistral_sw")
    prompts = repetitive_prompts(9, 6, shared=[4, 5, 6, 7, 8])
    params = greedy_but_one(len(prompts), 5, 1, SamplingParams(
        n=2, temperature=0.8, seed=5, max_tokens=8, logprobs=1))
    common = dict(block_size=4, num_blocks=14, max_num_seqs=5, max_num_batched_tokens=16,
                  admission_headroom=0, preemption_mode="swap", kv_cache_dtype="int8",
                  speculative_config=NGRAM)
    arrivals = [i % 3 for i in range(len(prompts))]
    eager, _ = run(model, prompts, params, arrivals, **common)
    torch._dynamo.reset()
    try:
        compiled, stats = run(model, prompts, params, arrivals, compile="eager", **common)
    finally:
        torch._dynamo.reset()
    assert tokens(compiled) == tokens(eager)
    assert stats.num_preemptions > 0 and stats.spec_accepted_tokens > 0
