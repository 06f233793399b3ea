"""Async scheduling: step N+1 is planned and launched before the host reads step N's sampled
tokens, which feed it on the device; the host lands them while step N+1's forward runs. Every
token equals the synchronous engine's (and stock generate's for greedy), in every mode the
engine has: chunked prefill, both preemption modes, prefix hits, aborts, EOS and stop
strings, seeded sampling with n > 1, penalties, min_tokens, logprobs, hybrid KV groups,
streams and a compiled forward."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

import hf_paged
from hf_paged import LLM, LLMEngine, SamplingParams
from hf_paged.engine import runner as runner_module
from hf_paged.engine import sampler as sampler_module
from conftest import VOCAB, make_tokenizer
from test_engine import long_model, random_prompts, run_engine, stock_greedy
from zoo import make_arch


@pytest.mark.parametrize("kind", ["llama_gqa", "mistral_sw", "falcon_mq", "falcon_alibi"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_equals_stock_under_chunking_preemption_prefix_hits_and_aborts(kind, mode):
    model = long_model(kind)
    system = [random.Random(7).randrange(3, VOCAB) for _ in range(20)]
    prompts = random_prompts(1, 12, 1, 60, shared=system)
    max_tokens = [5 + (i * 3) % 11 for i in range(len(prompts))]
    refs = [stock_greedy(model, p, m) for p, m in zip(prompts, max_tokens)]
    windowed = kind == "mistral_sw"
    engine = LLMEngine(model, block_size=4, num_blocks=16 if windowed else 40, max_num_seqs=6,
                       max_num_batched_tokens=16 if windowed else 32, preemption_mode=mode,
                       admission_headroom=0, async_scheduling=True)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    arrivals = [(i * 5) % 17 for i in range(len(prompts))]
    done = run_engine(engine, prompts, params, arrivals, aborts=[(3, arrivals[3] + 4)])
    for i, ref in enumerate(refs):
        out = done[str(i)].outputs[0]
        if i == 3:  # aborted mid-way: what it got is stock's beginning, token in flight too
            assert out.finish_reason == "abort" and out.token_ids == ref[:len(out.token_ids)]
            continue
        assert out.token_ids == ref, f"request {i}"
        assert out.finish_reason == "length"
    stats = engine.stats()
    assert stats.num_preemptions > 0 or windowed
    assert stats.running == stats.waiting == stats.swapped == stats.blocks_used == 0


def _run_both(model, prompts, params, tokenizer=None, eos=None, **options):
    """Outputs of the synchronous and the async engine on the same requests."""
    results = []
    for async_scheduling in (False, True):
        engine = LLMEngine(model, tokenizer, block_size=4, num_blocks=120, max_num_seqs=6,
                           max_num_batched_tokens=40, async_scheduling=async_scheduling,
                           **options)
        if eos is not None:
            engine.eos_ids = {eos}
        done = run_engine(engine, prompts, params, [i % 4 for i in range(len(prompts))])
        results.append([done[str(i)] for i in range(len(prompts))])
        assert engine.stats().blocks_used == 0
    return results


def test_sampling_stops_and_forks_equal_the_synchronous_engine():
    model = long_model("llama_gqa")
    tok = make_tokenizer()
    prompts = random_prompts(3, 10, 3, 30)
    eos = stock_greedy(model, prompts[0], 8)[4]  # a token the model does emit
    params = [SamplingParams(
        temperature=0.8, top_p=0.9, seed=i, max_tokens=6 + i, n=1 + i % 3,
        logprobs=2 if i % 2 else None, min_tokens=3 if i % 5 == 0 else 0,
        repetition_penalty=1.2 if i % 3 == 0 else 1.0,
        presence_penalty=0.5 if i % 4 == 1 else 0.0,
        stop=["w1"] if i % 4 == 2 else None) for i in range(len(prompts))]
    sync, overlapped = _run_both(model, prompts, params, tok, eos=eos)
    reasons = set()
    for a, b in zip(sync, overlapped):
        assert len(a.outputs) == len(b.outputs)
        for x, y in zip(a.outputs, b.outputs):
            assert (x.token_ids, x.text, x.finish_reason, x.stop_reason) == \
                (y.token_ids, y.text, y.finish_reason, y.stop_reason)
            reasons.add(x.finish_reason)
            if x.logprobs is not None:
                assert [list(d) for d in x.logprobs] == [list(d) for d in y.logprobs]
                assert x.cumulative_logprob == pytest.approx(y.cumulative_logprob, abs=1e-4)
    assert reasons == {"stop", "length"}  # both kinds of ends happened


@pytest.mark.parametrize("name", ["gemma3", "gpt_oss"])
def test_hybrid_groups_and_sinks_equal_stock(name):
    model = make_arch(name)
    prompts = random_prompts(4, 6, 2, 24)
    refs = [stock_greedy(model, p, 9) for p in prompts]
    sync, overlapped = _run_both(model, prompts, SamplingParams(temperature=0, max_tokens=9,
                                                                ignore_eos=True))
    assert [o.outputs[0].token_ids for o in overlapped] == refs
    assert [o.outputs[0].token_ids for o in sync] == refs


def test_tokens_stay_on_the_device_until_the_next_forward_is_launched(monkeypatch):
    """The order of a step: the next forward is launched before the last step's tokens
    are read, and each step's tokens are read once."""
    events = []
    forward, collect = runner_module.ModelRunner.forward, sampler_module.Sampled.collect
    monkeypatch.setattr(runner_module.ModelRunner, "forward",
                        lambda self, f, check=None: events.append("forward") or forward(self, f, check))
    monkeypatch.setattr(sampler_module.Sampled, "collect",
                        lambda self: events.append("collect") or collect(self))
    model = long_model("llama_gqa")
    llm = LLM(model, block_size=4, num_blocks=40, async_scheduling=True)
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == stock_greedy(model, [5, 6, 7], 4)
    # Steps 2..4 each launch a forward, then land the previous step's token; the 4th token
    # is its last (max_tokens): nothing computes it, it lands in a step of its own.
    assert events == ["forward"] + ["forward", "collect"] * 3 + ["collect"]


def test_stream_and_compiled_forward():
    model = long_model("llama_gqa")
    tok = make_tokenizer()
    ref = stock_greedy(model, tok("w5 w6 w7")["input_ids"], 6)
    llm = hf_paged.AsyncLLM(model, tok, block_size=4, num_blocks=60, async_scheduling=True)

    async def stream():
        return [out async for out in llm.generate(
            "w5 w6 w7", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))]

    try:
        steps = asyncio.run(stream())
    finally:
        llm.shutdown()
    assert [len(o.outputs[0].token_ids) for o in steps] == [1, 2, 3, 4, 5, 6]
    assert steps[-1].outputs[0].token_ids == ref and steps[-1].finished
    assert steps[-1].outputs[0].text == tok.decode(ref, skip_special_tokens=True)
    torch._dynamo.reset()
    compiled = LLM(model, block_size=4, num_blocks=60, compile="eager", async_scheduling=True)
    prompts = random_prompts(8, 5, 2, 20)
    outs = compiled.generate(prompts, SamplingParams(temperature=0, max_tokens=7,
                                                     ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [stock_greedy(model, p, 7) for p in prompts]
    torch._dynamo.reset()


def test_option_is_checked_and_served():
    with pytest.raises(ValueError, match="async_scheduling"):
        LLMEngine(long_model("llama_gqa"), num_blocks=20, async_scheduling="yes")
    from hf_paged.serving.serve import engine_options, parser

    args = parser().parse_args(["some/model", "--async-scheduling"])
    assert engine_options(args)["async_scheduling"] is True
    assert engine_options(parser().parse_args(["some/model"]))["async_scheduling"] is False


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_async_scheduling_on_cuda_equals_stock_and_the_synchronous_engine():
    from conftest import make_model

    model = make_model("llama_gqa", max_position_embeddings=1400).cuda()
    prompts = random_prompts(5, 12, 2, 40)
    refs = [stock_greedy(model, p, 10) for p in prompts]
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    seeded = [SamplingParams(temperature=0.9, seed=i, max_tokens=10, n=2) for i in range(12)]
    outs = {}
    for overlap in (False, True):
        llm = LLM(model, block_size=4, num_blocks=200, max_num_seqs=8, async_scheduling=overlap)
        got = llm.generate(prompts, greedy, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == refs
        outs[overlap] = [[c.token_ids for c in o.outputs]
                         for o in llm.generate(prompts, seeded, use_tqdm=False)]
    assert outs[True] == outs[False]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_forking_tokens_land_before_the_next_plan(mode):
    """The token that forks a request's n completions is not pending (nothing computes it
    next step), so it lands before the next step is planned: the request can no longer be
    preempted in between with its forks unmade, and aborting it at any step keeps what the
    synchronous engine keeps."""
    model = long_model("llama_gqa")
    prompts = [[13, 26, 41, 14, 48], [72, 52, 52, 67, 54, 43, 95, 57]]
    params = [SamplingParams(temperature=0.8, seed=0, n=3, max_tokens=4, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=1, n=3, max_tokens=8, ignore_eos=True)]
    results = []
    for async_scheduling in (False, True):
        engine = LLMEngine(model, block_size=4, num_blocks=6, max_num_seqs=8,
                           max_num_batched_tokens=16, preemption_mode=mode,
                           admission_headroom=0, async_scheduling=async_scheduling)
        done = run_engine(engine, prompts, params, arrivals=[0, 1])
        results.append([[c.token_ids for c in done[k].outputs] for k in ("0", "1")])
        assert engine.stats().num_preemptions > 0
    assert results[0] == results[1]
    for at in (1, 2, 3):
        kept = []
        for async_scheduling in (False, True):
            engine = LLMEngine(model, block_size=4, num_blocks=200,
                               async_scheduling=async_scheduling)
            engine.add_request("r", [91, 8, 46, 43, 49],
                               SamplingParams(n=2, temperature=0.5, seed=348, max_tokens=8))
            engine.add_request("other", [5, 6, 7], SamplingParams(temperature=0, max_tokens=8))
            done = run_engine(engine, [], [], aborts=[("r", at)])
            kept.append([(c.token_ids, c.finish_reason) for c in done["r"].outputs])
        assert kept[0] == kept[1], at


def test_an_abort_arriving_after_the_last_token_leaves_the_request_as_it_ended():
    """An abort with a message, asked for while the request's last tokens are in flight:
    those tokens land first and end it ("length"); it keeps that ending, without the abort's
    error. Aborted at every step, each run ends either way, never with both."""
    model = long_model("llama_gqa")
    prompt = random_prompts(4, 1, 6, 6)[0]
    ends = set()
    for at in range(6):
        engine = LLMEngine(model, block_size=4, num_blocks=64, async_scheduling=True)
        engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=3,
                                                       ignore_eos=True))
        done = {}
        for step in range(12):
            if step == at:
                engine.abort("r", "the client left")
            done.update((o.request_id, o) for o in engine.step())
            if not engine.has_unfinished_requests():
                break
        out = done["r"]
        reason = out.outputs[0].finish_reason
        assert (out.error == "the client left") == (reason == "abort"), (at, reason, out.error)
        ends.add(reason)
        assert engine.stats().blocks_used == 0
    assert ends == {"abort", "length"}


def _poisoned(model, token):
    """Makes `model`'s forward raise on any input holding `token`; returns the undo."""
    inner = model.forward

    def forward(*args, input_ids=None, **kwargs):
        if bool((input_ids == token).any()):
            raise RuntimeError("poisoned forward")
        return inner(*args, input_ids=input_ids, **kwargs)

    model.forward = forward
    return lambda: delattr(model, "forward")


def test_a_forward_failing_on_the_token_that_stopped_its_sequence_fails_nobody():
    """Async scheduling computes a stopped sequence's last token (one too many, dropped). A
    forward that failed on it failed the request, which had ended cleanly without async, and
    the request's sibling completions with it."""
    from conftest import make_model

    model, prompt = make_model("llama_gqa"), [13, 26, 41, 14, 48]
    greedy = LLMEngine(model, block_size=4, num_blocks=64)
    greedy.add_request("g", prompt, SamplingParams(temperature=0, max_tokens=6,
                                                   ignore_eos=True))
    tokens = run_engine(greedy, [], [])["g"].outputs[0].token_ids
    poison = next(t for t in tokens[1:] if t not in prompt and t not in tokens[:1])
    cases = [SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[poison])]
    cases += [SamplingParams(temperature=1.0, seed=seed, n=2, max_tokens=8,
                             stop_token_ids=[poison]) for seed in range(12)]
    undo = _poisoned(model, poison)
    try:
        stopped_early = 0
        for params in cases:
            outs = []
            for async_scheduling in (False, True):
                engine = LLMEngine(model, block_size=4, num_blocks=64,
                                   async_scheduling=async_scheduling)
                engine.add_request("r", prompt, params)
                engine.add_request("other", [5, 6, 7], SamplingParams(temperature=0,
                                                                      max_tokens=6))
                done = run_engine(engine, [], [])
                outs.append([(o.error, [(c.token_ids, c.finish_reason) for c in o.outputs])
                             for o in (done["r"], done["other"])])
                assert engine.stats().blocks_used == 0
            assert outs[1] == outs[0], params
            stopped_early += any(r == "stop" for _, r in outs[0][0][1])
            assert outs[0][0][0] is None  # (without async no forward ever saw the token)
        assert stopped_early >= 2
    finally:
        undo()


def test_fail_all_lands_the_tokens_in_flight():
    """fail_all (shutdown, a failed step) dropped async scheduling's last sampled token, so
    a request lost a token (and its logprobs) the synchronous engine had given it; one that
    token ended keeps its own ending. (The step before fail_all fails before it lands it.)"""
    from conftest import make_model

    model = make_model("llama_gqa")
    results = []
    for async_scheduling in (False, True):
        engine = LLMEngine(model, block_size=4, num_blocks=64, async_scheduling=async_scheduling)
        engine.add_request("long", [5, 6, 7, 8], SamplingParams(
            temperature=0, max_tokens=10, ignore_eos=True, logprobs=0))
        engine.add_request("short", [9, 10], SamplingParams(temperature=0, max_tokens=4,
                                                            ignore_eos=True))
        seen = {}
        for _ in range(4):
            seen.update({o.request_id: o for o in engine.step() if o.finished})
        schedule = engine.scheduler.schedule  # a fifth step fails, as no request made it
        engine.scheduler.schedule = lambda: 1 / 0
        with pytest.raises(ZeroDivisionError):
            engine.step()
        engine.scheduler.schedule = schedule
        seen.update({o.request_id: o for o in engine.fail_all("shutting down")})
        results.append({k: (o.error, o.outputs[0].finish_reason, o.outputs[0].token_ids,
                            len(o.outputs[0].logprobs or []))
                        for k, o in seen.items()})
        results[-1]["generated"] = engine.generation_tokens
        assert engine.stats().blocks_used == 0 and not engine.has_unfinished_requests()
    assert results[1] == results[0]
    assert results[0]["short"][:2] == (None, "length")
    assert results[0]["long"][:2] == ("shutting down", "error")
    assert len(results[0]["long"][2]) == results[0]["long"][3] == 4
