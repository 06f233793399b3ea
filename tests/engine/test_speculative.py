"""Speculative decoding in the engine: greedy tokens equal stock `generate` and the engine
without speculation under chunking, preemption both ways, prefix hits, n > 1 and stops;
seeded sampling equals the run without speculation token for token (the draws are the
same); the sampled distribution is the target's (chi-square); the turn-down rules; the
draft-model method; bad configs. Every engine here runs with the isolation checks on."""

from __future__ import annotations

import math
import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_paged import LLM, LLMEngine, SamplingParams
from hf_paged.sampling_params import StructuredOutputsParams
from conftest import EOS, VOCAB, make_byte_tokenizer, make_model, make_tokenizer
from test_engine import KINDS, long_model, random_prompts, run_engine, stock_greedy

# Proposes whenever any suffix was seen before, and never pauses: every path is exercised.
NGRAM = dict(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, min_acceptance=0.0)


def repetitive_prompts(seed: int, count: int, shared: list[int] | None = None) -> list[list[int]]:
    """Prompts that repeat a span (so prompt lookup proposes), some after a shared prefix."""
    rng = random.Random(seed)
    prompts = []
    for i in range(count):
        span = [rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 9))]
        prompt = span * rng.randint(2, 4) + [rng.randrange(3, VOCAB)]
        prompts.append((shared + prompt) if shared and i % 2 else prompt)
    return prompts


def spec_and_plain(model, prompts, params, tokenizer=None, spec=NGRAM, **options):
    """(outputs by id with speculation, without it, the speculating engine's stats)."""
    runs = []
    for config in (spec, None):
        engine = LLMEngine(model, tokenizer, speculative_config=config, **options)
        runs.append(run_engine(engine, prompts, params))
        if config is not None:
            stats = engine.stats()
    return runs[0], runs[1], stats


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_equals_stock_under_chunking_preemption_and_prefix_hits(kind, mode):
    model = long_model(kind)
    system = [random.Random(5).randrange(3, VOCAB) for _ in range(12)] * 2
    prompts = repetitive_prompts(1, 10, shared=system) + [[7, 8, 9] * 40]
    max_tokens = [8 + (i * 5) % 13 for i in range(len(prompts))]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    windowed = kind == "mistral_sw"
    engine = LLMEngine(model, block_size=4, num_blocks=24 if windowed else 36, max_num_seqs=6,
                       max_num_batched_tokens=24, preemption_mode=mode, admission_headroom=0,
                       speculative_config=NGRAM)
    done = run_engine(engine, prompts, params, arrivals=[(i * 3) % 11 for i in range(len(prompts))])
    for i, (p, m) in enumerate(zip(prompts, max_tokens)):
        assert done[str(i)].outputs[0].token_ids == stock_greedy(model, p, m), i
    s = engine.stats()
    assert s.num_preemptions > 0 and s.prefix_cache_hit_tokens > 0
    assert 0 < s.spec_accepted_tokens < s.spec_proposed_tokens  # drafts kept and dropped
    assert s.blocks_used == 0 and s.running == 0


def test_seeded_sampling_is_the_same_with_and_without_speculation():
    """n > 1, penalties, top-k/p, min_tokens, logprobs, stop tokens: the same draws give
    the same tokens, so speculation changes nothing, and a seed reproduces itself."""
    model = long_model("llama_gqa")
    prompts = repetitive_prompts(2, 6)
    params = [SamplingParams(n=3, temperature=0.7 + 0.1 * i, top_p=0.9, top_k=40, seed=11 + i,
                             max_tokens=24, min_tokens=4, repetition_penalty=1.1,
                             presence_penalty=0.2 * (i % 2), logprobs=2,
                             stop_token_ids=[prompts[i][1]]) for i in range(len(prompts))]
    options = dict(block_size=4, num_blocks=400, max_num_seqs=8, max_num_batched_tokens=64)
    spec, plain, stats = spec_and_plain(model, prompts, params, **options)
    again, _, _ = spec_and_plain(model, prompts, params, spec=NGRAM, **options)
    assert stats.spec_accepted_tokens > 0
    stopped = 0
    for i in map(str, range(len(prompts))):
        for a, b, c in zip(spec[i].outputs, plain[i].outputs, again[i].outputs):
            assert a.token_ids == b.token_ids == c.token_ids
            assert a.finish_reason == b.finish_reason
            stopped += a.finish_reason == "stop"
            for x, y in zip(a.logprobs, b.logprobs):
                assert x.keys() == y.keys()
                assert all(math.isclose(x[t], y[t], abs_tol=1e-4) for t in x)
    assert stopped > 0


def test_greedy_stops_and_text_equal_the_plain_engine():
    """A stop string inside a run of accepted drafts ends the completion there."""
    model, tok = long_model("falcon_new"), make_tokenizer()
    prompts = [tok.decode(p) for p in repetitive_prompts(3, 6)]
    options = dict(block_size=8, num_blocks=200, max_num_seqs=4)
    free = run_engine(LLMEngine(model, tok, **options), prompts,
                      SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    texts = [free[str(i)].outputs[0].text for i in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=30, stop=[t[len(t) // 2:len(t) // 2 + 2]])
              for t in texts]
    spec, plain, stats = spec_and_plain(model, prompts, params, tok, **options)
    assert stats.spec_accepted_tokens > 0
    for i in map(str, range(6)):
        a, b = spec[i].outputs[0], plain[i].outputs[0]
        assert (a.token_ids, a.text, a.finish_reason, a.stop_reason) == \
               (b.token_ids, b.text, b.finish_reason, b.stop_reason)
        assert a.finish_reason == "stop"


def tiny_vocab_model(vocab: int = 6):
    torch.manual_seed(3)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=2, max_position_embeddings=64))
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)  # varied, but far from one-hot, distributions
    return model.eval()


def test_sampling_with_speculation_keeps_the_target_distribution():
    """Chi-square of the first two sampled tokens against the model's own probabilities,
    with the second token verified against a draft in most requests."""
    model, vocab = tiny_vocab_model(), 6
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    with torch.no_grad():
        first = model(torch.tensor([prompt])).logits[0, -1].softmax(-1)
        second = model(torch.tensor([prompt + [t] for t in range(vocab)])).logits[:, -1].softmax(-1)
    expected = (first[:, None] * second).flatten().tolist()
    requests = 3000
    llm = LLM(model, block_size=4, num_blocks=4096, max_num_seqs=256,
              speculative_config=dict(NGRAM, disable_by_batch_size=256))
    outs = llm.generate([prompt] * requests, SamplingParams(temperature=1.0, max_tokens=2,
                                                           ignore_eos=True), use_tqdm=False)
    counts = [0] * vocab * vocab
    for out in outs:
        t1, t2 = out.outputs[0].token_ids
        counts[t1 * vocab + t2] += 1
    stats = llm.engine.stats()
    assert stats.spec_verifications > requests // 2  # most second tokens were verified
    # Cells with fewer than 5 expected draws are pooled, as the test requires.
    observed, wanted, pooled_o, pooled_e = [], [], 0, 0.0
    for o, e in zip(counts, expected):
        if e * requests >= 5:
            observed.append(o)
            wanted.append(e * requests)
        else:
            pooled_o, pooled_e = pooled_o + o, pooled_e + e * requests
    if pooled_e:
        observed.append(pooled_o)
        wanted.append(pooled_e)
    chi2 = sum((o - e) ** 2 / e for o, e in zip(observed, wanted))
    from scipy.stats import chi2 as dist
    assert chi2 < dist.ppf(0.999, len(observed) - 1), (chi2, len(observed))


def test_turning_down_per_sequence_and_engine_wide():
    model = long_model("llama_gqa")
    # A draft model that is not the target: its drafts are nearly all rejected.
    wrong = dict(method="draft_model", model=make_model("llama_mha", seed=4, num_hidden_layers=1),
                 num_speculative_tokens=3)
    prompts = random_prompts(4, 4, 20, 40)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    proposed = {}
    for name, extra in (("always", {"min_acceptance": 0.0}), ("per_sequence", {}),
                        ("engine_wide", {"min_acceptance": 0.0, "disable_by_batch_size": 3})):
        engine = LLMEngine(model, block_size=4, num_blocks=400, max_num_seqs=4,
                           speculative_config=dict(wrong, **extra))
        done = run_engine(engine, prompts, params)
        for i, p in enumerate(prompts):
            assert done[str(i)].outputs[0].token_ids == stock_greedy(model, p, 40)
        proposed[name] = engine.stats().spec_proposed_tokens
    assert proposed["always"] > 4 * 3 * 30
    # The default min_acceptance (0.25): a sequence whose drafts keep failing pauses for 4,
    # 8, ... 64 steps.
    assert proposed["per_sequence"] < proposed["always"] / 4
    # Four running at once, more than 3: nothing is proposed.
    assert proposed["engine_wide"] == 0


@pytest.mark.parametrize("same", [True, False], ids=["draft_is_target", "smaller_draft"])
def test_draft_model_greedy_equals_stock(same, tmp_path):
    model = long_model("falcon_new")
    draft = model if same else make_model("mistral_sw", seed=4, num_hidden_layers=1,
                                          max_position_embeddings=1400)
    if not same:  # loaded from a folder, as `hf-paged serve --speculative-config` does
        draft.save_pretrained(tmp_path / "draft")
        draft = str(tmp_path / "draft")
    prompts = repetitive_prompts(5, 8) + [[4, 5, 6, 7] * 20]
    params = [SamplingParams(temperature=0, max_tokens=10 + i, ignore_eos=True)
              for i in range(len(prompts))]
    engine = LLMEngine(model, block_size=4, num_blocks=28, max_num_seqs=4,
                       max_num_batched_tokens=16, admission_headroom=0,
                       speculative_config=dict(method="draft_model", model=draft,
                                               num_speculative_tokens=4, min_acceptance=0.0))
    done = run_engine(engine, prompts, params, arrivals=[(i * 3) % 11 for i in range(len(prompts))])
    for i, p in enumerate(prompts):
        assert done[str(i)].outputs[0].token_ids == stock_greedy(model, p, 10 + i)
    s = engine.stats()
    assert s.num_preemptions > 0
    if same:  # the target's own greedy drafts: all kept
        assert s.spec_accepted_tokens == s.spec_proposed_tokens > 0
    else:
        assert s.spec_proposed_tokens > 0
    assert s.spec_mean_accepted_length == 1 + s.spec_accepted_tokens / s.spec_verifications


def test_a_draft_with_fewer_embeddings_leaves_out_tokens_it_cannot_embed():
    """A draft whose vocabulary is padded to a smaller size than the target's (same
    tokenizer) cannot embed the target's last ids: a sequence holding one goes undrafted
    (it raised IndexError out of the step, failing every request), the others draft."""
    model = make_model("llama_gqa")
    draft = make_model("llama_gqa", seed=4, num_hidden_layers=1, vocab_size=VOCAB - 20)
    low = [t for t in range(3, VOCAB - 20)]
    prompts = [[5, 6, 7] * 4 + [5], [VOCAB - 3, VOCAB - 2] * 3, [low[-1], 4, 5] * 3]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * len(prompts)
    engine = LLMEngine(model, block_size=4, num_blocks=64,
                       speculative_config=dict(method="draft_model", model=draft,
                                               num_speculative_tokens=3, min_acceptance=0.0))
    done = run_engine(engine, prompts, params)
    for i, p in enumerate(prompts):
        assert done[str(i)].outputs[0].token_ids == stock_greedy(model, p, 12)
    assert engine.stats().spec_proposed_tokens > 0 and engine.stats().blocks_used == 0


def test_a_draft_model_failing_on_one_sequence_fails_no_request(caplog):
    """A draft model whose forward raises on one sequence's tokens failed the whole step, so
    every request in flight. Now that sequence decodes without drafts, found by halves, and
    the others draft as before; every request keeps its stock tokens."""
    model = long_model("llama_gqa")
    draft = make_model("llama_gqa", seed=4, num_hidden_layers=1, max_position_embeddings=1400)
    inner = draft.forward

    def forward(*args, input_ids=None, **kwargs):
        if input_ids is not None and bool((input_ids == 77).any()):
            raise RuntimeError("poisoned draft forward")
        return inner(*args, input_ids=input_ids, **kwargs)

    draft.forward = forward
    prompts = [[t if t != 77 else 76 for t in p] for p in repetitive_prompts(3, 5)]
    prompts.append([5, 6, 77, 5, 6, 77, 5, 6])
    engine = LLMEngine(model, block_size=4, num_blocks=120,
                       speculative_config=dict(method="draft_model", model=draft,
                                               num_speculative_tokens=3, min_acceptance=0.0))
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    with caplog.at_level("WARNING", logger="hf_paged"):
        done = run_engine(engine, prompts, params)
    for i, p in enumerate(prompts):
        assert done[str(i)].outputs[0].token_ids == stock_greedy(model, p, 10)
        assert done[str(i)].outputs[0].finish_reason == "length"
    assert "poisoned draft forward" in caplog.text
    assert engine.stats().spec_proposed_tokens > 0 and engine.stats().blocks_used == 0


def test_a_draft_model_catches_up_within_the_step_budget():
    """A draft model caught up on a long prompt in one forward of all its tokens, whatever
    max_num_batched_tokens said; now in chunks of the budget over several steps, after
    which the sequence drafts (the target as its own draft: every draft kept)."""
    model = long_model("llama_gqa")
    engine = LLMEngine(model, block_size=4, num_blocks=200, max_num_batched_tokens=32,
                       speculative_config=dict(method="draft_model", model=model,
                                               num_speculative_tokens=3, min_acceptance=0.0))
    proposer = engine.speculator.proposer
    sizes, drafted, forward, propose = [], set(), proposer.runner.forward, proposer.propose

    def counted(f, *args, **kwargs):
        sizes.append(len(f.ids))
        return forward(f, *args, **kwargs)

    def noted(seqs, *args):
        drafts = propose(seqs, *args)
        drafted.update(len(seq.prompt) for seq, d in zip(seqs, drafts) if d)
        return drafts

    proposer.runner.forward, proposer.propose = counted, noted
    prompts = random_prompts(7, 1, 150, 150) + random_prompts(8, 2, 5, 9)
    done = run_engine(engine, prompts, SamplingParams(temperature=0, max_tokens=40,
                                                      ignore_eos=True))
    for i, p in enumerate(prompts):
        assert done[str(i)].outputs[0].token_ids == stock_greedy(model, p, 40)
    assert max(sizes) <= 32 and 150 in drafted
    stats = engine.stats()
    assert stats.spec_accepted_tokens == stats.spec_proposed_tokens > 0


def test_a_draft_models_pool_is_free_once_its_sequences_end():
    """The draft model's rows of ended sequences held their blocks until a later step
    proposed for someone else (so after the last request, for good). Now every step gives
    them back: after a run, after an abort, after a stop token."""
    model = make_model("llama_gqa")
    engine = LLMEngine(model, block_size=4, num_blocks=64, backend="torch",
                       speculative_config=dict(method="draft_model", model=model,
                                               num_speculative_tokens=3, min_acceptance=0.0))
    blocks = engine.speculator.proposer.runner.pool.blocks
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[5, 6, 7] * 5, [9, 10, 11, 12] * 4]
    done = run_engine(engine, prompts, params)
    for i, p in enumerate(prompts):
        assert done[str(i)].outputs[0].token_ids == stock_greedy(model, p, 12)
    assert engine.stats().spec_proposed_tokens > 0
    assert blocks.num_free == blocks.num_blocks and engine.stats().blocks_used == 0
    engine.add_request("a", prompts[0], params)
    for _ in range(3):
        engine.step()
    assert blocks.num_free < blocks.num_blocks  # it drafted
    engine.abort("a")
    engine.step()
    assert blocks.num_free == blocks.num_blocks and not engine.has_unfinished_requests()


def test_structured_outputs_with_speculation_equal_the_plain_engine():
    """Each verified position is masked as its constraint stands after the drafts before it."""
    model = make_model("llama_gqa", vocab_size=320, eos_token_id=EOS)
    tok = make_byte_tokenizer(300)
    spec = StructuredOutputsParams(regex=r"([0-9]{1,3}-(yes|no),){2,6}")
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=40, structured_outputs=spec)
    prompts = ["1-yes,2-no,1-no,2-yes," * 3, "hello 12-no,3-no,"]
    with_spec, plain, stats = spec_and_plain(model, prompts, params, tok, block_size=4,
                                             num_blocks=400, max_num_seqs=4)
    assert stats.spec_accepted_tokens > 0
    for i in ("0", "1"):
        for a, b in zip(with_spec[i].outputs, plain[i].outputs):
            assert a.token_ids == b.token_ids and a.text == b.text


def test_a_draft_that_completes_a_constraint_and_ends_it():
    """A draft may hold a constraint's last token and then EOS (the prompt repeats the
    answer): the constraint ends there, so nothing after the EOS is masked, and the
    completion equals the plain engine's instead of failing in the grammar matcher."""
    model = make_model("llama_gqa", vocab_size=320, eos_token_id=EOS)
    tok = make_byte_tokenizer(300)
    answer = tok.encode("ab.") + [EOS]
    params = SamplingParams(temperature=0, max_tokens=10,
                            structured_outputs=StructuredOutputsParams(choice=["ab."]))
    config = dict(method="ngram", num_speculative_tokens=4, prompt_lookup_min=1,
                  min_acceptance=0.0)
    with_spec, plain, stats = spec_and_plain(model, [answer * 2, answer * 3], params, tok,
                                             spec=config, block_size=4, num_blocks=64)
    assert stats.spec_proposed_tokens > 0
    for i in ("0", "1"):
        got, want = with_spec[i].outputs[0], plain[i].outputs[0]
        assert (got.token_ids, got.text, got.finish_reason) == (
            want.token_ids, want.text, "stop") and with_spec[i].error is None


@pytest.mark.parametrize("config, message", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram"}, "needs"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "unknown"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5}, "exceeds"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_kv_cache_bytes": 0},
     "draft_kv_cache_bytes"),
    ({"method": "ngram", "num_speculative_tokens": 2, "min_acceptance": "0.1"}, "min_acceptance"),
    ({"method": "ngram", "num_speculative_tokens": 2, "min_acceptance": None}, "min_acceptance"),
    ("ngram", "dict"),
])
def test_bad_configs_are_named(config, message):
    with pytest.raises(ValueError, match=message):
        LLMEngine(long_model("llama_gqa"), num_blocks=64, speculative_config=config)


def test_async_scheduling_gives_way_with_a_warning(caplog):
    """Proposals follow each step's tokens: the engine runs synchronously, saying so."""
    model = long_model("llama_gqa")
    prompts = repetitive_prompts(7, 3)
    engine = LLMEngine(model, num_blocks=64, async_scheduling=True, speculative_config=NGRAM)
    assert not engine.async_scheduling and "async_scheduling is off" in caplog.text
    done = run_engine(engine, prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    for i, p in enumerate(prompts):
        assert done[str(i)].outputs[0].token_ids == stock_greedy(model, p, 16)


def test_serve_option_and_metrics():
    import json
    from prometheus_client import CollectorRegistry, generate_latest

    from hf_paged.serving.metrics import _EngineCollector as EngineCollector
    from hf_paged.serving.serve import engine_options, parser

    args = parser().parse_args(["m", "--speculative-config", json.dumps(NGRAM)])
    assert engine_options(args)["speculative_config"] == NGRAM
    with pytest.raises(SystemExit):
        parser().parse_args(["m", "--speculative-config", "[1]"])
    engine = LLMEngine(long_model("llama_gqa"), num_blocks=64, speculative_config=NGRAM)
    run_engine(engine, repetitive_prompts(6, 2), SamplingParams(temperature=0, max_tokens=12))
    registry = CollectorRegistry()
    registry.register(EngineCollector(engine.stats, "m"))
    text = generate_latest(registry).decode()
    s = engine.stats()
    assert f"hf_paged_spec_decode_num_draft_tokens_total{{model_name=\"m\"}} {float(s.spec_proposed_tokens)}" in text
    assert "hf_paged_spec_decode_acceptance_rate" in text and s.spec_proposed_tokens > 0


@pytest.mark.slow  # a minute of Dynamo tracing
def test_compiled_engine_with_speculation_and_8bit_kv_equals_eager():
    """compile=True (fullgraph; the "eager" backend: Dynamo's tracing without Inductor's
    minutes) traces the verification rows and the 8-bit reads, with the same tokens."""
    model = long_model("llama_gqa")
    prompts = repetitive_prompts(8, 4)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    runs = []
    for compile in (False, "eager"):
        engine = LLMEngine(model, block_size=4, num_blocks=200, max_num_seqs=4,
                           kv_cache_dtype="int8", speculative_config=NGRAM, compile=compile)
        done = run_engine(engine, prompts, params)
        runs.append([done[str(i)].outputs[0].token_ids for i in range(len(prompts))])
        assert engine.stats().spec_accepted_tokens > 0
    assert runs[0] == runs[1]
