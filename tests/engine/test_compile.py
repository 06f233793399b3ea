"""The engine with `compile=True`: the model's forward under torch.compile(fullgraph=True)
gives the tokens of the eager engine (and of stock generate) in every mode, with a bounded
number of graphs and no graph break (fullgraph raises on one, failing the request).

Most tests trace with Dynamo's "eager" backend (the whole graph is captured and checked,
then run by PyTorch's own kernels): graph capture is what can break, and it costs seconds.
One test runs Inductor, the default, end to end in float32.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from hf_paged import LLM, LLMEngine, SamplingParams
from test_engine import long_model, random_prompts, run_engine, stock_greedy
from zoo import make_arch

CAPTURE = "eager"  # Dynamo captures the full graph; PyTorch runs it
MAX_GRAPHS = 6  # graphs per model over a whole workload (3 to 5 measured)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles its own models: Dynamo's per-function cache starts empty."""
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def graphs() -> int:
    return counters["stats"]["unique_graphs"]


def workload(seed=3, count=10):
    """Prompts of mixed lengths sharing a prefix, some arriving later: prefill-only,
    decode-only and mixed steps, chunked prompts and prefix-cache hits."""
    system = random_prompts(seed + 100, 1, 12, 12)[0]
    prompts = random_prompts(seed, count, 1, 40, shared=system)
    max_tokens = [4 + (i * 5) % 9 for i in range(len(prompts))]
    arrivals = [(i * 3) % 11 for i in range(len(prompts))]
    return prompts, max_tokens, arrivals


def run(model, compile, mode="recompute", num_blocks=60, eager_fallback=False, count=10,
        **options):
    prompts, max_tokens, arrivals = workload(count=count)
    engine = LLMEngine(model, block_size=4, num_blocks=num_blocks, max_num_seqs=5,
                       max_num_batched_tokens=24, preemption_mode=mode, compile=compile,
                       admission_headroom=0,  # admit eagerly: preempt often
                       **options)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    done = run_engine(engine, prompts, params, arrivals)
    if compile and not eager_fallback:  # (a forward that does not trace runs eagerly)
        assert engine.runner.compile_error is None, engine.runner.compile_error
    outs = [done[str(i)].outputs[0] for i in range(len(prompts))]
    assert all(o.finish_reason == "length" for o in outs), [done[str(i)].error for i in range(len(prompts))]
    return [o.token_ids for o in outs], engine.stats()


@pytest.mark.parametrize("kind", ["llama_gqa", "mistral_sw", "falcon_mq", "falcon_new",
                                  "falcon_alibi"])
def test_compiled_engine_equals_eager_and_stock(kind):
    """Both preemption modes and async scheduling, on the graphs of one compile."""
    model = long_model(kind)
    prompts, max_tokens, _ = workload()
    stock = [stock_greedy(model, p, m) for p, m in zip(prompts, max_tokens)]
    small = 24
    for mode in ("recompute", "swap"):
        tight, tight_stats = run(model, CAPTURE, mode, num_blocks=small)  # preempts
        roomy, roomy_stats = run(model, CAPTURE, mode, num_blocks=90)  # keeps prefixes
        assert tight == roomy == stock, mode
        assert run(model, False, mode, num_blocks=small)[0] == tight
        # (Mistral's window of 24 frees blocks as it goes: these sequences never run short.)
        assert tight_stats.num_preemptions > 0 or kind == "mistral_sw"
        assert roomy_stats.prefix_cache_hit_tokens > 0
    assert run(model, CAPTURE, num_blocks=small, async_scheduling=True)[0] == stock
    # Decode-only, prompt-only and mixed steps, whatever their sizes, plus a few shapes
    # Dynamo specializes (a mixed step with a single decode row).
    assert graphs() <= MAX_GRAPHS


@pytest.mark.parametrize("name", [pytest.param("gemma3", marks=pytest.mark.slow),
                                  pytest.param("gpt_oss", marks=pytest.mark.slow), "qwen3",
                                  "deepseek_v3"])
def test_compiled_engine_on_other_architectures(name):
    """Hybrid KV groups (Gemma 3, gpt-oss with sinks), QK norms (Qwen3) and a latent KV whose
    keys and values share each block at different sizes (DeepSeek-V3) trace too."""
    model = make_arch(name)
    eager, _ = run(model, False)
    compiled, _ = run(model, CAPTURE)
    assert compiled == eager
    assert graphs() <= MAX_GRAPHS


def test_a_forward_that_does_not_trace_runs_eagerly(caplog):
    """DBRX's experts loop over the experts a batch hits, a count Dynamo cannot hold in one
    graph: the first step's trace fails, and from then on the engine runs eagerly, with a
    warning saying why, rather than fail every request. Its tokens are eager's and stock's."""
    model = make_arch("dbrx")
    eager, _ = run(model, False)
    with caplog.at_level("WARNING", logger="hf_paged"):
        prompts, max_tokens, arrivals = workload()
        engine = LLMEngine(model, block_size=4, num_blocks=60, max_num_seqs=5,
                           max_num_batched_tokens=24, compile=CAPTURE)
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
                  for m in max_tokens]
        done = run_engine(engine, prompts, params, arrivals)
    assert [done[str(i)].outputs[0].token_ids for i in range(len(prompts))] == eager
    assert all(done[str(i)].error is None for i in range(len(prompts)))
    assert engine.runner.compiled is None and "UserError" in engine.runner.compile_error
    assert sum("does not compile" in r.message for r in caplog.records) == 1
    assert eager == [stock_greedy(model, p, m) for p, m in zip(prompts, max_tokens)]


def test_compiled_sampling_and_parallel_samples_equal_eager():
    model = long_model("llama_gqa")
    prompts = random_prompts(5, 6, 3, 30)
    params = SamplingParams(temperature=0.8, top_p=0.9, n=2, seed=4, max_tokens=7)

    def tokens(compile):
        outs = LLM(model, block_size=4, num_blocks=80, max_num_seqs=8,
                   compile=compile).generate(prompts, params, use_tqdm=False)
        return [[c.token_ids for c in o.outputs] for o in outs]

    assert tokens(CAPTURE) == tokens(False)


@pytest.mark.slow
def test_inductor_compiled_engine_equals_eager_in_float32():
    model = long_model("llama_gqa")
    eager, _ = run(model, False)
    compiled, _ = run(model, True)
    assert compiled == eager


def test_inductor_rounds_where_eager_rounds():
    """A half-precision model rounds to its dtype between float32 ops (RMSNorm, rotary,
    softmax). Inductor keeps a fused kernel's intermediates in float32 unless told to round
    them: a compiled bfloat16 Llama then drifted from eager and stock (log-probabilities
    0.028 off stock's against eager's 0.018). The engine's compiled forward rounds as eager
    does."""
    from hf_paged.engine.compiled import compile_forward

    class Rounding(torch.nn.Module):
        def forward(self, x):
            return (x / 3).to(torch.bfloat16).float() * 3

    x = torch.randn(4096)
    assert torch.equal(compile_forward(Rounding(), "inductor")(x=x), Rounding()(x))


def test_inductor_reads_a_latent_layer_after_its_write():
    """DeepSeek-V3 stores a latent KV (keys and values of different sizes in one block) and
    reads its rows back right after writing them. Under Inductor that read once saw part of
    the values from before the write: logits 1e-2 away from eager. One prompt and a few
    decode steps (two graphs), compared by their log-probabilities."""
    model = make_arch("deepseek_v3")
    prompt = random_prompts(5, 1, 9, 9)[0]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=5)
    outs = []
    for compile in (False, True):
        llm = LLM(model, block_size=4, num_blocks=16, compile=compile)
        outs.append(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0])
        assert llm.engine.runner.compile_error is None
    eager, compiled = outs
    assert compiled.token_ids == eager.token_ids
    for a, b in zip(eager.logprobs, compiled.logprobs):
        assert a.keys() == b.keys()
        assert all(abs(a[t] - b[t]) < 1e-4 for t in a)


def test_compile_is_refused_by_name_for_split_models_and_bad_values():
    model = long_model("llama_gqa")
    with pytest.raises(ValueError, match="compile must be"):
        LLMEngine(model, num_blocks=8, compile=3)


def test_no_graph_break_is_logged():
    """What a user checks: TORCH_LOGS=graph_breaks prints nothing for decode and mixed steps
    of Llama, Mistral (sliding window) and Falcon (fullgraph would also raise on one)."""
    script = (
        "import sys; sys.path[:0] = sys.argv[1:]\n"
        "from hf_paged import LLM, SamplingParams\n"
        "from conftest import make_model\n"
        "for kind in ('llama_gqa', 'mistral_sw', 'falcon_mq'):\n"
        "    import torch; torch._dynamo.reset()\n"
        "    llm = LLM(make_model(kind), block_size=4, num_blocks=64, max_num_seqs=4,\n"
        "              max_num_batched_tokens=16, compile='eager')\n"
        "    outs = llm.generate([[5, 6, 7] * k for k in range(1, 7)],\n"
        "                        SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)\n"
        "    assert all(o.error is None for o in outs), [o.error for o in outs]\n"
        "print('done')\n")
    tests = Path(__file__).resolve().parent.parent
    env = dict(os.environ, TORCH_LOGS="graph_breaks")
    result = subprocess.run([sys.executable, "-c", script, str(tests), str(tests / "engine")],
                            capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "done" in result.stdout
    assert "Graph break" not in result.stderr, result.stderr[-3000:]


_captured = []  # (graph, example inputs) the backend below was given


@torch._dynamo.register_backend(name="hf_paged_test_capture")
def _capture(gm, example_inputs):
    _captured.append((gm, example_inputs))
    return gm.forward


@pytest.mark.parametrize("kv_cache_dtype", [None, "int8"])
def test_a_compiled_forward_writes_into_the_pool_itself(kv_cache_dtype):
    """The traced forward takes the pool as one input, slices each layer's views from it
    and writes through one op on it. (Per-layer views lifted as inputs of their own alias
    one another, and an in-place write into a view of an input is functionalized: Inductor
    then copied a layer's whole pool every step.)"""
    captured = _captured
    captured.clear()
    model = long_model("llama_gqa")
    llm = LLM(model, block_size=4, num_blocks=60, max_num_seqs=4, max_num_batched_tokens=16,
              compile="hf_paged_test_capture", kv_cache_dtype=kv_cache_dtype)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    outs = llm.generate(random_prompts(2, 6, 3, 20), params, use_tqdm=False)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    shard = llm.engine.runner.pool.shards[0]
    write = torch.ops.hf_paged.write_layer_kv.default
    assert captured
    for gm, inputs in captured:
        nodes = list(gm.graph.nodes)
        pool = [n for n, t in zip([n for n in nodes if n.op == "placeholder"], inputs)
                if isinstance(t, torch.Tensor)
                and t.untyped_storage().data_ptr() == shard.untyped_storage().data_ptr()]
        assert len(pool) == 1 and pool[0].meta["example_value"].shape == shard.shape
        assert sum(n.target is write for n in nodes) == model.config.num_hidden_layers
        derived = set(pool)  # the pool and every view sliced from it
        for n in nodes:
            if n.args and n.args[0] in derived and n.target is not write:
                derived.add(n)
                assert not str(n.target).endswith("_"), f"in-place {n.target} on the pool"


def test_serve_takes_compile():
    from hf_paged.serving.serve import engine_options, parser

    assert engine_options(parser().parse_args(["m", "--compile"]))["compile"] is True
    assert engine_options(parser().parse_args(["m"]))["compile"] is False


def test_generate_with_compile_config_keeps_the_paged_cache_eager():
    """Transformers compiles generate's forward only for a compileable cache: a PagedCache
    is not one (its block tables change shape), so a compile_config leaves it eager."""
    from transformers import CompileConfig

    model = long_model("llama_gqa")
    ids = torch.tensor([random_prompts(9, 1, 12, 12)[0]])
    calls = []
    original = model.get_compiled_call

    def spy(config):
        calls.append(config)
        return original(config)

    model.get_compiled_call = spy
    try:
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                             do_sample=False, pad_token_id=0, cache_implementation="paged",
                             compile_config=CompileConfig(fullgraph=True))
    finally:
        del model.get_compiled_call
    assert calls == []
    assert out[0, ids.shape[1]:].tolist() == stock_greedy(model, ids[0].tolist(), 6)


@pytest.mark.parametrize("kind", ["llama_gqa", "mistral_sw", "falcon_alibi"])
def test_compiled_engine_with_triton_kernels_equals_eager_and_stock(kind):
    """The Triton backend (on a GPU where there is one, else under TRITON_INTERPRET) traces
    as one op per kernel launch: no graph break (fullgraph) for decode, prefill and mixed
    steps, the eager tokens, sliding windows and ALiBi included. Five of the workload's
    prompts (every kind of step still occurs): the interpreter costs a few ms per launch."""
    pytest.importorskip("triton")
    model = long_model(kind)  # (shared with other tests: back on the CPU afterwards)
    try:
        model.to("cuda" if torch.cuda.is_available() else "cpu")
        count = 5
        prompts, max_tokens, _ = workload(count=count)
        compiled, _ = run(model, CAPTURE, backend="triton", count=count)  # (a graph break fails it)
        assert 0 < graphs() <= MAX_GRAPHS
        assert compiled == run(model, False, backend="triton", count=count)[0]
        assert compiled == [stock_greedy(model, p, m) for p, m in zip(prompts, max_tokens)]
    finally:
        model.to("cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_engine_on_cuda_equals_eager():
    """On a GPU (benchmarks/gpu_check.sh): Inductor's compiled forward with the GPU's own
    attention backends, greedy tokens equal to eager in float32."""
    from conftest import make_model

    model = make_model("llama_gqa", max_position_embeddings=1400).cuda()
    eager, _ = run(model, False)
    compiled, _ = run(model, True)
    assert compiled == eager


def test_requests_naming_lora_adapters_run_eagerly_in_a_compiled_engine():
    """PEFT picks a request's adapter through forward hooks Dynamo cannot trace: those
    forwards run eagerly, the others compiled; every request gets the eager tokens."""
    from hf_paged.engine import BASE
    from test_engine import two_adapter_model

    model = two_adapter_model("a", "b")
    model.set_adapter("a")
    prompts = random_prompts(3, 4, 2, 12)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    results = []
    for compile in (False, CAPTURE):
        engine = LLMEngine(model, block_size=4, num_blocks=120, max_num_seqs=6,
                           compile=compile)
        for i, (p, name) in enumerate(zip(prompts, ["a", "b", BASE, None])):
            engine.add_request(str(i), p, params, adapter=name)
        done = run_engine(engine, [], [])
        assert all(done[str(i)].error is None for i in range(4))
        results.append([done[str(i)].outputs[0].token_ids for i in range(4)])
    assert results[0] == results[1]


def test_set_adapter_under_a_compiled_engine_runs_the_new_active_adapter():
    """A PEFT model's adapters change in place while it serves (switched, disabled,
    merged), so its compiled graphs keep the guards on the model: after `set_adapter`
    requests of the newly active adapter must not run graphs traced with the old one, and
    every request keeps the eager tokens of the adapter it names."""
    from test_engine import two_adapter_model

    model = two_adapter_model("a", "b")
    model.set_adapter("a")
    prompts = random_prompts(3, 4, 2, 12)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    names = ["a", "b", "a", "b"]

    def tokens(engine):
        for i, (p, name) in enumerate(zip(prompts, names)):
            engine.add_request(str(i), p, params, adapter=name)
        done = run_engine(engine, [], [])
        assert all(done[str(i)].error is None for i in range(len(prompts)))
        return [done[str(i)].outputs[0].token_ids for i in range(len(prompts))]

    engines = [LLMEngine(model, block_size=4, num_blocks=120, max_num_seqs=6,
                         enable_prefix_caching=False, compile=compile)
               for compile in (False, CAPTURE)]
    before = [tokens(e) for e in engines]
    assert before[0] == before[1]
    model.set_adapter("b")
    after = [tokens(e) for e in engines]
    assert after[0] == after[1] == before[0]
    fresh = LLMEngine(model, block_size=4, num_blocks=120, max_num_seqs=6,
                      enable_prefix_caching=False, compile=CAPTURE)
    assert tokens(fresh) == before[0]


def test_a_hook_added_to_a_peft_model_while_it_serves_reaches_its_compiled_forward():
    """A PEFT model's graphs follow it as it changes in place, hooks included (Dynamo leaves
    module hooks unguarded by default): after a hook forcing token 7 on the head, the
    compiled engine gives the eager engine's sevens, and after it is removed, the tokens of
    before."""
    from test_engine import two_adapter_model

    model = two_adapter_model("a", "b")
    prompt = random_prompts(5, 1, 6, 6)[0]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    engines = [LLMEngine(model, block_size=4, num_blocks=60, enable_prefix_caching=False,
                         compile=compile) for compile in (False, CAPTURE)]

    def tokens():
        result = []
        for engine in engines:
            engine.add_request("r", prompt, params)
            result.append(run_engine(engine, [], [])["r"].outputs[0].token_ids)
        return result

    before = tokens()
    assert before[0] == before[1] and before[0] != [7] * 5
    head = model.base_model.model.lm_head
    hook = head.register_forward_hook(lambda m, a, out: out.index_fill(-1, torch.tensor([7]), 1e4))
    assert tokens() == [[7] * 5] * 2
    hook.remove()
    assert tokens() == before
    assert engines[1].runner.compiled is not None  # (compiled all along)


def test_the_compiled_forward_guards_its_inputs_not_the_model():
    """The guards a compiled forward re-checks every call keep the inputs (ids, positions,
    the metadata: what tells one step's graph from another's) and the ambient state
    (unnamed: grad mode, global settings, symbolic sizes); those on the model (weights,
    modules, attributes) and on globals are left out (the entry point's key holds them)."""
    from types import SimpleNamespace

    from hf_paged.engine.compiled import not_on_weights, on_inputs

    names = ["module._modules['model']._modules['norm']._parameters['weight']",
             "L['module']._modules['model']._modules['rotary_emb']._buffers['inv_freq']",
             "inputs['input_ids']", "L['inputs']['input_ids']",
             "inputs['past_key_values'].meta.seq_lens",
             "module._modules['model']._modules['layers']._modules['0']._modules['mlp']",
             "module._modules['model']._modules['norm'].variance_epsilon",
             "G['__import_torch'].compiler", "",
             "dict(type(module._modules['model']).__dict__)['forward']"]
    kept = on_inputs([SimpleNamespace(name=n) for n in names])
    assert kept == [False, False, True, True, True, False, False, False, True, False]
    # A PEFT model's graphs keep all but the weights' guards.
    kept = not_on_weights([SimpleNamespace(name=n) for n in names])
    assert kept == [False, False, True, True, True, True, True, True, True, True]


def test_the_entry_points_key_sees_what_the_dropped_guards_saw():
    """`model_state`, the compiled entry point's key, changes with a module's plain
    attribute, a list or dict of plain values on it (PEFT's active adapters), a hook, the
    config and the training flag; the same model, unchanged, gives the same key."""
    from conftest import make_model

    from hf_paged.engine.compiled import model_state

    model = make_model("llama_gqa")
    attention = model.model.layers[0].self_attn
    seen = {model_state(model)}
    assert model_state(model) in seen
    changes = [lambda: setattr(attention, "tags", ["a"]),
               lambda: attention.tags.append("b"),
               lambda: setattr(attention, "table", {"a": 1}),
               lambda: attention.table.update(a=2),
               lambda: setattr(attention, "scaling", attention.scaling * 2),
               lambda: attention.register_forward_pre_hook(lambda *args: None),
               lambda: setattr(model.config, "rms_norm_eps", 1e-3),
               lambda: model.train()]
    for change in changes:
        change()
        state = model_state(model)
        assert state not in seen
        seen.add(state)


def test_a_model_changed_between_compiled_engines_gets_graphs_of_its_own():
    """The guards leave the model out, so the entry point is keyed by its state when an
    engine starts: an engine built after a forward hook is added, or after a module's
    attribute is set, must trace anew (and give the eager tokens of the changed model), not
    run the graphs an earlier engine traced before the change."""
    from conftest import make_model

    model = make_model("llama_gqa")
    prompts = random_prompts(7, 3, 3, 10)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    def tokens(compile):
        engine = LLMEngine(model, block_size=4, num_blocks=60, max_num_seqs=4,
                           compile=compile)
        done = run_engine(engine, prompts, [params] * len(prompts))
        assert compile is False or engine.runner.compile_error is None
        return [done[str(i)].outputs[0].token_ids for i in range(len(prompts))]

    first = tokens(CAPTURE)
    assert first == tokens(False)
    forced = 7  # a hook on the head makes every greedy token this one
    hook = model.lm_head.register_forward_hook(
        lambda module, args, out: out.index_fill(-1, torch.tensor([forced]), 1e4))
    before = graphs()
    hooked = tokens(CAPTURE)
    assert hooked == tokens(False) == [[forced] * 4] * len(prompts)
    assert graphs() > before
    hook.remove()
    for layer in model.model.layers:  # the residual stream outweighs what the layers add
        layer.input_layernorm.variance_epsilon = layer.post_attention_layernorm.variance_epsilon = 1e4
    scaled = tokens(CAPTURE)
    assert scaled == tokens(False) and scaled != first


@pytest.mark.parametrize("backend", [CAPTURE, pytest.param("inductor", marks=pytest.mark.slow)])
def test_engines_of_two_sizes_in_one_process_each_get_their_own_graphs(backend):
    """Two compiled engines on models of one class but other widths, one after the other
    in one process (Dynamo's cache not reset): the second must not run the first's graphs
    (their guards leave the weights out), and both give the eager tokens."""
    from conftest import make_model

    prompts = random_prompts(5, 3, 3, 10)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    compiled_before = 0
    for intermediate in (128, 192):  # (the same head size: only the MLP's weights differ)
        model = make_model("llama_gqa", intermediate_size=intermediate)
        tokens = []
        for compile in (False, backend):
            engine = LLMEngine(model, block_size=4, num_blocks=60, max_num_seqs=4,
                               compile=compile)
            done = run_engine(engine, prompts, [params] * len(prompts))
            assert all(done[str(i)].error is None for i in range(len(prompts)))
            tokens.append([done[str(i)].outputs[0].token_ids for i in range(len(prompts))])
        assert tokens[0] == tokens[1]
        assert graphs() > compiled_before  # its own graphs, not the other engine's
        compiled_before = graphs()


def test_a_workload_of_more_graphs_than_dynamos_default_limit_is_served(monkeypatch):
    """A varied workload takes more graphs than a low recompile limit (Dynamo's default of 8
    is reached by some models): a compiled engine raises the limit rather than fail the
    requests of the step past it (fullgraph)."""
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 2)
    model = long_model("llama_gqa")
    eager, _ = run(model, False, num_blocks=24)
    compiled, _ = run(model, CAPTURE, num_blocks=24)  # fails its requests at the limit
    assert compiled == eager and graphs() > 2


def test_pools_of_other_kinds_on_one_model_get_entry_points_of_their_own():
    """An int8 pool's engine on a model another engine compiled for its float pool: graphs
    of its own (an entry point per pool kind, block size and backends), the eager tokens."""
    from hf_paged.engine.compiled import _COMPILED

    from conftest import make_model

    model = make_model("llama_gqa", max_position_embeddings=1400)  # its own: no other entries
    for kv in ("auto", "int8"):
        eager, _ = run(model, False, kv_cache_dtype=kv)
        assert run(model, CAPTURE, kv_cache_dtype=kv)[0] == eager
    keys = _COMPILED[model]
    assert len(keys) == 2 and {key[1][1] for key in keys} == {None, torch.int8}
