"""`LLM` as vLLM users call it: prompt dicts (TextPrompt / TokensPrompt), `chat()` over the
tokenizer's chat template, an adapter per prompt, `get_tokenizer()`. Tokens are compared
with stock `generate` on the same ids."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
import torch
import transformers

import hf_paged
from hf_paged import LLM, InvalidRequestError, LLMEngine, SamplingParams
from conftest import make_tokenizer
from test_engine import adapter_refs, long_model, stock_greedy, two_adapter_model

GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
# Renders each message's role and content; the generation prompt opens an assistant turn.
TEMPLATE = ("{{ bos_token }} {% for m in messages %}w{{ 10 if m['role'] == 'user' else 11 }} "
            "{{ m['content'] }} </s> {% endfor %}{% if tools %}w12 {% endif %}"
            "{% if add_generation_prompt %}w13 {% endif %}{% if flag %}w14 {% endif %}")


@pytest.fixture(scope="module")
def llm():
    tok = make_tokenizer()
    tok.chat_template = TEMPLATE
    return LLM(long_model("llama_gqa"), tok, block_size=4, num_blocks=200)


def test_prompt_dicts_run_like_their_text_and_ids(llm):
    tok, model = llm.get_tokenizer(), long_model("llama_gqa")
    ids = tok("w5 w6 w7")["input_ids"]
    ref = stock_greedy(model, ids, 5)
    outs = llm.generate([{"prompt": "w5 w6 w7"}, {"prompt_token_ids": ids},
                         {"prompt_token_ids": ids, "prompt": "shown", "cache_salt": "s"}],
                        GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [ref] * 3
    assert [o.prompt for o in outs] == ["w5 w6 w7", None, "shown"]
    assert all(o.prompt_token_ids == ids for o in outs)
    assert outs[2].num_cached_tokens == 0  # its own salt: no other prompt's blocks
    single = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)
    assert len(single) == 1 and single[0].outputs[0].token_ids == ref


def test_token_ids_as_a_tensor_or_array_run_like_the_list(llm):
    """A tokenizer's `input_ids[0]` (tensor or numpy), alone, in a list or in a dict."""
    import numpy as np

    ids = llm.get_tokenizer()("w5 w6 w7")["input_ids"]
    ref = stock_greedy(long_model("llama_gqa"), ids, 5)
    for prompts in (torch.tensor(ids), np.array(ids), torch.tensor(ids, dtype=torch.int32),
                    [torch.tensor(ids), np.array(ids), {"prompt_token_ids": torch.tensor(ids)}]):
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [ref] * len(outs)
        assert all(o.prompt_token_ids == ids and type(o.prompt_token_ids[0]) is int
                   for o in outs)


@pytest.mark.parametrize("prompt", [torch.tensor([[5, 6, 7]]), torch.tensor([5.0, 6.0]),
                                    torch.tensor(5), [torch.tensor([[5, 6], [0, 7]])]])
def test_a_batch_tensor_or_one_of_floats_is_refused_by_name(llm, prompt):
    """A 2-D tensor is a padded batch whose pad tokens would run as prompt: refused."""
    with pytest.raises(InvalidRequestError, match="1-D integers; got shape") as err:
        llm.generate(prompt, GREEDY, use_tqdm=False)
    assert err.value.param == "prompt"
    stats = llm.stats()
    assert stats.waiting == stats.running == stats.blocks_used == 0


@pytest.mark.parametrize("prompt, match", [
    ({"prompt_token_ids": [5], "multi_modal_data": {}}, "multi_modal_data"),
    ({"cache_salt": "b"}, "needs"),
    ({"prompt": 5}, "text"),
    ({"prompt_token_ids": "w5 w6"}, "list of token ids"),
    ({"prompt_token_ids": [5, "x"]}, "integers"),
    ({"prompt_token_ids": [5], "cache_salt": "a"}, "twice"),
    (7, "a prompt is text"),
])
def test_bad_prompt_dicts_are_named_and_queue_nothing(llm, prompt, match):
    params = SamplingParams(max_tokens=2, cache_salt="b")
    with pytest.raises(InvalidRequestError, match=match) as err:
        llm.generate([[5, 6], prompt], params, use_tqdm=False)
    assert err.value.param in ("prompt", "cache_salt")
    stats = llm.stats()
    assert stats.waiting == stats.running == stats.blocks_used == 0


def test_chat_renders_the_template_and_generates_like_stock(llm):
    tok, model = llm.get_tokenizer(), long_model("llama_gqa")
    first = [{"role": "user", "content": "w5 w6"}]
    second = [{"role": "user", "content": "w7"}, {"role": "assistant", "content": "w8 w9"},
              {"role": "user", "content": [{"type": "text", "text": "w20 "},
                                           {"type": "text", "text": "w21"}]}]
    outs = llm.chat([first, second], GREEDY, use_tqdm=False)
    for out, conversation in zip(outs, (first, second)):
        joined = [dict(m, content="w20 w21") if isinstance(m["content"], list) else m
                  for m in conversation]
        text = tok.apply_chat_template(joined, tokenize=False, add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert out.prompt == text and out.prompt_token_ids == ids
        assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
        assert out.outputs[0].token_ids == stock_greedy(model, ids, 5)
    one = llm.chat(first, GREEDY, use_tqdm=False)  # one conversation: one output
    assert len(one) == 1 and one[0].outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_chat_options_reach_the_template(llm):
    tok = llm.get_tokenizer()
    messages = [{"role": "user", "content": "w5"}, {"role": "assistant", "content": "w6"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    out = llm.chat(messages, GREEDY, use_tqdm=False, tools=tools,
                   chat_template_kwargs={"flag": True})[0]
    assert out.prompt_token_ids == tok(out.prompt, add_special_tokens=False)["input_ids"]
    assert out.prompt.split()[-3:] == ["w12", "w13", "w14"]
    # the assistant's turn left open: the text ends with its content
    out = llm.chat(messages, GREEDY, use_tqdm=False, add_generation_prompt=False,
                   continue_final_message=True)[0]
    assert out.prompt.split()[-2:] == ["w11", "w6"]
    assert out.prompt_token_ids == tok(out.prompt, add_special_tokens=False)["input_ids"]
    own = llm.chat(messages, GREEDY, use_tqdm=False, chat_template="{{ messages[0]['content'] }}")
    assert own[0].prompt == "w5"


def test_chat_without_a_template_is_a_clear_error():
    llm = LLM(long_model("llama_gqa"), make_tokenizer(), block_size=4, num_blocks=50)
    with pytest.raises(ValueError, match="chat template"):
        llm.chat([{"role": "user", "content": "w5"}], GREEDY, use_tqdm=False)
    assert llm.stats().waiting == 0


def test_an_adapter_per_prompt():
    from hf_paged.engine import BASE

    model = two_adapter_model("a", "b")
    prompt = list(range(3, 20))
    refs = adapter_refs(model, prompt, 5)
    llm = LLM(model, block_size=4, num_blocks=200)
    outs = llm.generate([prompt] * 3, GREEDY, use_tqdm=False, adapter=["b", BASE, None])
    assert [o.outputs[0].token_ids for o in outs] == [refs["b"], refs[BASE], refs["a"]]
    every = llm.generate([prompt] * 2, GREEDY, use_tqdm=False, adapter="b")
    assert [o.outputs[0].token_ids for o in every] == [refs["b"]] * 2
    with pytest.raises(ValueError, match="2 adapters for 3 prompts"):
        llm.generate([prompt] * 3, GREEDY, use_tqdm=False, adapter=["a", "b"])
    with pytest.raises(InvalidRequestError, match="unknown adapter"):
        llm.generate([prompt] * 2, GREEDY, use_tqdm=False, adapter=[None, "c"])
    assert llm.stats().waiting == llm.stats().running == 0


def test_folders_dtype_and_options_as_vllm_users_pass_them(tmp_path):
    model, tok = long_model("llama_gqa"), make_tokenizer()
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "t")
    llm = LLM(str(tmp_path / "m"), tokenizer=str(tmp_path / "t"), dtype="bfloat16",
              block_size=4, num_blocks=50)
    assert llm.engine.dtype is torch.bfloat16
    assert llm.get_tokenizer()("w5 w6")["input_ids"] == tok("w5 w6")["input_ids"]
    out = llm.generate("w5 w6", SamplingParams(max_tokens=2), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 2
    with pytest.raises(TypeError, match=r"LLM\(\) got unknown options \['enforce_eager'\]"):
        LLM(str(tmp_path / "nowhere"), enforce_eager=True)  # refused before loading
    with pytest.raises(FileNotFoundError, match="no model folder"):
        LLM(str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="dtype applies to a model loaded from a folder"):
        LLM(model, dtype="float16")
    with pytest.raises(ValueError, match="could not be loaded"):
        LLM(model, tokenizer=str(tmp_path / "m"))  # a folder without a tokenizer
    with pytest.raises(TypeError, match=r"AsyncLLM\(\) got unknown options \['swap_space'\]"):
        hf_paged.AsyncLLM(model, swap_space=4)
    for option, value in [("gpu_memory_utilization", 1.5), ("gpu_memory_utilization", 0),
                          ("enable_prefix_caching", "yes")]:
        with pytest.raises(ValueError, match=option):
            LLM(model, **{option: value})


def test_sequences_numpy_ids_and_what_needs_a_tokenizer(llm):
    model = long_model("llama_gqa")
    ids = np.array([5, 6, 7])
    ref = stock_greedy(model, [5, 6, 7], 5)
    outs = llm.generate(list(ids), (GREEDY,), use_tqdm=False)  # one prompt, a tuple of params
    assert len(outs) == 1 and outs[0].outputs[0].token_ids == ref
    assert outs[0].prompt_token_ids == [5, 6, 7]
    outs = llm.generate([ids, ids[:2]], GREEDY, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == ref and outs[1].prompt_token_ids == [5, 6]
    stop = llm.generate([[5, 6, 7]], SamplingParams(
        temperature=0, max_tokens=5, stop_token_ids=[np.int64(ref[1])]), use_tqdm=False)[0]
    assert stop.outputs[0].token_ids == ref[:2] and stop.outputs[0].finish_reason == "stop"
    metrics = stop.metrics
    assert metrics.arrival_time <= metrics.first_scheduled_time <= metrics.first_token_time
    bare = LLM(model, block_size=4, num_blocks=50)
    with pytest.raises(InvalidRequestError, match="needs a tokenizer") as err:
        bare.generate([[5, 6]], SamplingParams(max_tokens=2, stop=["x"]), use_tqdm=False)
    assert err.value.param == "stop"


def test_logprobs_read_as_vllms_logprob_objects(llm):
    """Each entry is a float that also has vLLM's `.logprob`, `.rank` and `.decoded_token`;
    ranks as vLLM counts them (how many tokens are at least as likely), checked against one
    stock forward."""
    tok, model = llm.get_tokenizer(), long_model("llama_gqa")
    prompt = [5, 6, 7, 8]
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=4, logprobs=2, prompt_logprobs=1)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    ids = prompt + out.outputs[0].token_ids
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    positions = [(p, ids[p + 1], out.prompt_logprobs[p + 1]) for p in range(len(prompt) - 1)]
    positions += [(len(prompt) - 1 + i, t, e) for i, (t, e) in
                  enumerate(zip(out.outputs[0].token_ids, out.outputs[0].logprobs))]
    for position, token, entry in positions:
        row = ref[position]
        chosen = entry[token]
        assert isinstance(chosen, float) and chosen.logprob == float(chosen)
        assert chosen.logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert chosen.rank == int((row >= row[token] - 1e-6).sum())
        assert chosen.decoded_token == tok.decode([token])
        best = min(entry, key=lambda t: entry[t].rank)
        assert entry[best].rank == 1 and best == int(row.argmax())
    for copied in (copy.deepcopy(out), pickle.loads(pickle.dumps(out))):  # (saved results)
        again = copied.outputs[0].logprobs[0][out.outputs[0].token_ids[0]]
        assert (again, again.rank, again.decoded_token) == (
            chosen := out.outputs[0].logprobs[0][out.outputs[0].token_ids[0]], chosen.rank,
            tok.decode([out.outputs[0].token_ids[0]]))
    bare = LLM(model, block_size=4, num_blocks=50).generate([prompt], params, use_tqdm=False)[0]
    assert bare.outputs[0].logprobs[0][bare.outputs[0].token_ids[0]].decoded_token is None


def test_completion_output_fields_come_in_vllms_order():
    """Code that builds a vLLM CompletionOutput positionally (mocks, adapters of results)
    filled other fields: ours had finish_reason where vLLM has cumulative_logprob."""
    from dataclasses import fields

    from hf_paged import CompletionOutput

    assert [f.name for f in fields(CompletionOutput)] == [
        "index", "text", "token_ids", "cumulative_logprob", "logprobs", "finish_reason",
        "stop_reason"]
    out = CompletionOutput(0, "hi", [5], -1.5, None, "stop", None)
    assert (out.cumulative_logprob, out.finish_reason, out.finished) == (-1.5, "stop", True)


def test_default_params_and_prefix_cache_reset(tmp_path):
    model = long_model("llama_gqa")
    model.generation_config.temperature = 0.7
    try:
        llm = LLM(model, block_size=4, num_blocks=60)
        defaults = llm.get_default_sampling_params()
    finally:
        model.generation_config.temperature = None
    assert defaults.temperature == 0.7 and defaults.max_tokens == 16
    prompt = list(range(3, 23))
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    llm.generate([prompt], params, use_tqdm=False)
    assert llm.generate([prompt], params, use_tqdm=False)[0].num_cached_tokens == 16
    assert llm.stats().blocks_cached > 0
    assert llm.reset_prefix_cache() is True
    assert llm.stats().blocks_cached == 0 and llm.stats().blocks_free == 60
    assert llm.generate([prompt], params, use_tqdm=False)[0].num_cached_tokens == 0


def test_default_params_changed_between_calls_take_effect():
    """vLLM's pattern: take the default settings, set fields, generate; set others, generate
    again. Each call reads the object as it is then (the sampler kept the first call's
    allowed ids and biases on it), and a call running when it changes keeps its own."""
    llm = LLM(long_model("llama_gqa"), make_tokenizer(), block_size=4, num_blocks=100)
    params = llm.get_default_sampling_params()
    params.temperature, params.max_tokens, params.ignore_eos = 0, 3, True

    def tokens():
        return llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids

    params.allowed_token_ids = [10]
    assert tokens() == [10, 10, 10]
    params.allowed_token_ids = [20]
    assert tokens() == [20, 20, 20]
    params.allowed_token_ids, params.logit_bias = None, {40: 100.0}
    assert tokens() == [40, 40, 40]
    engine = llm.engine
    engine.add_request("r", [5, 6, 7], params)
    params.logit_bias = {50: 100.0}  # after the request was added: not its settings
    while engine.has_unfinished_requests():
        done = [o for o in engine.step() if o.finished]
    assert done[0].outputs[0].token_ids == [40, 40, 40]


def test_an_engine_seed_fixes_what_unseeded_requests_sample():
    """vLLM's LLM(seed=): requests without a seed of their own draw from the engine's
    generator, so two engines of one seed sample alike; torch's default generator is left
    alone, and a request's own seed still decides its tokens."""
    model, tok = long_model("llama_gqa"), make_tokenizer()
    hot = SamplingParams(temperature=1.5, max_tokens=8, ignore_eos=True)
    prompts = [[5, 6, 7], [8, 9], [5, 6, 7]]

    def run(seed, params=hot):
        llm = LLM(model, tok, block_size=4, num_blocks=100, seed=seed)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    state = torch.get_rng_state()
    first, again, other = run(7), run(7), run(8)
    assert torch.equal(torch.get_rng_state(), state)
    assert first == again and first != other
    assert first[0] != first[2]  # (one generator for the batch: the rows draw apart)
    own = SamplingParams(temperature=1.5, max_tokens=8, ignore_eos=True, seed=3)
    assert run(7, own) == run(None, own) == run(8, own)
    for bad in (True, 1.5, "7", 2**64):
        with pytest.raises(ValueError, match="seed must be an integer"):
            LLM(model, tok, num_blocks=10, seed=bad)


def test_async_llm_speaks_vllms_names():
    import asyncio

    async def main():
        llm = hf_paged.AsyncLLM(long_model("llama_gqa"), make_tokenizer(), block_size=4,
                                num_blocks=60)
        try:
            assert llm.is_running and not llm.errored
            await llm.check_health()
            assert (await llm.get_tokenizer()) is llm.tokenizer
            params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
            async for _ in llm.generate(list(range(3, 23)), params, "r0"):
                pass
            assert llm.stats().blocks_cached > 0
            assert await llm.reset_prefix_cache() is True
            assert llm.stats().blocks_cached == 0
            long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
            streams = [llm.add([5, 6, 7], long, f"a{i}") for i in range(3)]
            await llm.abort("a0")  # vLLM's spelling: awaited, one id or several
            llm.abort(["a1", "a2"])
            finals = [[out async for out in s][-1] for s in streams]
            assert [f.outputs[0].finish_reason for f in finals] == ["abort"] * 3
            assert all(len(f.outputs[0].token_ids) < 200 for f in finals)
        finally:
            llm.shutdown()
        assert not llm.is_running and llm.errored
        with pytest.raises(hf_paged.EngineDeadError):
            await llm.check_health()

    asyncio.run(main())


def test_an_aborted_request_id_can_be_used_again_at_once():
    """vLLM frees an aborted request's id at once. Here the id stayed taken until the next
    step boundary ended the request, so a `generate` of the same id right after leaving the
    loop (or `await llm.abort(id)`) raised "already in use"; it now waits for that boundary.
    The new request gets its own outputs, the old stream its "abort"."""
    import asyncio

    async def main():
        llm = hf_paged.AsyncLLM(long_model("llama_gqa"), block_size=4, num_blocks=60)
        params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
        try:
            alone = [out async for out in llm.generate([5, 6, 7], params, "solo")][-1]
            for way in ("leave the loop", "abort", "abort a list"):
                async for _ in llm.generate([5, 6, 7], params, "x"):
                    break  # (leaving aborts "x")
                old = llm.add([8, 9], params, "y") if way != "leave the loop" else None
                if old is not None:
                    await llm.abort("y" if way == "abort" else ["y"])
                for rid in ("x", "y") if old is not None else ("x",):
                    again = [out async for out in llm.generate([5, 6, 7], params, rid)][-1]
                    assert again.request_id == rid
                    assert again.outputs[0].token_ids == alone.outputs[0].token_ids
                if old is not None:
                    assert [out async for out in old][-1].outputs[0].finish_reason == "abort"
            assert llm.stats().running == 0
        finally:
            llm.shutdown()

    asyncio.run(main())


def _served(seed: int):
    """A Llama test model, an LLM that has served two prompts on it, the prompts, their
    greedy params and the free blocks after them."""
    from conftest import make_model

    model = make_model("llama_gqa", seed=seed)
    llm = LLM(model, block_size=4, num_blocks=64)
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    return model, llm, prompts, params, llm.engine.scheduler.pool.num_free


def test_a_model_cast_or_moved_after_the_engine_is_built_is_a_named_error():
    """The pool holds the dtype and device the engine was built for: a model cast since
    gets ModelChangedError before its step changes anything (no request stays queued, no
    block is held), and once cast back the engine serves it as stock generate does."""
    model, llm, prompts, params, free = _served(seed=3)
    model.to(torch.bfloat16)
    with pytest.raises(hf_paged.ModelChangedError,
                       match="now torch.bfloat16 on cpu, but this engine was built for "
                             "torch.float32 on cpu"):
        llm.generate(prompts, params, use_tqdm=False)
    engine = llm.engine
    engine.add_request("r", prompts[0], params)
    with pytest.raises(hf_paged.ModelChangedError):
        engine.step()
    assert engine.has_unfinished_requests() and engine.scheduler.pool.num_free == free
    engine.abort("r")
    model.to(torch.float32)  # (its weights now rounded to bfloat16: compared anew)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [stock_greedy(model, p, 8) for p in prompts]
    assert engine.scheduler.pool.num_free == free and not engine.has_unfinished_requests()


def test_a_model_wrapped_by_torch_compile_is_refused_with_the_way_to_serve_it():
    from conftest import make_model

    wrapped = torch.compile(make_model("llama_gqa"), backend="eager")
    with pytest.raises(hf_paged.UnsupportedModelError,
                       match=r"torch.compile's wrapper of a LlamaForCausalLM; pass the model "
                             r"itself .*compile=True"):
        LLM(wrapped, block_size=4, num_blocks=16)


def test_layers_added_beyond_the_pool_are_a_named_error():
    """A layer added to the model (depth up-scaling, the layers numbered anew) has K/V the
    pool was not built for: ModelChangedError before anything runs, every block given back;
    with the layer taken out again the engine serves the model as stock generate does."""
    import copy

    model, llm, prompts, params, free = _served(seed=4)
    layers = model.model.layers
    layers.append(copy.deepcopy(layers[1]))
    layers[2].self_attn.layer_idx = 2
    model.config.num_hidden_layers = 3
    for _ in range(2):  # (and again: the error holds while the layer does)
        with pytest.raises(hf_paged.ModelChangedError, match="up to layer_idx 2, but this "
                                                             "engine's KV pool holds 2 layers"):
            llm.generate(prompts, params, use_tqdm=False)
        assert not llm.engine.has_unfinished_requests()
        assert llm.engine.scheduler.pool.num_free == free
    del layers[2]
    model.config.num_hidden_layers = 2
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [stock_greedy(model, p, 8) for p in prompts]


def _drive(engine, prompts, params, change, at: int = 3) -> dict:
    """Steps `engine` through `prompts`, calling `change()` after `at` steps (the
    requests decoding, none waiting); returns each request's finished output."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"d{i}", prompt, params)
    outs, steps = {}, 0
    while engine.has_unfinished_requests() and steps < 100:
        if steps == at:
            change()
        outs.update({o.request_id: o for o in engine.step() if o.finished})
        steps += 1
    return [outs[f"d{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_layer_replaced_while_requests_decode_runs_on_the_model_as_it_is(async_scheduling):
    """An eager engine looks at the model's layout when it admits requests. A layer put in
    place of another while requests decode (a copy holding its own config, which the
    attention switch did not reach) fails that step's forward, which then runs anew on the
    model as it is: stock tokens, nothing failed. A layer added beyond the pool's then ends
    the running requests with the named error, no block held, and once it is taken out the
    engine serves on."""
    import copy

    from conftest import make_model

    model = make_model("llama_gqa", seed=6)
    llm = LLM(model, block_size=4, num_blocks=64, async_scheduling=async_scheduling)
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19]]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    layers = model.model.layers

    def replace():
        layers[0] = copy.deepcopy(layers[0])

    outs = _drive(llm.engine, prompts, params, replace)
    assert [o.error for o in outs] == [None] * 3
    assert [o.outputs[0].token_ids for o in outs] == [stock_greedy(model, p, 10) for p in prompts]

    def add():
        layers.append(copy.deepcopy(layers[1]))
        layers[2].self_attn.layer_idx, model.config.num_hidden_layers = 2, 3

    outs = _drive(llm.engine, prompts, params, add)
    assert all("up to layer_idx 2, but this engine's KV pool holds 2 layers" in o.error
               for o in outs)
    assert llm.stats().blocks_used == 0 and not llm.engine.has_unfinished_requests()
    del layers[2]
    model.config.num_hidden_layers = 2
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [stock_greedy(model, p, 10) for p in prompts]


def test_embeddings_resized_after_the_engine_is_built_set_the_prompts_vocabulary():
    """Tokens added to the model after its engine was built (`resize_token_embeddings`)
    are prompts like any other, with stock tokens; ids past a shrunk vocabulary are an
    InvalidRequestError that names it, not a failed forward."""
    model, llm, prompts, params, _ = _served(seed=5)
    vocab = model.config.vocab_size
    model.resize_token_embeddings(vocab + 8, mean_resizing=False)
    grown = [prompts[0] + [vocab + 3, vocab + 7], [vocab + 1] + prompts[1]]
    outs = llm.generate(grown, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [stock_greedy(model, p, 8) for p in grown]
    model.resize_token_embeddings(vocab - 10, mean_resizing=False)
    with pytest.raises(InvalidRequestError, match=rf"in \[0, {vocab - 10}\)"):
        llm.generate([prompts[0] + [vocab - 5]], params, use_tqdm=False)
    assert llm.engine.vocab_size == vocab - 10 and not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("kind,setting,named", [
    ("phi", dict(resid_pdrop=0.1), r"dropout \(p=0.1\)"),
    # Falcon drops its hidden states through a function, with no Dropout module to see
    ("falcon", dict(hidden_dropout=0.3), "hidden_dropout=0.3"),
    ("mixtral", dict(router_jitter_noise=0.2), "router_jitter_noise=0.2"),
    ("dbrx", dict(ffn_config=dict(ffn_hidden_size=96, moe_num_experts=4, moe_top_k=2,
                                  moe_jitter_eps=0.5)), r"ffn_config.moe_jitter_eps=0.5"),
    ("opt", dict(layerdrop=0.5), "layerdrop=0.5")])
def test_a_model_put_back_in_training_mode_with_dropout_is_a_named_error(kind, setting, named):
    """The engine runs a model in eval mode: one put back in training mode whose dropout
    (or router jitter) would draw random numbers (random tokens) gets ModelChangedError
    before its step runs; without any to apply, training mode changes nothing and the
    engine serves it."""
    from conftest import make_model
    from zoo import make_arch

    def build(**setting):
        if kind == "falcon":
            return make_model("falcon_new", **setting)
        if kind == "opt":  # (layers skipped at random in training)
            torch.manual_seed(0)
            return transformers.OPTForCausalLM(transformers.OPTConfig(
                vocab_size=96, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                num_attention_heads=4, dropout=0.0, attention_dropout=0.0,
                max_position_embeddings=128, word_embed_proj_dim=32, **setting)).eval()
        return make_arch(kind, **setting)

    model = build(**setting)
    llm = LLM(model, block_size=4, num_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    expected = [stock_greedy(model, p, 6) for p in prompts]
    model.train()
    with pytest.raises(hf_paged.ModelChangedError, match=f"training mode .*{named}"):
        llm.generate(prompts, params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    model.eval()
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    plain = build()  # (none to apply: training mode is eval mode's arithmetic)
    plain_llm = LLM(plain, block_size=4, num_blocks=64)
    expected = [stock_greedy(plain, p, 6) for p in prompts]
    plain.train()
    outs = plain_llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected


def _tuned(model, step: int) -> None:
    """An in-place update of every weight, as an optimizer step makes."""
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * step + i))
                   * 0.3 * p.std().clamp_min(1e-3))


def _tuned_copy(module):
    """A copy of `module` with other weights: what replacing a layer of the model brings."""
    import copy

    module = copy.deepcopy(module)
    _tuned(module, 3)
    return module


def stock_checker(llm, model, prompts, max_tokens):
    """A call of `llm` on `prompts` that asserts stock greedy tokens of `model` as it is now
    and returns the prefix-cache hits so far."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)

    def check() -> int:
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [
            stock_greedy(model, p, max_tokens) for p in prompts]
        return llm.stats().prefix_cache_hit_tokens

    return check


def test_the_attention_switch_held_through_a_call_is_undone_and_shared(monkeypatch):
    """`LLM.generate` keeps the model's attention switched to "paged" from its first step to
    its last: stock `generate` calls on another thread meanwhile give stock tokens, and the
    config's own implementation is back after the call, also after a call that failed."""
    import threading

    from conftest import make_model

    model = make_model("llama_gqa", seed=8)
    before = model.config._attn_implementation
    llm = LLM(model, block_size=4, num_blocks=200)
    prompts = [list(range(3 + i, 20 + 2 * i)) for i in range(6)]
    ids = torch.tensor([prompts[0]])
    ref = model.generate(ids, max_new_tokens=6, do_sample=False)
    stock, done = [], threading.Event()

    def stock_calls():
        while not done.is_set() and len(stock) < 20:
            stock.append(torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False),
                                     ref))

    thread = threading.Thread(target=stock_calls)
    thread.start()
    try:
        check = stock_checker(llm, model, prompts, 40)
        check()
    finally:
        done.set()
        thread.join(60)
    assert stock and all(stock)
    assert model.config._attn_implementation == before
    steps = iter(range(3))
    step = llm.engine.step
    monkeypatch.setattr(llm.engine, "step", lambda: step() if next(steps, None) is not None
                        else 1 / 0)
    with pytest.raises(ZeroDivisionError):
        llm.generate(prompts, SamplingParams(max_tokens=20), use_tqdm=False)
    assert model.config._attn_implementation == before


def test_cached_prefixes_of_other_weights_are_never_reused():
    """A model trained between calls (an RL loop reusing its LLM): prompts whose blocks the
    prefix cache holds from the old weights are computed anew, equal to stock generate on
    the new weights. An in-place update, a new Parameter, a new `.data` and a module or a
    whole layer replaced by another (its weights never seen before) each count."""
    from conftest import make_model

    model = make_model("llama_gqa", seed=5)
    llm = LLM(model, block_size=4, num_blocks=120)
    shared = list(range(20, 44))
    check = stock_checker(llm, model, [shared + [5, 6], shared + [7], shared], 8)
    hits = check()
    assert check() > hits  # the same weights: the prompts' blocks are found again
    for step, change in enumerate([
            lambda: _tuned(model, 1),
            lambda: setattr(model.model.layers[0].mlp.down_proj, "weight", torch.nn.Parameter(
                model.model.layers[0].mlp.down_proj.weight * 1.5)),
            lambda: setattr(model.model.layers[1].self_attn.k_proj.weight, "data",
                            -model.model.layers[1].self_attn.k_proj.weight),
            lambda: setattr(model.model.layers[0], "mlp", _tuned_copy(model.model.layers[0].mlp)),
            lambda: setattr(model.model.layers[1].mlp, "up_proj",
                            _tuned_copy(model.model.layers[1].mlp.up_proj)),
            # (a whole layer: its attention holds a copy of the config, switched too)
            lambda: model.model.layers.__setitem__(1, _tuned_copy(model.model.layers[1]))]):
        change()
        hits = llm.stats().prefix_cache_hit_tokens
        assert check() == hits  # (all three start in one step: none hits another's blocks)
        assert llm.stats().blocks_used == 0
        assert check() > hits  # the new weights' blocks serve the next call


def test_a_weight_change_while_a_request_runs_reaches_no_later_request():
    """A request running as the weights change keeps its own K/V, but none of its blocks,
    cached before the change or filled after it, serves a later request."""
    from conftest import make_model

    model = make_model("llama_gqa", seed=6)
    engine = LLMEngine(model, block_size=4, num_blocks=120)
    prompt = list(range(20, 40))
    engine.add_request("a", prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    for _ in range(3):
        engine.step()
    _tuned(model, 7)
    later, done = {"b": prompt + [5, 6, 7]}, {}
    engine.add_request("b", later["b"], SamplingParams(temperature=0, max_tokens=8,
                                                       ignore_eos=True))
    while engine.has_unfinished_requests():
        if len(done) == 1 and "c" not in later:  # "a"'s tokens so far (its blocks filled
            # since the change would be found after the prompt's, which "b" holds anew)
            seq = engine.requests["a"].seqs[0]
            later["c"] = list(seq.prompt) + list(seq.output)
            engine.add_request("c", later["c"], SamplingParams(temperature=0, max_tokens=4,
                                                               ignore_eos=True))
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    for rid, ids in later.items():
        assert done[rid].outputs[0].token_ids == stock_greedy(model, ids, 8 if rid == "b" else 4)
    assert engine.stats().prefix_cache_hit_tokens == len(prompt)  # "c" on "b"'s blocks only


def test_adapters_changed_by_the_models_owner_reuse_no_cached_prefix(tmp_path):
    """A PEFT model served by an LLM whose owner changes its adapters between calls:
    disables them, loads one and makes it active (twice: blocks of the first would be found
    under the same name, none, for the second), trains it, switches, merges, unmerges. Each
    call equals stock generate on the model as it is and finds no block cached before."""
    from peft import LoraConfig, TaskType, get_peft_model
    from peft.tuners.lora.layer import LoraLayer
    from transformers import LlamaForCausalLM

    model = two_adapter_model("a", "b")
    for name, seed in (("c", 11), ("d", 12)):
        torch.manual_seed(seed)
        get_peft_model(LlamaForCausalLM(model.config), LoraConfig(
            task_type=TaskType.CAUSAL_LM, r=4, target_modules="all-linear",
            init_lora_weights=False)).save_pretrained(tmp_path / name)
    llm = LLM(model, block_size=4, num_blocks=120)
    shared = list(range(20, 44))
    check = stock_checker(llm, model, [shared + [5, 6], shared + [7]], 6)

    def loaded(name):
        model.load_adapter(str(tmp_path / name), adapter_name=name)
        model.set_adapter(name)

    def trained():
        with torch.no_grad():  # an adapter the engine has never seen
            model.base_model.model.model.layers[0].self_attn.k_proj.lora_B["d"].weight.mul_(3)

    def rescaled():  # on its last layer alone: the engine watches every adapter layer
        [*_, last] = (m for m in model.modules() if isinstance(m, LoraLayer))
        last.set_scale("b", 0.5)

    disabled = model.disable_adapter()
    assert check() < check()
    for change in [disabled.__enter__, lambda: disabled.__exit__(None, None, None),
                   lambda: loaded("c"), lambda: loaded("d"), trained,
                   lambda: model.set_adapter("b"), rescaled, model.merge_adapter,
                   model.unmerge_adapter]:
        change()
        hits = llm.stats().prefix_cache_hit_tokens
        assert check() == hits
        assert check() > hits


def test_adapters_transformers_loaded_run_as_part_of_the_model(tmp_path):
    """Adapters put in by Transformers' own `model.load_adapter` (no PeftModel) run on every
    row as the model's forward runs them: served as given and watched like weights (switched
    or disabled: no cached prefix reused). Naming one per request, or loading one at runtime
    beside them, is refused by name: PEFT could not pick one per row there."""
    from peft import LoraConfig, TaskType, get_peft_model
    from transformers import LlamaForCausalLM

    from conftest import make_model

    model = make_model("llama_gqa")  # (its own: load_adapter changes the model in place)
    for name, seed in (("a", 21), ("b", 22)):
        torch.manual_seed(seed)
        get_peft_model(LlamaForCausalLM(model.config), LoraConfig(
            task_type=TaskType.CAUSAL_LM, r=4, target_modules="all-linear",
            init_lora_weights=False)).save_pretrained(tmp_path / name)
        model.load_adapter(str(tmp_path / name), adapter_name=name)
    model.set_adapter("a")
    llm = LLM(model, block_size=4, num_blocks=120)
    shared = list(range(20, 44))
    check = stock_checker(llm, model, [shared + [5, 6], shared + [7]], 6)
    assert check() < check()
    for change in [lambda: model.set_adapter("b"), model.disable_adapters]:
        change()
        hits = llm.stats().prefix_cache_hit_tokens
        assert check() == hits
    params = SamplingParams(temperature=0, max_tokens=2)
    with pytest.raises(InvalidRequestError, match="load_adapter put in"):
        llm.generate([shared], params, use_tqdm=False, adapter=["b"])
    with pytest.raises(InvalidRequestError, match="peft.PeftModel"):
        llm.engine.lora.load("c", str(tmp_path / "a"))
    assert check() > llm.stats().prefix_cache_hit_tokens - 100  # (still serving)


def test_a_rejected_request_reports_its_prompt_as_checked():
    """A request too long for the context comes back with "error" and the prompt the checks
    read: ints (it was a list of 0-d tensors or numpy integers), the text's tokens (it was
    empty) and the ids kept by truncate_prompt_tokens (it was all of them)."""
    llm = LLM(long_model("llama_gqa"), make_tokenizer(), block_size=4, num_blocks=100,
              max_model_len=32)
    long = list(range(3, 43))
    params = SamplingParams(max_tokens=3)
    for prompt in (torch.tensor(long), np.array(long), " ".join(f"w{i}" for i in long)):
        out = llm.generate(prompt, params, use_tqdm=False)[0]
        assert out.outputs[0].finish_reason == "error" and "context of 32" in out.error
        assert out.prompt_token_ids == long and {type(t) for t in out.prompt_token_ids} == {int}
    cut = llm.generate(long, SamplingParams(max_tokens=3, truncate_prompt_tokens=30),
                       use_tqdm=False)[0]
    assert "prompt (30 tokens)" in cut.error and cut.prompt_token_ids == long[-30:]
