"""One sized pool shared by the caches of concurrent generate calls; models that ran with a
pool stay picklable and copyable."""

from __future__ import annotations

import copy
import gc
import io
import pickle
import threading

import pytest
import torch

from hf_paged import KVCacheExhaustedError, PagedCache
from hf_paged.kv_pool import kept_pool
from conftest import assert_continues, assert_same, left_padded_batch, make_model

SIZED = {"num_blocks": 400, "block_size": 4}

# (model, lengths, generate options): greedy, beams, parallel outputs, a sliding window.
JOBS = [
    ("llama", [5, 17, 9], dict(max_new_tokens=12)),
    ("llama", [11, 3], dict(max_new_tokens=10, num_beams=3)),
    ("llama", [8], dict(max_new_tokens=9, num_beams=4, num_return_sequences=2)),
    ("llama", [14, 6], dict(max_new_tokens=8, num_return_sequences=3, num_beams=3)),
    ("mistral", [20, 4], dict(max_new_tokens=14)),
    ("mistral", [9, 13], dict(max_new_tokens=10, num_beams=2)),
    ("llama", [30], dict(max_new_tokens=15)),
    ("mistral", [25, 2, 7], dict(max_new_tokens=12)),
]


@pytest.fixture(scope="module")
def models():
    return {"llama": make_model("llama_gqa"), "mistral": make_model("mistral_sw")}


def run(models, job, seed, **extra):
    name, lengths, options = job
    ids, mask = left_padded_batch(lengths, seed=seed)
    return models[name].generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                 **options, **extra)


def in_threads(fn, count: int):
    """Runs fn(i) in `count` threads that start together; returns results or exceptions."""
    barrier = threading.Barrier(count)
    results: list = [None] * count

    def body(i):
        barrier.wait()
        try:
            results[i] = fn(i)
        except Exception as err:  # noqa: BLE001 (reported by the test)
            results[i] = err

    threads = [threading.Thread(target=body, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not any(t.is_alive() for t in threads)
    return results


def pools(models):
    return [kept_pool(m, _config(), *_layout(m), m.dtype, m.device) for m in models.values()]


def _config():
    from hf_paged import PagedCacheConfig

    return PagedCacheConfig.from_any(SIZED)


def _layout(model):
    from hf_paged.models import kv_layout

    return kv_layout(model.config)


def test_concurrent_calls_share_one_pool(models):
    expected = [run(models, job, seed=i) for i, job in enumerate(JOBS)]
    for _ in range(2):
        got = in_threads(lambda i: run(models, JOBS[i], seed=i, cache_implementation="paged",
                                       cache_config=SIZED), len(JOBS))
        for ref, out in zip(expected, got):
            assert not isinstance(out, Exception), repr(out)
            assert_same(ref, out)
    for pool in pools(models):
        assert pool.blocks.num_used == 0  # every call's blocks came back


def test_a_call_that_cannot_get_blocks_fails_alone(models):
    """One call's prompts alone need more than the whole pool: it raises before taking a block
    (whatever the others hold at that moment), and the others finish unchanged."""
    greedy = [JOBS[0], JOBS[1], JOBS[4], JOBS[5]]
    expected = [run(models, job, seed=i) for i, job in enumerate(greedy)]
    huge = ("llama", [210] * 8, dict(max_new_tokens=40))  # 8 x 53 > 400 blocks of 4

    def call(i):
        if i == len(greedy):
            return run(models, huge, seed=99, cache_implementation="paged", cache_config=SIZED)
        return run(models, greedy[i], seed=i, cache_implementation="paged", cache_config=SIZED)

    got = in_threads(call, len(greedy) + 1)
    assert isinstance(got[-1], KVCacheExhaustedError)
    assert got[-1].num_blocks == 400 and got[-1].needed > got[-1].free
    for ref, out in zip(expected, got):
        assert_same(ref, out)
    for pool in pools(models):
        assert pool.blocks.num_used == 0


def test_returned_caches_hold_their_blocks_until_dropped(models):
    llama = models["llama"]
    outs = [run(models, JOBS[0], seed=i, cache_implementation="paged", cache_config=SIZED,
                return_dict_in_generate=True) for i in range(2)]
    caches = [o.past_key_values for o in outs]
    pool = caches[0].pool
    assert caches[1].pool is pool
    held = [c.memory_stats().blocks_in_use for c in caches]
    assert pool.blocks.num_used == sum(held)
    # Each cache continues on its own blocks (as in a second turn).
    _, mask = left_padded_batch(JOBS[0][1], seed=0)
    assert_continues(llama, outs[0], mask, caches[0])
    assert caches[1].memory_stats().blocks_in_use == held[1]  # untouched
    caches[1].reset()
    assert pool.blocks.num_used == caches[0].memory_stats().blocks_in_use
    del outs, caches
    assert pool.blocks.num_used == 0


def test_exhaustion_names_the_blocks_other_caches_hold(models):
    small = {"num_blocks": 24, "block_size": 4}
    kept = run(models, JOBS[0], seed=0, cache_implementation="paged", cache_config=small,
               return_dict_in_generate=True).past_key_values
    with pytest.raises(KVCacheExhaustedError, match="other live caches") as err:
        run(models, JOBS[0], seed=1, cache_implementation="paged", cache_config=small)
    assert err.value.held is not None
    del kept
    run(models, JOBS[0], seed=1, cache_implementation="paged", cache_config=small)


def test_cache_in_a_reference_cycle_is_collected_when_blocks_run_short(models):
    small = {"num_blocks": 24, "block_size": 4}
    out = run(models, JOBS[0], seed=0, cache_implementation="paged", cache_config=small,
              return_dict_in_generate=True)
    cycle = [out.past_key_values]
    cycle.append(cycle)  # only the garbage collector can free it
    gc.disable()
    try:
        del out, cycle
        run(models, JOBS[0], seed=1, cache_implementation="paged", cache_config=small)
    finally:
        gc.enable()


@pytest.mark.parametrize("dump", ["pickle", "torch.save"])
def test_model_that_ran_with_a_sized_pool_pickles(dump):
    model = make_model("llama_gqa")
    ids, mask = left_padded_batch([5, 9], seed=1)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    ref = model.generate(**kwargs)
    model.generate(**kwargs, cache_implementation="paged", cache_config=SIZED)
    if dump == "pickle":
        clone = pickle.loads(pickle.dumps(model))
    else:
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        clone = torch.load(buffer, weights_only=False)
    assert_same(ref, clone.generate(**kwargs, cache_implementation="paged", cache_config=SIZED))


def test_deepcopy_gets_a_pool_of_its_own():
    model = make_model("llama_gqa")
    ids, mask = left_padded_batch([5, 9], seed=1)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    live = model.generate(**kwargs, cache_implementation="paged", cache_config=SIZED,
                          return_dict_in_generate=True)
    clone = copy.deepcopy(model)
    other = clone.generate(**kwargs, cache_implementation="paged", cache_config=SIZED,
                           return_dict_in_generate=True)
    assert other.past_key_values.pool is not live.past_key_values.pool
    # The original's cache still continues correctly.
    assert_continues(model, live, mask, live.past_key_values)


def test_pool_and_cache_objects_pickle():
    """A returned cache (e.g. inside a saved generate output) can be pickled too."""
    model = make_model("llama_gqa")
    ids, mask = left_padded_batch([5, 9], seed=1)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4,
                         cache_implementation="paged", cache_config=SIZED,
                         return_dict_in_generate=True)
    cache = pickle.loads(pickle.dumps(out.past_key_values))
    assert isinstance(cache, PagedCache)
    assert cache.memory_stats().tokens_stored == out.past_key_values.memory_stats().tokens_stored


@pytest.mark.parametrize("copied", ["deepcopy", "pickle"])
@pytest.mark.parametrize("config", [SIZED, None])
def test_a_copied_cache_continues_as_the_original(copied, config):
    """Transformers' prompt-cache reuse (`copy.deepcopy(prompt_cache)` for each follow-up):
    a copy, deep or pickled, continues with stock tokens, and so does the original."""
    model = make_model("llama_gqa")
    ids, mask = left_padded_batch([5, 9], seed=1)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4,
                         cache_implementation="paged", cache_config=config,
                         return_dict_in_generate=True)
    cache = out.past_key_values
    copies = [copy.deepcopy(cache) if copied == "deepcopy" else pickle.loads(pickle.dumps(cache))
              for _ in range(2)]
    for each in copies + [cache]:
        assert_continues(model, out, mask, each)
