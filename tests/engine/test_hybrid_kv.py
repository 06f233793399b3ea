"""KV groups of hybrid models (sliding-window layers next to full ones) in the engine and in
generate(): sliding groups give their blocks back as the window passes while full groups
keep theirs, with stock's tokens through chunked prefill, both preemption modes, prefix
hits and copy-on-write forks."""

from __future__ import annotations

import pytest
import torch

import hf_paged
from hf_paged import SamplingParams
from hf_paged.core.kv_groups import KVGroups
from conftest import VOCAB
from zoo import WINDOW, make_arch

GEMMA3_FULL = ["full_attention"] * 6


@pytest.fixture(scope="module")
def gemma3():
    return make_arch("gemma3")  # 6 layers, 5 sliding : 1 full


def stock_greedy(model, prompt, max_tokens):
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                         do_sample=False, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def prompts(count, seed=0, shared=12):
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(3, VOCAB, (shared,), generator=g).tolist()
    return [(head if i % 2 else []) + torch.randint(3, VOCAB, (10 + 4 * i,), generator=g).tolist()
            for i in range(count)]


def test_groups_plan():
    groups = KVGroups.plan([6, 6, 6, 6, 6, None])
    assert groups.slots == 1 and groups.num_groups == 6
    assert groups.windows == (None, 6, 6, 6, 6, 6) and groups.layers[0] == (5,)
    alternate = KVGroups.plan([4, None] * 3)
    assert alternate.slots == 3 and alternate.layers == ((1, 3, 5), (0, 2, 4))
    uneven = KVGroups.plan([None, 8, 8, 8, 8])  # the last sliding group has room to spare
    assert uneven.slots == 1 and uneven.num_groups == 5
    assert KVGroups.plan([8, 8]).num_groups == 1 and KVGroups.plan([None] * 3).slots == 3
    assert KVGroups.plan([4, None], hybrid=False).windows == (None,)
    # a sequence of 100 tokens computed 8 at a time: 25 blocks of 4 for the full group,
    # ceil((6 + 8) / 4) + 1 = 5 for each sliding one
    assert groups.blocks_for(100, 4, chunk=8) == 25 + 5 * 5
    # 10 tokens never slide past a window of 6 plus a chunk of 8: every group holds all of
    # them, from the first block (3 blocks of 4), and no more
    assert groups.blocks_for(10, 4, chunk=8) == 3 * 6


def test_a_request_that_never_slides_fits_a_pool_of_exactly_its_blocks(gemma3):
    """18 tokens in blocks of 16: two blocks in each of the 6 groups. Sliding groups were
    counted a block more (as if their window had slid), so a pool of 12 rejected it."""
    prompt = prompts(1, seed=5, shared=0)[0][:13]
    llm = hf_paged.LLM(gemma3, block_size=16, num_blocks=2)
    assert llm.stats().num_blocks == 12
    out = llm.generate([prompt], SamplingParams(max_tokens=5, temperature=0.0,
                                                ignore_eos=True))[0]
    assert out.outputs[0].token_ids == stock_greedy(gemma3, prompt, 5)
    assert llm.stats().blocks_used == 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_engine_preempts_hybrid_sequences_and_keeps_stock_tokens(gemma3, mode):
    batch = prompts(6)
    llm = hf_paged.LLM(gemma3, block_size=4, num_blocks=12, max_num_seqs=6,
                       max_num_batched_tokens=16, preemption_mode=mode,
                       admission_headroom=0)  # admit eagerly: preempt often
    assert llm.engine.runner.groups.num_groups == 6
    outs = llm.generate(batch, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    assert llm.stats().num_preemptions > 0
    for prompt, out in zip(batch, outs):
        assert out.outputs[0].token_ids == stock_greedy(gemma3, prompt, 24)
    assert llm.stats().blocks_used == 0  # every group's blocks came back


def test_engine_prefix_hits_cover_every_group(gemma3):
    llm = hf_paged.LLM(gemma3, block_size=4, num_blocks=64, max_num_seqs=4)
    prompt = prompts(2, seed=3)[1]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    first = llm.generate([prompt], params)[0].outputs[0].token_ids
    again = llm.generate([prompt], params)[0]
    assert again.num_cached_tokens > 0
    assert again.outputs[0].token_ids == first == stock_greedy(gemma3, prompt, 10)


@pytest.mark.parametrize("max_tokens", [1, 3])
def test_a_prefix_hit_too_big_to_hold_beside_its_chunk_runs_anew(max_tokens):
    """A hit is held whole in every group, sliding ones too: in a pool that holds the
    cached prompt beside the new chunk only once the window has released blocks, the
    extended prompt ran nowhere and the engine raised. With nothing running it now runs
    without the hit."""
    first = [25, 47, 6, 20, 51, 63, 69, 81, 20, 27, 63, 79, 52, 27, 10, 77, 70, 28, 46, 23, 48,
             24, 44, 48, 75]
    longer = first + [67, 59, 44, 47, 28, 10, 5, 44, 37, 45, 66, 80, 33, 17, 91, 67]
    model = make_arch("exaone4")  # 3 sliding layers : 1 full, 4 groups
    llm = hf_paged.LLM(model, block_size=5, num_blocks=8, max_num_batched_tokens=18)
    assert llm.stats().num_blocks == 32  # (num_blocks per group)
    assert -(-len(longer) // 5) * llm.engine.runner.groups.num_groups > 32  # (no window)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate([first, longer], params)
    assert [o.outputs[0].token_ids for o in outs] == \
        [stock_greedy(model, p, max_tokens) for p in (first, longer)]
    assert llm.stats().blocks_used == 0


def test_engine_forks_share_every_group(gemma3):
    """n > 1 forks the prompt's blocks copy-on-write in each group; greedy siblings agree."""
    llm = hf_paged.LLM(gemma3, block_size=4, num_blocks=64, max_num_seqs=4)
    prompt = prompts(1, seed=4)[0]
    out = llm.generate([prompt], SamplingParams(n=3, max_tokens=12, temperature=0.0,
                                                ignore_eos=True))[0]
    ref = stock_greedy(gemma3, prompt, 12)
    assert [c.token_ids for c in out.outputs] == [ref] * 3


def _peak_bytes(model, prompt, max_tokens):
    """Most KV bytes the engine held while generating (sampled after every step), and its
    tokens."""
    engine = hf_paged.LLMEngine(model, block_size=4, num_blocks=512, max_num_seqs=1,
                                max_num_batched_tokens=32)
    engine.add_request("r", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                   ignore_eos=True))
    outputs, held = [], []
    while engine.has_unfinished_requests():
        outputs += engine.step()
        held.append(engine.stats().blocks_used)
    bytes_per_block = engine.pool.nbytes // engine.pool.blocks.num_blocks
    return max(held) * bytes_per_block, outputs[-1].outputs[0].token_ids


def test_sliding_groups_hold_a_window_of_blocks(gemma3):
    prompt = prompts(1, seed=5, shared=0)[0] * 6  # 60 tokens, then 40 generated
    hybrid, tokens = _peak_bytes(gemma3, prompt, 40)
    full_model = make_arch("gemma3", layer_types=GEMMA3_FULL)
    full, _ = _peak_bytes(full_model, prompt, 40)
    assert tokens == stock_greedy(gemma3, prompt, 40)
    # 100 tokens: the full layer keeps 25 blocks, each sliding layer about its window
    assert hybrid < 0.45 * full, (hybrid, full)


def test_generate_memory_stats_count_what_the_groups_hold(gemma3):
    ids = torch.tensor([prompts(1, seed=6, shared=0)[0] * 8])  # 80 tokens
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=30, do_sample=False)
    ref = gemma3.generate(ids, **kwargs)
    out = gemma3.generate(ids, **kwargs, cache_implementation="paged",
                          return_dict_in_generate=True, cache_config={"block_size": 4})
    assert torch.equal(ref, out.sequences)
    stats = out.past_key_values.memory_stats()
    full_group, *sliding = stats.groups
    assert full_group.window is None and full_group.blocks_in_use == -(-109 // 4)
    assert all(g.window == WINDOW and g.blocks_in_use <= 3 for g in sliding)
    # in blocks of all six layers: the full layer's 28 blocks and 5 x <= 3 sliding ones
    assert stats.blocks_in_use <= -(-(28 + 15) // 6) < -(-109 // 4)
    assert stats.kv_bytes_in_use == stats.blocks_in_use * 4 * stats.bytes_per_token


def test_shortage_is_told_in_blocks_of_every_layer(gemma3):
    """num_blocks counts blocks of all layers; a hybrid pool holds blocks of one group's
    layers (six groups here). The errors said 72 of a pool of num_blocks=12, and a request
    refused by a pool of 3 'needed 60 of 18'."""
    ids = torch.randint(3, VOCAB, (2, 40), generator=torch.Generator().manual_seed(0))
    with pytest.raises(hf_paged.KVCacheExhaustedError) as err:
        gemma3.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4,
                        do_sample=False, cache_implementation="paged",
                        cache_config={"num_blocks": 12, "block_size": 4})
    # every group stores the 40-token prompts: 2 rows x 10 blocks of every layer
    assert (err.value.needed, err.value.free, err.value.num_blocks) == (20, 12, 12)
    assert "needs 20 free block(s) of 4 tokens but only 12 of the pool's 12" in str(err.value)
    llm = hf_paged.LLM(gemma3, block_size=4, num_blocks=3)
    out = llm.generate([[5] * 30], SamplingParams(max_tokens=10, temperature=0.0))[0]
    # the full group holds 10 blocks of 40 tokens, each sliding one fewer: 10 of all layers
    assert out.outputs[0].finish_reason == "error"
    assert "needs 10 KV blocks of 4 tokens, but the whole pool has 3;" in out.error


def test_uneven_groups_keep_the_num_blocks_asked_for():
    """Ten layers, 4 full and 6 sliding: groups of 4, 4 and 2 layers in blocks of 4 layers.
    The pool's blocks were num_blocks * 10 // 4 rounded down, which reads back as one block
    fewer than asked (6 of 7)."""
    full, sliding = "full_attention", "sliding_attention"
    model = make_arch("gemma3", num_hidden_layers=10,
                      layer_types=[full, sliding, sliding] * 3 + [full])
    llm = hf_paged.LLM(model, block_size=4, num_blocks=7)
    assert llm.engine.runner.groups.slots == 4 and llm.engine.runner.groups.num_groups == 3
    out = llm.generate([[5] * 40], SamplingParams(max_tokens=10, temperature=0.0))[0]
    assert out.error.endswith("but the whole pool has 7; raise the KV budget or lower "
                              "max_tokens.")
    cache = hf_paged.PagedCache(model.config, {"num_blocks": 7, "block_size": 4})
    ids = torch.randint(3, VOCAB, (1, 5), generator=torch.Generator().manual_seed(0))
    model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                   max_new_tokens=2, do_sample=False)
    assert cache.memory_stats().num_blocks == 7
