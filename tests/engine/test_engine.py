"""The continuous-batching engine against stock `generate` of each prompt alone
(DynamicCache, float32, CPU), token for token, whatever else shares the batch. Every
engine here runs with the isolation checks of debug mode on (conftest sets HF_PAGED_DEBUG)."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import LlamaForCausalLM

import hf_paged
from hf_paged import LLM, LLMEngine, RequestRejectedError, SamplingParams
from conftest import VOCAB, make_model, make_tokenizer

KINDS = ["llama_gqa", "mistral_sw", "falcon_mq", "falcon_new", "falcon_alibi"]
_models: dict = {}


def long_model(kind: str):
    """The test models with room for 1000-token prompts (Mistral's window stays short)."""
    if kind not in _models:
        _models[kind] = make_model(kind, sliding_window=24, max_position_embeddings=1400)
    return _models[kind]


def stock_greedy(model, prompt, max_tokens, eos=None):
    """Stock generate of one prompt alone: its new tokens (EOS included, as the engine)."""
    # On the model's device (an offloaded model reports "meta": its hooks move the ids).
    ids = torch.tensor([prompt], device="cpu" if model.device.type == "meta" else model.device)
    out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False, eos_token_id=eos,
                         pad_token_id=0, attention_mask=torch.ones_like(ids))
    return out[0, len(prompt):].tolist()


def random_prompts(seed, count, lo, hi, shared=None):
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        own = [rng.randrange(3, VOCAB) for _ in range(rng.randint(lo, hi))]
        prompts.append((shared or []) + own if shared and rng.random() < 0.5 else own)
    return prompts


def run_engine(engine, prompts, params, arrivals=None, aborts=()):
    """Adds requests (some after a number of steps), aborts others; returns outputs by id."""
    arrivals = arrivals or [0] * len(prompts)
    done, step = {}, 0
    pending = sorted(range(len(prompts)), key=lambda i: arrivals[i])
    while pending or engine.has_unfinished_requests():
        while pending and arrivals[pending[0]] <= step:
            i = pending.pop(0)
            engine.add_request(str(i), prompts[i], params[i] if isinstance(params, list) else params)
        for i, at in aborts:
            if at == step:
                engine.abort(str(i))
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        step += 1
        assert step < 20_000
    return done


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_equals_stock_alone_under_chunking_preemption_and_prefix_hits(kind, mode):
    model = long_model(kind)
    system = [random.Random(7).randrange(3, VOCAB) for _ in range(40)]
    prompts = random_prompts(1, 14, 1, 90, shared=system) + [[5] * 1000]
    max_tokens = [6 + (i * 3) % 11 for i in range(len(prompts))]
    refs = [stock_greedy(model, p, m) for p, m in zip(prompts, max_tokens)]
    # Too few blocks for all at once (Mistral's window of 24 frees blocks as it goes).
    windowed = kind == "mistral_sw"
    engine = LLMEngine(model, block_size=4, num_blocks=16 if windowed else 300, max_num_seqs=6,
                       max_num_batched_tokens=16 if windowed else 48, preemption_mode=mode,
                       admission_headroom=0)  # admit eagerly: preempt often
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    arrivals = [(i * 5) % 23 for i in range(len(prompts))]
    done = run_engine(engine, prompts, params, arrivals, aborts=[(3, arrivals[3] + 3)])
    for i, ref in enumerate(refs):
        out = done[str(i)].outputs[0]
        if i == 3:
            assert out.finish_reason == "abort"
            assert out.token_ids == ref[:len(out.token_ids)]
            continue
        assert out.token_ids == ref, f"request {i}"
        assert out.finish_reason == "length"
    stats = engine.stats()
    assert stats.num_preemptions > 0, "the pool should have been too small for all at once"
    assert stats.recomputed_tokens > 0 or mode == "swap"
    assert stats.prefix_cache_hit_tokens > 0 or windowed  # (its small pool evicts them)
    assert stats.running == stats.waiting == stats.swapped == 0
    assert stats.blocks_used == 0  # everything given back (cached blocks aside)


def test_admission_headroom_keeps_tokens_and_saves_recomputation():
    """The same tight pool with and without headroom at admission: the same tokens as
    stock, fewer preemptions and fewer tokens computed twice with it."""
    model = long_model("llama_gqa")
    prompts = random_prompts(11, 12, 8, 40)
    max_tokens = [12 + (i * 7) % 17 for i in range(len(prompts))]
    refs = [stock_greedy(model, p, m) for p, m in zip(prompts, max_tokens)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    stats = {}
    for headroom in (0, 1.0):
        engine = LLMEngine(model, block_size=4, num_blocks=60, max_num_seqs=8,
                           max_num_batched_tokens=64, admission_headroom=headroom)
        done = run_engine(engine, prompts, params)
        assert [done[str(i)].outputs[0].token_ids for i in range(len(prompts))] == refs
        stats[headroom] = engine.stats()
    assert stats[0].num_preemptions > stats[1.0].num_preemptions
    assert stats[0].recomputed_tokens > stats[1.0].recomputed_tokens
    with pytest.raises(ValueError, match="admission_headroom"):
        LLMEngine(model, num_blocks=60, admission_headroom=-1)


def test_a_small_token_budget_bounds_the_default_number_of_running_sequences():
    """Only max_num_batched_tokens set, below the default max_num_seqs: as many sequences
    run as a step's tokens can decode, rather than an error about an option never given."""
    model = long_model("llama_gqa")
    prompts = random_prompts(5, 12, 3, 20)
    refs = [stock_greedy(model, p, 6) for p in prompts]
    llm = LLM(model, block_size=4, num_blocks=200, max_num_batched_tokens=5)
    assert llm.engine.max_num_seqs == 5
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == refs
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(5\) must be at least "
                                         r"max_num_seqs \(8\)"):
        LLMEngine(model, num_blocks=60, max_num_seqs=8, max_num_batched_tokens=5)
    for name in ("max_num_seqs", "max_model_len", "max_num_batched_tokens"):  # not "unset"
        with pytest.raises(ValueError, match=f"{name} must be a positive integer; got 0"):
            LLMEngine(model, num_blocks=60, **{name: 0})


@pytest.mark.parametrize("kind", ["llama_gqa", "falcon_new"])
def test_eos_at_different_steps(kind):
    model = long_model(kind)
    prompts = random_prompts(2, 8, 3, 30)
    # An EOS the model does emit: some rows stop early, at different steps.
    firsts = [stock_greedy(model, p, 12) for p in prompts]
    eos = random.Random(0).choice([t for f in firsts for t in f[3:]])
    refs = [stock_greedy(model, p, 12, eos=eos) for p in prompts]
    engine = LLMEngine(model, block_size=8, num_blocks=64, max_num_seqs=4)
    engine.eos_ids = {eos}
    done = run_engine(engine, prompts, SamplingParams(temperature=0, max_tokens=12))
    lengths = set()
    for i, ref in enumerate(refs):
        out = done[str(i)].outputs[0]
        assert out.token_ids == ref
        assert out.finish_reason == ("stop" if ref[-1] == eos else "length")
        lengths.add(len(ref))
    assert len(lengths) > 1


def test_seeded_sampling_is_the_same_alone_and_in_a_crowd():
    model = long_model("llama_gqa")
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=1234, max_tokens=15)
    alone = LLM(model, block_size=4, num_blocks=100).generate([[7, 8, 9, 10]], params,
                                                               use_tqdm=False)
    crowd_prompts = [[7, 8, 9, 10]] + random_prompts(3, 11, 1, 40)
    crowd_params = [params] + [SamplingParams(temperature=1.0, max_tokens=20)] * 11
    crowd = LLM(model, block_size=4, num_blocks=100, max_num_seqs=5,
                max_num_batched_tokens=24).generate(crowd_prompts, crowd_params, use_tqdm=False)
    assert alone[0].outputs[0].token_ids == crowd[0].outputs[0].token_ids
    again = LLM(model, block_size=16, num_blocks=30).generate([[7, 8, 9, 10]], params,
                                                               use_tqdm=False)
    assert again[0].outputs[0].token_ids == alone[0].outputs[0].token_ids


def test_oversized_request_is_rejected_alone():
    model = long_model("llama_gqa")
    llm = LLM(model, block_size=4, num_blocks=40, max_num_seqs=4)
    prompts = random_prompts(4, 20, 1, 30)
    refs = [stock_greedy(model, p, 5) for p in prompts]
    outs = llm.generate(prompts[:10] + [[3] * 200] + prompts[10:], SamplingParams(
        temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    bad = outs[10]
    assert bad.finished and bad.outputs[0].finish_reason == "error"
    assert "whole pool has 40" in bad.error
    good = outs[:10] + outs[11:]
    assert [o.outputs[0].token_ids for o in good] == refs
    with pytest.raises(RequestRejectedError, match="context of 1400"):
        llm.engine.add_request("x", [3] * 1300, SamplingParams(max_tokens=200))
    with pytest.raises(ValueError, match="already in use"):
        llm.engine.add_request("y", [3], SamplingParams(max_tokens=2))
        llm.engine.add_request("y", [3], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 96\)"):
        llm.engine.add_request("z", [3, 500], SamplingParams(max_tokens=2))


def test_llm_generate_with_strings_in_order_with_n(tmp_path):
    model = long_model("llama_gqa")
    tok = make_tokenizer()
    llm = LLM(model, tok, block_size=4, num_blocks=200)
    prompts = ["w5 w6 w7", "w10 w11", "w40 w41 w42 w43 w44 w45"]
    outs = llm.generate(prompts, SamplingParams(n=3, temperature=0.8, seed=5, max_tokens=6),
                        use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    for o, p in zip(outs, prompts):
        assert o.prompt_token_ids == tok(p)["input_ids"]
        assert len(o.outputs) == 3 and [c.index for c in o.outputs] == [0, 1, 2]
        for c in o.outputs:
            assert len(c.token_ids) == 6 and c.finish_reason == "length"
            assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)
    # greedy n completions are identical and equal to stock
    greedy = llm.generate(prompts[0], SamplingParams(n=2, temperature=0, max_tokens=6,
                                                     ignore_eos=True), use_tqdm=False)[0]
    ref = stock_greedy(model, tok(prompts[0])["input_ids"], 6)
    assert [c.token_ids for c in greedy.outputs] == [ref, ref]
    # a folder: model and tokenizer loaded from it
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded = LLM(str(tmp_path), block_size=4, num_blocks=100)
    again = loaded.generate(prompts[0], SamplingParams(temperature=0, max_tokens=6,
                                                       ignore_eos=True), use_tqdm=False)[0]
    assert again.outputs[0].token_ids == ref


def test_parallel_samples_share_the_prompt_blocks():
    model = long_model("llama_gqa")
    engine = LLMEngine(model, block_size=4, num_blocks=100, enable_prefix_caching=False)
    engine.add_request("a", list(range(3, 43)), SamplingParams(n=4, temperature=1.0, seed=0,
                                                               max_tokens=3))
    engine.step()  # the prompt, once
    engine.step()  # four rows decode, sharing the prompt's 10 blocks
    stats = engine.stats()
    assert stats.running == 4
    assert stats.blocks_used <= 10 + 4 * 1 + 1
    # A request of n = 3 waiting counts its 3 sequences, as admission does (it counted 1).
    engine.add_request("b", [5, 6, 7], SamplingParams(n=3, temperature=1.0, max_tokens=2))
    assert engine.stats().waiting == engine.num_waiting_sequences() == 3
    while engine.has_unfinished_requests():
        engine.step()


def test_async_streams_and_abort_frees_blocks():
    import asyncio

    model = long_model("llama_gqa")
    tok = make_tokenizer()
    llm = hf_paged.AsyncLLM(model, tok, block_size=4, num_blocks=100)

    async def main():
        steps = []
        async for out in llm.generate("w5 w6 w7", SamplingParams(temperature=0, max_tokens=5,
                                                                   ignore_eos=True)):
            steps.append(out)
        assert [len(o.outputs[0].token_ids) for o in steps] == [1, 2, 3, 4, 5]
        assert steps[-1].finished and steps[-1].outputs[0].text
        ref = stock_greedy(model, tok("w5 w6 w7")["input_ids"], 5)
        assert steps[-1].outputs[0].token_ids == ref
        seen = 0
        stream = llm.generate([3] * 30, SamplingParams(max_tokens=200, ignore_eos=True),
                              request_id="long")
        async for out in stream:
            seen += 1
            if seen == 3:
                break  # the client left
        await stream.aclose()
        for _ in range(100):
            if llm.stats().running == 0:
                break
            await asyncio.sleep(0.02)
        stats = llm.stats()
        assert stats.running == 0 and stats.blocks_used == 0
        with pytest.raises(RequestRejectedError):
            async for _ in llm.generate([3] * 2000, SamplingParams(max_tokens=5)):
                pass

    try:
        asyncio.run(main())
    finally:
        llm.shutdown()


def test_lora_model_is_served_and_prompt_learning_is_refused():
    from peft import LoraConfig, PromptTuningConfig, TaskType, get_peft_model

    lora = get_peft_model(long_model("falcon_alibi").__class__(long_model("falcon_alibi").config),
                          LoraConfig(task_type=TaskType.CAUSAL_LM, r=4, target_modules="all-linear",
                                     init_lora_weights=False)).eval()
    prompts = random_prompts(5, 6, 2, 20)
    refs = [stock_greedy(lora, p, 6) for p in prompts]
    outs = LLM(lora, block_size=4, num_blocks=100).generate(
        prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == refs
    prompt_tuned = get_peft_model(LlamaForCausalLM(long_model("llama_gqa").config),
                                  PromptTuningConfig(task_type=TaskType.CAUSAL_LM,
                                                     num_virtual_tokens=3))
    with pytest.raises(hf_paged.UnsupportedModelError, match="prompt learning"):
        LLM(prompt_tuned)


def two_adapter_model(first: str, second: str):
    """A PEFT model on the Llama test model with two random LoRA adapters."""
    from peft import LoraConfig, TaskType, get_peft_model

    base = long_model("llama_gqa")
    config = dict(task_type=TaskType.CAUSAL_LM, r=4, target_modules="all-linear",
                  init_lora_weights=False)
    model = get_peft_model(LlamaForCausalLM(base.config), LoraConfig(**config),
                           adapter_name=first)
    model.base_model.model.load_state_dict(base.state_dict(), strict=False)
    model.add_adapter(second, LoraConfig(**config))
    return model.eval()


def adapter_refs(model, prompt, max_tokens) -> dict:
    """Stock greedy tokens of a two_adapter_model under "a", "b" and BASE ("a" left active)."""
    from hf_paged.engine import BASE

    refs = {}
    for name in ("a", "b"):
        model.set_adapter(name)
        refs[name] = stock_greedy(model, prompt, max_tokens)
    with model.disable_adapter():
        refs[BASE] = stock_greedy(model, prompt, max_tokens)
    model.set_adapter("a")
    return refs


def test_adapters_batched_apart_and_prefix_cache_kept_apart():
    from hf_paged.engine import BASE

    model = two_adapter_model("a", "b")
    prompt = list(range(3, 43))  # 10 full blocks of 4
    refs = adapter_refs(model, prompt, 6)
    assert len({tuple(r) for r in refs.values()}) == 3
    engine = LLMEngine(model, block_size=4, num_blocks=200)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for i, name in enumerate(["a", "b", BASE, None, "a"]):
        engine.add_request(f"{i}", prompt, params, adapter=name)
    done = run_engine(engine, [], [])
    assert [done[f"{i}"].outputs[0].token_ids for i in range(5)] == [
        refs["a"], refs["b"], refs[BASE], refs["a"], refs["a"]]
    before = engine.stats().prefix_cache_hit_tokens
    engine.add_request("again-b", prompt, params, adapter="b")  # cached under b only
    engine.add_request("again-base", prompt, params, adapter=BASE)
    done = run_engine(engine, [], [])
    assert done["again-b"].num_cached_tokens == 36 and done["again-base"].num_cached_tokens == 36
    assert engine.stats().prefix_cache_hit_tokens == before + 72
    with pytest.raises(ValueError, match="unknown adapter"):
        engine.add_request("x", prompt, params, adapter="c")


def test_a_forward_failing_inside_peft_leaves_no_adapter_behind():
    """PEFT passes a forward's per-row adapters to its layers through pre-hooks that it
    removes after the forward, but not when the forward raises (here: adapter "b" named while
    the model's adapters are merged). Left in place, they ran "b" in every later forward:
    the failed request fails alone, and the next requests run their own adapters."""
    model = two_adapter_model("a", "b")
    prompt = [5, 17, 33, 40, 8, 61, 22]
    refs = adapter_refs(model, prompt, 6)
    llm = LLM(model, block_size=4, num_blocks=100)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    model.merge_adapter()
    failed = llm.generate([prompt], params, use_tqdm=False, adapter=["b"])[0]
    assert failed.error is not None and "merged" in failed.error
    model.unmerge_adapter()
    assert sum(len(m._forward_pre_hooks) for m in model.modules()) == 0
    outs = llm.generate([prompt] * 2, params, use_tqdm=False, adapter=[None, "b"])
    assert [o.outputs[0].token_ids for o in outs] == [refs["a"], refs["b"]]
