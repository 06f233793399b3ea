"""8-bit K/V blocks in the engine and in generate(): twice the blocks in the same bytes,
swaps and copy-on-write bit-exact (a preempted, swapped and forked run gives the tokens of
an unhindered one), greedy output of a trained model agreeing with full-precision KV, the
options and their errors."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_paged
from hf_paged import LLM, LLMEngine, SamplingParams
from hf_paged.kv.pool import KVPool
from conftest import VOCAB, left_padded_batch, make_model
from test_engine import long_model, random_prompts, run_engine

KINDS = ["int8", "fp8_e4m3", "fp8_e5m2"]


def head64(dtype=torch.bfloat16):
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=128,
                                        num_hidden_layers=2, num_attention_heads=2,
                                        num_key_value_heads=2)).to(dtype).eval()


@pytest.mark.parametrize("kind", KINDS)
def test_twice_the_blocks_in_the_same_bytes(kind):
    model = head64()
    budget = 4 * 2**20
    plain = LLMEngine(model, kv_cache_bytes=budget)
    small = LLMEngine(model, kv_cache_bytes=budget, kv_cache_dtype=kind)
    assert small.num_blocks >= 1.9 * plain.num_blocks
    assert small.pool.bytes_per_token == 2 * 2 * 2 * (64 + 2)  # layers x K,V x heads x bytes
    assert small.pool.nbytes <= budget



def test_generate_runs_twice_the_rows_in_the_same_bytes():
    """generate() with a pool of fixed bytes: 1.9x the blocks in int8, and a batch that
    fits there but not in bfloat16 runs; one row past the pool is a named error that leaves
    the pool whole for the next call."""
    model = head64()
    length, new = 60, 4  # 4 blocks of 16 per row

    def run(kind, rows):
        cache = hf_paged.PagedCache(model.config, {"kv_cache_dtype": kind,
                                                   "max_kv_bytes": 24 * 2**10 * 8})
        ids = torch.randint(3, VOCAB, (rows, length), generator=torch.Generator().manual_seed(1))
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                       min_new_tokens=new, do_sample=False, pad_token_id=0,
                       past_key_values=cache)
        return cache.memory_stats()

    plain = run("auto", 1).num_blocks  # 12 blocks of 16 KiB (int8: 23)
    small = run("int8", 1).num_blocks
    assert small >= 1.9 * plain
    with pytest.raises(hf_paged.KVCacheExhaustedError):
        run("auto", plain // 4 + 1)
    assert run("int8", small // 4).blocks_in_use == small // 4 * 4
    with pytest.raises(hf_paged.KVCacheExhaustedError):
        run("int8", small // 4 + 1)
    assert run("int8", 2).blocks_in_use == 8  # the pool, shared per model, is whole again

def test_pool_copies_are_bit_exact():
    pool = KVPool(2, 2, 16, 4, 6, torch.float32, torch.device("cpu"), growable=True,
                  kv_dtype=torch.float8_e4m3fn)
    pool.shards[0].copy_(torch.randint(0, 256, pool.shards[0].shape, dtype=torch.uint8))
    host = KVPool(2, 2, 16, 4, 6, torch.float32, torch.device("cpu"), growable=False,
                  kv_dtype=torch.float8_e4m3fn)
    pool.copy_to(host, [1, 4], [0, 5])  # a swap out
    assert torch.equal(host.shards[0][:, :, 5], pool.shards[0][:, :, 4])
    from hf_paged.kernels import reference
    reference.copy_blocks(pool.shards[0], torch.tensor([1]), torch.tensor([3]))  # copy-on-write
    assert torch.equal(pool.shards[0][:, :, 3], pool.shards[0][:, :, 1])
    before = pool.shards[0].clone()
    pool.ensure_free(10)  # growth keeps every byte
    assert torch.equal(pool.shards[0][:, :, :6], before)
    k, v = pool.layer_views(1)
    assert k.dtype == torch.float8_e4m3fn and k.shape == (pool.blocks.num_blocks, 4, 2, 18)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("model_kind", ["llama_gqa", "mistral_sw", "falcon_alibi"])
def test_swaps_and_forks_keep_every_byte(kind, model_kind):
    """Preempted by swap and forked (n > 1, copy-on-write) under a tight pool, every
    sequence gets the tokens of the same 8-bit engine with room for all."""
    model = long_model(model_kind)
    prompts = random_prompts(3, 8, 5, 50)
    params = SamplingParams(n=2, temperature=0.8, seed=5, max_tokens=14, ignore_eos=True)
    roomy = LLMEngine(model, block_size=4, num_blocks=400, max_num_seqs=16,
                      kv_cache_dtype=kind)
    tight = LLMEngine(model, block_size=4, num_blocks=40 if model_kind != "mistral_sw" else 20,
                      max_num_seqs=6, max_num_batched_tokens=24, preemption_mode="swap",
                      admission_headroom=0, kv_cache_dtype=kind)
    a, b = run_engine(roomy, prompts, params), run_engine(tight, prompts, params)
    assert tight.stats().num_preemptions > 0
    for i in map(str, range(len(prompts))):
        assert [c.token_ids for c in a[i].outputs] == [c.token_ids for c in b[i].outputs]


def copy_model():
    """A one-layer Llama trained in a few seconds to repeat a 12-token span (its logits
    mean something: greedy output is not decided by near-ties)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=48, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=2, max_position_embeddings=256))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    with torch.enable_grad():
        for _ in range(120):
            span = torch.randint(4, 48, (32, 12), generator=g)
            ids = torch.cat([span, torch.full((32, 1), 3)], 1).repeat(1, 3)
            labels = ids.clone()
            labels[:, :13] = -100
            loss = model(input_ids=ids, labels=labels).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
    return model.eval().to(torch.bfloat16)


def test_trained_model_agrees_with_bfloat16_kv():
    model = copy_model()
    rng = random.Random(0)
    prompts = [[rng.randrange(4, 48) for _ in range(12)] + [3] for _ in range(12)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    base = [o.outputs[0].token_ids for o in LLM(model, num_blocks=256).generate(
        prompts, params, use_tqdm=False)]
    ids = torch.tensor(prompts)
    for kind in KINDS:
        outs = LLM(model, num_blocks=256, kv_cache_dtype=kind).generate(prompts, params,
                                                                        use_tqdm=False)
        agree = sum(sum(x == y for x, y in zip(o.outputs[0].token_ids, r))
                    for o, r in zip(outs, base))
        assert agree >= 0.95 * 32 * len(prompts), (kind, agree)
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32,
                             do_sample=False, pad_token_id=0, eos_token_id=None,
                             cache_implementation="paged",
                             cache_config={"kv_cache_dtype": kind})[:, 13:].tolist()
        agree = sum(sum(x == y for x, y in zip(t, r)) for t, r in zip(gen, base))
        assert agree >= 0.95 * 32 * len(prompts), (kind, "generate", agree)


def test_generate_reports_bytes_in_the_stored_dtype_and_runs_beams():
    model = make_model("llama_gqa")
    ids, mask = left_padded_batch([5, 9, 12], seed=2)
    cache = hf_paged.PagedCache(model.config, {"kv_cache_dtype": "int8"})
    model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                   past_key_values=cache, pad_token_id=0)
    stats = cache.memory_stats()
    heads, dim = model.config.num_key_value_heads, model.config.head_dim
    assert stats.bytes_per_token == model.config.num_hidden_layers * 2 * heads * (dim + 2)
    beams = model.generate(ids, attention_mask=mask, max_new_tokens=6, num_beams=3,
                           num_return_sequences=2, do_sample=False, pad_token_id=0,
                           cache_implementation="paged",
                           cache_config={"kv_cache_dtype": "fp8_e4m3"})
    assert beams.shape == (6, 18)


def test_options_and_errors():
    model = make_model("llama_gqa")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLMEngine(model, num_blocks=16, kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        model.generate(torch.tensor([[3, 4]]), max_new_tokens=2, cache_implementation="paged",
                       cache_config={"kv_cache_dtype": "fp16"})
    from hf_paged.serving.serve import engine_options, parser
    assert engine_options(parser().parse_args(["m", "--kv-cache-dtype", "fp8"]))[
        "kv_cache_dtype"] == "fp8"


def test_a_backend_that_cannot_read_8bit_blocks_is_refused_by_name(monkeypatch):
    from hf_paged.kernels import dispatch
    from hf_paged.kernels.base import Capabilities
    from hf_paged.kernels.torch_backend import TorchBackend

    class Plain(TorchBackend):  # a backend of full-precision pools only (as CUDA C++'s)
        name, capabilities = "cuda", Capabilities(devices=("cpu",))

    monkeypatch.setattr(dispatch, "select_backend", lambda *a, **k: Plain())
    with pytest.raises(ValueError, match="does not read 8-bit K/V blocks"):
        LLMEngine(make_model("llama_gqa"), num_blocks=16, kv_cache_dtype="int8", backend="cuda")


@pytest.mark.parametrize("kind", ["int8", "fp8_e4m3"])
def test_steps_mixing_decodes_and_prompt_chunks_run_in_one_forward(kind):
    """A packed forward of decode rows and prompt chunks attends per part into a buffer of
    the values' size (not the stored one, which ends with the scale): no forward fails
    (the engine would re-run a failed one on halves, hiding it)."""
    from hf_paged.engine.runner import ModelRunner

    model = make_model("llama_gqa")
    engine = LLMEngine(model, block_size=4, num_blocks=64, max_num_seqs=4,
                       max_num_batched_tokens=8, kv_cache_dtype=kind)
    failures, mixed = [], []
    forward = engine.runner.forward

    def spy(f, check=None):
        if 1 in f.counts and max(f.counts) > 1:
            mixed.append(f.counts)
        try:
            return forward(f, check)
        except Exception as err:  # noqa: BLE001
            failures.append(err)
            raise

    engine.runner.forward = spy
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine.add_request("a", list(range(3, 9)), params)
    engine.step()
    engine.add_request("b", list(range(5, 25)), params)
    while engine.has_unfinished_requests():
        engine.step()
    assert mixed and not failures, failures[:1]
