"""One request never harms another, in the engine and its Python API: settings that would
break a step are refused or made safe at admission; a forward, a sampling row or a stop
check that fails ends only the request that caused it (victims keep their solo tokens, the
blocks come back, the LLM serves the next call); deadlines; prefix-cache namespaces (cache
salts, adapters whose names run into their tokens); a random mix of good and bad requests."""

from __future__ import annotations

import random
import time

import pytest
import torch

import hf_paged
from hf_paged import LLM, LLMEngine, SamplingParams
from hf_paged.errors import InvalidRequestError
from hf_paged.prefix_cache import block_key, namespace
from hf_paged.sampler import Sampler
from conftest import VOCAB, make_tokenizer
from test_engine import (
    long_model, random_prompts, run_engine, stock_greedy, two_adapter_model,
)

GREEDY = dict(temperature=0, ignore_eos=True)


def greedy(max_tokens, **kw):
    return SamplingParams(max_tokens=max_tokens, **GREEDY, **kw)


def victims(seed=11, count=6):
    prompts = random_prompts(seed, count, 3, 25)
    return prompts, [stock_greedy(long_model("llama_gqa"), p, 8) for p in prompts]


def assert_clean(engine):
    """Nothing queued, every block back (cached prefix blocks aside)."""
    stats = engine.stats()
    assert stats.running == stats.waiting == stats.swapped == 0
    assert stats.blocks_used == 0
    assert not engine.requests


# -- admission -------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, param", [
    (dict(stop_token_ids=[VOCAB], min_tokens=1), "stop_token_ids"),
    (dict(stop_token_ids=[-1], min_tokens=1), "stop_token_ids"),
    (dict(seed=2**64), "seed"),
    (dict(seed=-2**63 - 1), "seed"),
    (dict(repetition_penalty=1e-41), "repetition_penalty"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(top_p=float("nan")), "top_p"),
    (dict(timeout=0), "timeout"),
    (dict(cache_salt=""), "cache_salt"),
])
def test_bad_settings_are_refused_by_name_and_nothing_is_queued(kw, param):
    llm = LLM(long_model("llama_gqa"), block_size=4, num_blocks=60)
    prompts, refs = victims()
    with pytest.raises(InvalidRequestError) as err:
        llm.generate(prompts[:3] + [[5, 6, 7]] + prompts[3:],
                     [greedy(8)] * 3 + [SamplingParams(max_tokens=4, **kw)] + [greedy(8)] * 3,
                     use_tqdm=False)
    assert err.value.param == param
    assert_clean(llm.engine)  # the earlier prompts of the call did not stay queued
    outs = llm.generate(prompts, greedy(8), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == refs
    assert llm.engine.stats().prompt_tokens == sum(len(p) for p in prompts)  # computed once


def test_settings_that_cannot_fail_run_next_to_victims():
    """top_k above the vocabulary keeps every token (as vLLM), a temperature that would
    overflow the logits samples greedily, extreme but finite seeds wrap as torch does."""
    model = long_model("llama_gqa")
    prompts, refs = victims()
    odd = [SamplingParams(temperature=0.9, top_k=10**9, seed=3, max_tokens=8, ignore_eos=True),
           SamplingParams(temperature=1e-41, max_tokens=8, ignore_eos=True),
           SamplingParams(temperature=1.0, seed=2**64 - 1, n=2, max_tokens=8, ignore_eos=True),
           SamplingParams(logprobs=20, max_tokens=8, temperature=0, ignore_eos=True)]
    llm = LLM(model, block_size=4, num_blocks=100)
    outs = llm.generate(prompts + [[9, 10, 11]] * 4, [greedy(8)] * len(prompts) + odd,
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[:len(prompts)]] == refs
    top_k, tiny, wrapped, logprobs = outs[len(prompts):]
    same = llm.generate([[9, 10, 11]], SamplingParams(temperature=0.9, top_k=0, seed=3,
                                                      max_tokens=8, ignore_eos=True),
                        use_tqdm=False)[0]
    assert top_k.outputs[0].token_ids == same.outputs[0].token_ids
    assert tiny.outputs[0].token_ids == stock_greedy(model, [9, 10, 11], 8)
    zero = llm.generate([[9, 10, 11]], SamplingParams(temperature=1.0, seed=0, max_tokens=8,
                                                      ignore_eos=True), use_tqdm=False)[0]
    assert wrapped.outputs[1].token_ids == zero.outputs[0].token_ids  # 2**64 wraps to 0
    assert all(len(e) >= 20 for e in logprobs.outputs[0].logprobs)
    assert_clean(llm.engine)


def test_logprobs_and_top_k_beyond_a_small_vocabulary():
    small = hf_paged.LLM(long_model("llama_gqa").__class__(long_model("llama_gqa").config.__class__(
        **{**long_model("llama_gqa").config.to_dict(), "vocab_size": 12})), block_size=4,
        num_blocks=40)
    out = small.generate([[3, 4, 5]], SamplingParams(logprobs=20, top_k=50, temperature=1.0,
                                                      seed=0, max_tokens=4, ignore_eos=True),
                         use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "length"
    assert all(len(e) == 12 for e in out.outputs[0].logprobs)


# -- failures while running ----------------------------------------------------------------------
class Poisoned:
    """Wraps the model's forward: raises when `when(input_ids, position_ids)` is true."""

    def __init__(self, model, when):
        self.model, self.when, self.calls = model, when, 0
        self.inner = model.forward

    def __enter__(self):
        def forward(*args, input_ids=None, position_ids=None, **kw):
            self.calls += 1
            if self.when(input_ids, position_ids):
                raise RuntimeError("poisoned forward")
            return self.inner(*args, input_ids=input_ids, position_ids=position_ids, **kw)

        self.model.forward = forward
        return self

    def __exit__(self, *exc):
        del self.model.forward


@pytest.mark.parametrize("mode, overlap", [("recompute", False), ("swap", False),
                                           ("recompute", True)])
def test_a_forward_that_fails_ends_only_its_request(mode, overlap):
    model = long_model("llama_gqa")
    prompts, refs = victims(count=8)
    poison = 77
    bad_prefill = [4, poison, 5, 6]  # fails on its first forward
    long_one = [3] * 30  # fails once it decodes at position 33
    llm = LLM(model, block_size=4, num_blocks=24, max_num_seqs=6, max_num_batched_tokens=40,
              preemption_mode=mode, async_scheduling=overlap)
    assert all(poison not in p for p in prompts) and all(len(p) + 8 < 33 for p in prompts)
    when = lambda ids, pos: bool((ids == poison).any() or (pos == 33).any())  # noqa: E731
    with Poisoned(model, when):
        outs = llm.generate(prompts[:4] + [bad_prefill, long_one] + prompts[4:],
                            greedy(8), use_tqdm=False)
    bad, late = outs[4], outs[5]
    good = outs[:4] + outs[6:]
    assert [o.outputs[0].token_ids for o in good] == refs
    assert all(o.outputs[0].finish_reason == "length" and o.error is None for o in good)
    assert bad.outputs[0].finish_reason == "error" and "poisoned forward" in bad.error
    assert late.outputs[0].finish_reason == "error" and "poisoned forward" in late.error
    assert len(late.outputs[0].token_ids) == 4  # sampled after positions 29 .. 32
    assert_clean(llm.engine)
    again = llm.generate(prompts, greedy(8), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == refs


def test_a_sampling_row_that_fails_ends_only_its_request_and_seeds_rewind():
    """Sampling raises for one request's rows: the batch is sampled again row by row, with
    each seeded generator rewound, so seeded victims keep their tokens exactly."""
    model = long_model("llama_gqa")
    prompts = random_prompts(12, 6, 3, 20)
    seeded = [SamplingParams(temperature=0.8, top_p=0.9, seed=100 + i, max_tokens=8,
                             ignore_eos=True) for i in range(len(prompts))]
    alone = [LLM(model, block_size=4, num_blocks=60).generate([p], s, use_tqdm=False)[0]
             for p, s in zip(prompts, seeded)]
    marker = 0.123

    class Flaky(Sampler):
        def warp(self, logits, rows):
            if any(r.params.min_p == marker for r in rows):
                raise RuntimeError("bad warp")
            return super().warp(logits, rows)

    llm = LLM(model, block_size=4, num_blocks=60)
    llm.engine.sampler = Flaky()
    bad = SamplingParams(temperature=0.8, min_p=marker, max_tokens=8, ignore_eos=True)
    outs = llm.generate(prompts[:3] + [[5, 6]] + prompts[3:], seeded[:3] + [bad] + seeded[3:],
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[:3] + outs[4:]] == \
        [a.outputs[0].token_ids for a in alone]
    assert outs[3].outputs[0].finish_reason == "error" and "bad warp" in outs[3].error
    assert_clean(llm.engine)


@pytest.mark.parametrize("overlap", [False, True])  # async scheduling
def test_a_row_whose_logits_are_not_finite_ends_alone(overlap):
    model = long_model("llama_gqa")
    prompts, refs = victims()
    marker = 1.25

    class NaNs(Sampler):
        def penalize(self, logits, rows):
            logits = super().penalize(logits, rows)
            for i, r in enumerate(rows):
                if r.params.presence_penalty == marker:
                    logits[i] = float("nan")
            return logits

    llm = LLM(model, block_size=4, num_blocks=60, async_scheduling=overlap)
    llm.engine.sampler = NaNs()
    outs = llm.generate(prompts + [[5, 6]], [greedy(8)] * len(prompts) + [
        greedy(8, presence_penalty=marker)], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[:-1]] == refs
    assert outs[-1].outputs[0].finish_reason == "error" and "not finite" in outs[-1].error
    assert outs[-1].outputs[0].token_ids == []


@pytest.mark.parametrize("overlap", [False, True])  # async scheduling
def test_a_stop_check_that_fails_ends_alone(overlap):
    """The tokenizer raises on one request's tokens (its stop strings need the text)."""
    model = long_model("llama_gqa")
    tok = make_tokenizer()
    prompts, refs = victims()
    attacker = [40, 41, 42]
    mine = stock_greedy(model, attacker, 8)
    trigger = next(t for t in mine if all(t not in r for r in refs))
    decode = tok.decode

    def flaky(ids, *a, **kw):
        if trigger in list(ids):
            raise ValueError("undecodable")
        return decode(ids, *a, **kw)

    tok.decode = flaky
    llm = LLM(model, tok, block_size=4, num_blocks=60, async_scheduling=overlap)
    outs = llm.generate(prompts + [attacker], [greedy(8, stop=["zzz"])] * (len(prompts) + 1),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[:-1]] == refs
    assert outs[-1].outputs[0].finish_reason == "error" and "undecodable" in outs[-1].error
    assert_clean(llm.engine)


def test_an_interrupted_call_leaves_nothing_queued():
    model = long_model("llama_gqa")
    prompts, refs = victims()
    llm = LLM(model, block_size=4, num_blocks=60)
    step, calls = llm.engine.step, []

    def interrupted():
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return step()

    llm.engine.step = interrupted
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, greedy(8), use_tqdm=False)
    llm.engine.step = step
    assert_clean(llm.engine)
    outs = llm.generate(prompts[:2], greedy(8), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == refs[:2]


def test_async_llm_survives_a_failing_request():
    import asyncio

    model = long_model("llama_gqa")
    prompts, refs = victims()
    poison = 77
    llm = hf_paged.AsyncLLM(model, block_size=4, num_blocks=60)

    async def one(prompt):
        last = None
        async for last in llm.generate(prompt, greedy(8)):
            pass
        return last

    async def main(batch):
        return await asyncio.wait_for(asyncio.gather(*(one(p) for p in batch)), 60)

    try:
        with Poisoned(model, lambda ids, pos: bool((ids == poison).any())):
            outs = asyncio.run(main(prompts + [[poison, 5]]))
        assert [o.outputs[0].token_ids for o in outs[:-1]] == refs
        assert outs[-1].outputs[0].finish_reason == "error" and outs[-1].error
        outs = asyncio.run(main(prompts))
        assert [o.outputs[0].token_ids for o in outs] == refs
    finally:
        llm.shutdown()


def test_a_stream_nobody_reads_is_aborted():
    import asyncio

    llm = hf_paged.AsyncLLM(long_model("llama_gqa"), block_size=4, num_blocks=400,
                            max_unread_outputs=5)

    async def main():
        stream = llm.add([3, 4, 5], SamplingParams(max_tokens=1000, ignore_eos=True))
        for _ in range(1000):  # not read until the request has ended
            if stream.unread and not llm.engine.requests:
                break
            await asyncio.sleep(0.02)
        outs = [out async for out in stream]
        return outs

    try:
        outs = asyncio.run(main())
    finally:
        llm.shutdown()
    assert len(outs) <= 6  # at most the buffer, then the last output
    last = outs[-1]
    assert last.finished and last.outputs[0].finish_reason == "abort"
    assert "did not read" in last.error
    assert len(last.outputs[0].token_ids) < 1000
    assert llm.stats().blocks_used == 0


def test_a_loop_held_up_a_moment_aborts_none_of_its_readers():
    """Outputs pile up past max_unread_outputs while the event loop is busy (here 0.5 s of
    synchronous work, as a large body once was): the readers are not at fault, and read
    their requests to the end."""
    import asyncio

    model = long_model("llama_gqa")
    llm = hf_paged.AsyncLLM(model, block_size=4, num_blocks=400, max_unread_outputs=3)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    prompts = [[3, 4, 5], [6, 7], [8, 9, 10, 11]]

    async def read(prompt):
        return [out async for out in llm.add(prompt, params)][-1]

    async def main():
        readers = [asyncio.ensure_future(read(p)) for p in prompts]
        await asyncio.sleep(0.05)
        time.sleep(0.5)  # the loop is held up; the engine steps on
        return await asyncio.gather(*readers)

    try:
        outs = asyncio.run(main())
    finally:
        llm.shutdown()
    assert [o.outputs[0].finish_reason for o in outs] == ["length"] * 3
    assert [o.outputs[0].token_ids for o in outs] == [stock_greedy(model, p, 60)
                                                      for p in prompts]


@pytest.mark.parametrize("kind", ["cumulative", "delta"])
def test_a_reader_slower_than_the_engine_gets_everything_in_a_bounded_buffer(kind):
    """A reader that keeps reading, more slowly than outputs come, is not aborted; past
    max_unread_outputs a new output stands for the unread one before it (a delta joins the
    next), so that its buffer stays bounded and it still gets every token."""
    import asyncio

    model = long_model("llama_gqa")
    llm = hf_paged.AsyncLLM(model, block_size=4, num_blocks=400, max_unread_outputs=2)
    params = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True, output_kind=kind)

    async def main():
        outs, most = [], 0
        async for out in (stream := llm.add([3, 4, 5], params)):
            outs.append(out)
            most = max(most, stream.unread)
            await asyncio.sleep(0.02)
        return outs, most

    try:
        outs, most = asyncio.run(main())
    finally:
        llm.shutdown()
    tokens = [t for out in outs for t in out.outputs[0].token_ids] if kind == "delta" \
        else outs[-1].outputs[0].token_ids
    assert outs[-1].outputs[0].finish_reason == "length" and most <= 3
    assert tokens == stock_greedy(model, [3, 4, 5], 80)


def test_llm_calls_from_two_threads_run_one_after_another():
    import threading

    model = long_model("llama_gqa")
    prompts, refs = victims()
    llm = LLM(model, block_size=4, num_blocks=200)
    results, errors = {}, []

    def call(k):
        try:
            results[k] = llm.generate(prompts[3 * k:3 * k + 3], greedy(8), use_tqdm=False)
        except Exception as err:  # noqa: BLE001
            errors.append(err)

    threads = [threading.Thread(target=call, args=(k,)) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    assert [o.outputs[0].token_ids for k in (0, 1) for o in results[k]] == refs
    assert_clean(llm.engine)


def _stream_test(body, **options):
    """Runs `body(llm)` (a coroutine function) on a fresh AsyncLLM, bounded in time."""
    import asyncio

    llm = hf_paged.AsyncLLM(long_model("llama_gqa"), block_size=4, num_blocks=200, **options)
    try:
        return asyncio.run(asyncio.wait_for(body(llm), 60))
    finally:
        llm.shutdown()


def test_an_aborted_stream_yields_its_last_output():
    async def body(llm):
        stream = llm.add([3, 4, 5], greedy(500))
        await stream.__anext__()
        stream.abort()
        return [out async for out in stream]

    outs = _stream_test(body)
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert not any(out.finished for out in outs[:-1])


def test_a_stale_stream_leaves_a_new_request_of_its_id_alone():
    """A stream whose request finished unread, closed after a new request took its id,
    sends no abort that would end the new one."""
    import asyncio

    async def body(llm):
        old = llm.add([3, 4, 5], greedy(2), request_id="x")
        while llm.engine.requests or old.unread < 2:  # finished, not read
            await asyncio.sleep(0.01)
        new = llm.add([6, 7], greedy(40), request_id="x")
        old.abort()  # as closing its iterator does
        return [out async for out in new][-1]

    last = _stream_test(body)
    assert last.outputs[0].finish_reason == "length"
    assert last.outputs[0].token_ids == stock_greedy(long_model("llama_gqa"), [6, 7], 40)


def test_a_request_submitted_as_the_engine_shuts_down_is_refused(monkeypatch):
    """A shutdown from another thread between `submit`'s start and its queueing: the
    request is refused, never left in an inbox nobody drains."""
    import threading

    from hf_paged.engine import async_llm
    from hf_paged.errors import EngineDeadError

    made = async_llm.RequestStream.__init__

    def shut_down_meanwhile(self, llm, *args):
        thread = threading.Thread(target=llm.shutdown)
        thread.start()
        thread.join(30)
        made(self, llm, *args)

    async def body(llm):
        monkeypatch.setattr(async_llm.RequestStream, "__init__", shut_down_meanwhile)
        with pytest.raises(EngineDeadError):
            llm.add([3, 4, 5], greedy(2))

    _stream_test(body)


class _Thrown(BaseException):
    """Not an Exception (as SystemExit, KeyboardInterrupt or CancelledError are not)."""


def test_a_call_that_raises_anything_or_outlives_its_loop_harms_no_request():
    """AsyncLLM.call(fn): an fn raising what is not an Exception, or a caller whose event
    loop closed before the answer (it stopped waiting), killed the stepping thread, and
    every request hung. The first reaches its caller, the second's answer is dropped, and a
    request running meanwhile ends with its solo tokens."""
    import asyncio
    import contextlib
    import threading

    prompt, = random_prompts(11, 1, 3, 25)
    solo = stock_greedy(long_model("llama_gqa"), prompt, 40)
    gate = threading.Event()

    def slow(engine):
        gate.wait(10)
        return 1

    def caller_that_gives_up(llm):  # another thread's loop, closed when it returns
        async def give_up():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(llm.call(slow), 0.01)
        asyncio.run(give_up())

    async def body(llm):
        victim = llm.add(prompt, greedy(40))
        await victim.__anext__()
        with pytest.raises(_Thrown):
            await llm.call(lambda engine: (_ for _ in ()).throw(_Thrown()))
        thread = threading.Thread(target=caller_that_gives_up, args=(llm,))
        thread.start()
        await asyncio.to_thread(thread.join, 30)
        gate.set()  # (the answer now goes to a closed loop)
        last = [out async for out in victim][-1]
        assert await llm.call(lambda engine: 7) == 7 and llm.is_running
        return last

    assert _stream_test(body).outputs[0].token_ids == solo


def test_a_stepping_thread_that_fails_ends_every_request_and_refuses_new_ones(monkeypatch):
    """A fault of the stepping loop itself (not of a step, which ends only its requests):
    the running requests end with "error" saying so, and later ones raise EngineDeadError
    rather than wait forever on a thread that is gone."""
    from hf_paged.errors import EngineDeadError

    async def body(llm):
        stream = llm.add([3, 4, 5], greedy(500))
        await stream.__anext__()
        monkeypatch.setattr(llm.engine, "has_unfinished_requests",
                            lambda: (_ for _ in ()).throw(RuntimeError("loop fault")))
        last = [out async for out in stream][-1]
        assert last.outputs[0].finish_reason == "error"
        assert "stepping thread failed: RuntimeError: loop fault" in last.error
        with pytest.raises(EngineDeadError):
            llm.add([3, 4, 5], greedy(2))

    _stream_test(body)


# -- deadlines ----------------------------------------------------------------------------------
@pytest.mark.parametrize("overlap", [False, True])  # async scheduling
def test_deadlines_end_queued_and_running_requests(overlap):
    model = long_model("llama_gqa")
    engine = LLMEngine(model, block_size=4, num_blocks=300, async_scheduling=overlap)
    engine.add_request("late", [3] * 20, SamplingParams(max_tokens=5, timeout=0.001))
    time.sleep(0.01)
    out = engine.step()
    assert [o.outputs[0].finish_reason for o in out] == ["timeout"]
    assert engine.stats().prompt_tokens == 0  # never prefilled
    engine.add_request("running", [3, 4], SamplingParams(max_tokens=1000, ignore_eos=True,
                                                          timeout=0.3))
    engine.add_request("victim", [5, 6], greedy(8))
    done = run_engine(engine, [], [])
    assert done["running"].outputs[0].finish_reason == "timeout"
    assert 0 < len(done["running"].outputs[0].token_ids) < 1000
    assert done["victim"].outputs[0].token_ids == stock_greedy(model, [5, 6], 8)
    assert_clean(engine)


def test_a_request_that_ends_early_is_let_go_before_its_deadline():
    import gc
    import weakref

    engine = LLMEngine(long_model("llama_gqa"), block_size=4, num_blocks=300)
    engine.add_request("r", [3, 4], greedy(2, timeout=3600))
    ended = weakref.ref(engine.requests["r"])
    run_engine(engine, [], [])
    gc.collect()
    assert ended() is None


# -- prefix-cache namespaces ----------------------------------------------------------------------
def test_block_keys_are_framed():
    assert block_key(None, [123, 197], namespace("m")) != \
        block_key(None, [23, 197], namespace("m1"))
    assert block_key(None, [1, 23], namespace(None, "a")) != \
        block_key(None, [12, 3], namespace(None, "a"))
    assert namespace(None, None) != namespace("", None) != namespace(None, "")
    assert namespace("a", "b") != namespace("ab", None) != namespace(None, "ab")


def test_cache_salts_never_share_blocks():
    model = long_model("llama_gqa")
    engine = LLMEngine(model, block_size=4, num_blocks=100)
    prompt = list(range(3, 43))
    runs = [("a", None), ("a", "tenant-1"), ("b", "tenant-2"), ("c", "tenant-1"),
            ("d", None)]
    for rid, salt in runs:
        engine.add_request(rid, prompt, greedy(4), cache_salt=salt)
        done = run_engine(engine, [], [])
        assert done[rid].outputs[0].token_ids == stock_greedy(model, prompt, 4)
        hit = done[rid].num_cached_tokens
        assert hit == (36 if rid in ("c", "d") else 0), rid
    with pytest.raises(InvalidRequestError, match="twice"):
        engine.add_request("x", prompt, greedy(4, cache_salt="p"), cache_salt="q")


def test_adapters_whose_names_run_into_their_tokens_never_share_blocks():
    """Adapters "m" and "m1": "m" + "12,..." once hashed like "m1" + "2,..."."""
    model = two_adapter_model("m", "m1")
    rest = list(range(20, 31))
    first, second = [2] + rest, [12] + rest  # "m1" + "2,20,..." == "m" + "12,20,..." as text
    model.set_adapter("m")
    ref = stock_greedy(model, second, 6)
    engine = LLMEngine(model, block_size=4, num_blocks=100)
    engine.add_request("m1", first, greedy(6), adapter="m1")
    run_engine(engine, [], [])
    engine.add_request("m", second, greedy(6), adapter="m")
    done = run_engine(engine, [], [])
    assert done["m"].num_cached_tokens == 0
    assert done["m"].outputs[0].token_ids == ref


# -- a random mix ---------------------------------------------------------------------------------
def test_random_mix_of_good_and_bad_requests():
    """300 requests, 10% bad (refused at admission, or failing in the forward or the
    sampler while running), arriving over time: every good one gets its solo tokens."""
    model = long_model("llama_gqa")
    rng = random.Random(5)
    poison, marker = 77, 0.321
    bad_kinds = [dict(stop_token_ids=[500], min_tokens=1), dict(seed=2**70),
                 dict(repetition_penalty=0.0), dict(top_p=2.0), "forward", "sampler"]

    class Flaky(Sampler):
        def warp(self, logits, rows):
            if any(r.params.min_p == marker for r in rows):
                raise RuntimeError("bad warp")
            return super().warp(logits, rows)

    engine = LLMEngine(model, block_size=4, num_blocks=48, max_num_seqs=8,
                       max_num_batched_tokens=48, preemption_mode="swap")
    engine.sampler = Flaky()
    good, bad, outs = {}, {}, {}
    pending = []
    for i in range(300):
        prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randint(4, 30))]
        prompt = [t if t != poison else 76 for t in prompt]  # 77 is poison at position 3 only
        if rng.random() < 0.1:
            kind = rng.choice(bad_kinds)
            if kind == "forward":
                pending.append((i, prompt[:3] + [poison], greedy(6)))
            elif kind == "sampler":
                pending.append((i, prompt, SamplingParams(temperature=0.7, min_p=marker,
                                                          max_tokens=6)))
            else:
                pending.append((i, prompt, kind))
            bad[str(i)] = kind
        else:
            seeded = rng.random() < 0.3
            params = SamplingParams(temperature=0.8, seed=i, max_tokens=rng.randint(1, 10),
                                    ignore_eos=True) if seeded else greedy(rng.randint(1, 10))
            pending.append((i, prompt, params))
            good[str(i)] = (prompt, params)
    refused = 0
    with Poisoned(model, lambda ids, pos: bool(((ids == poison) & (pos == 3)).any())):
        step = 0
        while pending or engine.has_unfinished_requests():
            for _ in range(rng.randint(0, 4)):
                if pending:
                    i, prompt, params = pending.pop(0)
                    if isinstance(params, dict):
                        with pytest.raises(InvalidRequestError):
                            engine.add_request(str(i), prompt, SamplingParams(max_tokens=4,
                                                                              **params))
                        refused += 1
                    else:
                        engine.add_request(str(i), prompt, params)
            for out in engine.step():
                if out.finished:
                    outs[out.request_id] = out
            step += 1
            assert step < 5000
    assert refused > 0
    assert all(outs[rid].outputs[0].finish_reason == "error" for rid, k in bad.items()
               if k in ("forward", "sampler"))
    solo = LLM(model, block_size=4, num_blocks=48)
    for rid, (prompt, params) in good.items():
        if params.seed is None:
            ref = stock_greedy(model, prompt, params.max_tokens)
        else:
            ref = solo.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        assert outs[rid].outputs[0].token_ids == ref, rid
        assert outs[rid].error is None
    assert_clean(engine)
