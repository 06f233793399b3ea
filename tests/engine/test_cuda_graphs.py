"""Decode steps replayed from per-bucket graphs (`cuda_graphs=True`, engine/graphs.py).

On CPU the graphs are aten-level traces (`TracedGraph`): like a CUDA graph, a trace keeps
the ops and the tensors they touch and drops every Python decision taken while it was
made, so a value of one step baked into a graph shows as a wrong token in a later one.
These tests check what CUDA capture does not change: the static buffers, padded rows and
their spare block, bucket choice, and tokens equal to the eager engine and stock generate.
The last test captures real CUDA graphs (GPU only, also run by benchmarks/gpu_check.sh).
"""

from __future__ import annotations

import functools

import pytest
import torch

from hf_paged import LLM, LLMEngine, SamplingParams
from hf_paged.engine import graphs as graphs_module
from hf_paged.engine.graphs import buckets
from test_engine import long_model, random_prompts, run_engine, stock_greedy
from zoo import make_arch


@pytest.fixture
def traced(monkeypatch):
    """Graphs on CPU: aten traces stand in for CUDA graphs."""
    monkeypatch.setattr(graphs_module, "capture_for", lambda device: graphs_module.TracedGraph)


def engine(model, cuda_graphs, **options):
    settings = dict(block_size=4, num_blocks=60, max_num_seqs=12, max_num_batched_tokens=32,
                    max_model_len=128, admission_headroom=0)
    settings.update(options)
    return LLMEngine(model, cuda_graphs=cuda_graphs, **settings)


def greedy_run(model, prompts, max_tokens, arrivals, cuda_graphs, **options):
    eng = engine(model, cuda_graphs, **options)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    done = run_engine(eng, prompts, params, arrivals)
    outs = [done[str(i)].outputs[0] for i in range(len(prompts))]
    assert all(o.finish_reason == "length" for o in outs), [done[str(i)].error
                                                             for i in range(len(prompts))]
    return [o.token_ids for o in outs], eng


def test_buckets():
    assert buckets(1) == [1]
    assert buckets(6) == [1, 2, 4, 6]
    assert buckets(20) == [1, 2, 4, 8, 16, 20]
    assert buckets(256)[:6] == [1, 2, 4, 8, 16, 24] and buckets(256)[-1] == 256


@pytest.mark.parametrize("kind", ["llama_gqa", "mistral_sw", "falcon_alibi"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_graphs_equal_eager_and_stock(traced, kind, mode):
    """Batches that grow and shrink through several buckets (requests arrive and finish
    apart), chunked prompts, preemption and prefix hits: every token equals stock generate."""
    model = long_model(kind)
    system = random_prompts(50, 1, 10, 10)[0]
    prompts = random_prompts(5, 11, 1, 30, shared=system)
    max_tokens = [3 + (i * 7) % 17 for i in range(len(prompts))]
    arrivals = [(i * 4) % 13 for i in range(len(prompts))]
    stock = [stock_greedy(model, p, m) for p, m in zip(prompts, max_tokens)]
    tokens, eng = greedy_run(model, prompts, max_tokens, arrivals, True, preemption_mode=mode,
                             num_blocks=26 if kind != "mistral_sw" else 60)
    assert tokens == stock
    graphs = eng.runner.graphs
    stats = graphs.stats()
    assert stats["failed"] is None and stats["replays"] > 0
    assert len(stats["sizes"]) >= 3  # the batch went through several buckets
    assert eng.stats().num_preemptions > 0 or kind == "mistral_sw"
    assert eng.stats().prefix_cache_hit_tokens > 0


def test_padded_rows_leave_every_real_block_alone(traced):
    """The spare block is outside what the allocator hands out; padded rows (whose tables
    point there) change no other block: every block equals an engine's without graphs."""
    model = long_model("llama_gqa")
    prompts = random_prompts(8, 5, 3, 20)  # 5 rows: bucket 8, 3 padded rows a step
    plain = engine(model, False, enable_prefix_caching=False)
    eng = engine(model, True, enable_prefix_caching=False)
    assert eng.num_blocks == plain.num_blocks - 1  # one block of the budget is the spare one
    spare = eng.runner.graphs.pad_block
    assert spare == eng.num_blocks and eng.pool.kv.shape[2] == eng.num_blocks + 1
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for e in (plain, eng):
        for i, p in enumerate(prompts):
            e.add_request(str(i), p, params)
        while e.has_unfinished_requests():
            e.step()
    assert 8 in eng.runner.graphs.stats()["sizes"]
    # Both pools hold the same K/V in the same blocks (each engine filled the same ids),
    # up to float32 rounding: a padded batch's matmuls may sum in another order.
    used = plain.pool.blocks.peak_used
    torch.testing.assert_close(eng.pool.kv[:, :, :used], plain.pool.kv[:, :, :used],
                               rtol=1e-5, atol=1e-6)
    assert eng.pool.kv[:, :, used:spare].abs().sum() == 0  # and nothing elsewhere


def test_graphs_with_async_scheduling_and_seeded_sampling(traced):
    """Async scheduling fills the ids buffer from the last step's sampled tokens on the
    device; seeded sampling with n > 1, penalties and logprobs equals the eager engine."""
    model = long_model("llama_gqa")
    prompts = random_prompts(9, 7, 2, 25)
    params = [SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=100 + i, n=2,
                             max_tokens=4 + i % 5, ignore_eos=True, repetition_penalty=1.2,
                             logprobs=2) for i in range(len(prompts))]
    results = []
    for graphs, async_scheduling in ((False, False), (True, True), (True, False)):
        eng = engine(model, graphs, async_scheduling=async_scheduling)
        done = run_engine(eng, prompts, params, [i % 3 for i in range(len(prompts))])
        results.append([c for i in range(len(prompts)) for c in done[str(i)].outputs])
        if graphs:
            assert eng.runner.graphs.stats()["replays"] > 0
    for other in results[1:]:  # the same tokens; log-probabilities up to a padded batch's
        for got, want in zip(other, results[0]):  # float32 rounding
            assert got.token_ids == want.token_ids
            for a, b in zip(got.logprobs, want.logprobs):
                assert a.keys() == b.keys()
                assert all(abs(a[t] - b[t]) < 1e-4 for t in a)


def test_graphs_with_kv_groups_and_8bit_blocks(traced):
    """A hybrid model (one table per KV group in the buffers) and an 8-bit pool."""
    gemma = make_arch("gemma3")
    prompts = random_prompts(3, 5, 4, 30)
    max_tokens = [6, 9, 4, 12, 7]
    stock = [stock_greedy(gemma, p, m) for p, m in zip(prompts, max_tokens)]
    tokens, eng = greedy_run(gemma, prompts, max_tokens, [0, 0, 2, 3, 5], True)
    assert tokens == stock and len(eng.runner.graphs.tables) > 1
    llama = long_model("llama_gqa")
    prompts = random_prompts(4, 6, 4, 30)
    plain, _ = greedy_run(llama, prompts, [8] * 6, [0] * 6, False, kv_cache_dtype="int8")
    tokens, eng = greedy_run(llama, prompts, [8] * 6, [0] * 6, True, kv_cache_dtype="int8")
    assert tokens == plain and eng.runner.graphs.stats()["replays"] > 0


def test_prompt_logprob_steps_and_adapters_run_without_graphs(traced):
    """Forwards graphs do not take run as before, in the same engine."""
    model = long_model("llama_gqa")
    eng = engine(model, True)
    prompts = random_prompts(6, 3, 1, 1)  # one-token prompts: decode-shaped first steps
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, prompt_logprobs=1)
    done = run_engine(eng, prompts, params)
    for i, p in enumerate(prompts):
        assert done[str(i)].outputs[0].token_ids == stock_greedy(model, p, 5)


def test_a_failed_capture_falls_back_to_eager(monkeypatch):
    class Broken:
        def __init__(self, body, pool=None):
            raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphs_module, "capture_for", lambda device: Broken)
    model = long_model("llama_gqa")
    prompts = random_prompts(2, 3, 3, 10)
    tokens, eng = greedy_run(model, prompts, [5, 5, 5], [0, 0, 0], True)
    assert tokens == [stock_greedy(model, p, 5) for p in prompts]
    assert "stream is capturing" in eng.runner.graphs.stats()["failed"]


def test_options_are_checked():
    model = long_model("llama_gqa")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs the model on a CUDA device"):
            LLM(model, cuda_graphs=True, num_blocks=8)
    with pytest.raises(ValueError, match="cuda_graphs must be True, False or None"):
        LLM(model, cuda_graphs="yes", num_blocks=8)
    # The default on CPU, compiled or not: no graphs.
    assert LLM(model, num_blocks=8).engine.runner.graphs is None
    from hf_paged.serving.serve import engine_options, parser
    assert [engine_options(parser().parse_args(["m", *flags]))["cuda_graphs"]
            for flags in ([], ["--cuda-graphs"], ["--no-cuda-graphs"])] == [None, True, False]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("compile", [False, True])
def test_cuda_graphs_on_gpu_equal_eager(compile):
    """Real capture on a GPU, eager and compiled: tokens equal the engine without graphs,
    in float32, through buckets and preemption; capture time and memory are reported."""
    model = long_model("llama_gqa").to("cuda")
    try:
        prompts = random_prompts(12, 20, 2, 60)
        max_tokens = [4 + (i * 5) % 23 for i in range(len(prompts))]
        arrivals = [(i * 3) % 17 for i in range(len(prompts))]
        options = dict(num_blocks=40, max_num_seqs=16, compile=compile)
        plain, _ = greedy_run(model, prompts, max_tokens, arrivals, False, **options)
        tokens, eng = greedy_run(model, prompts, max_tokens, arrivals, True, **options)
        stats = eng.runner.graphs.stats()
        print(f"cuda graphs (compile={compile}): {stats}")
        assert stats["failed"] is None and stats["replays"] > 0
        assert tokens == plain
    finally:
        model.to("cpu")


def run_changing(prompts, params, changes, **options):
    """Greedy tokens by request of an engine on a copy of the Llama test model, with
    `changes[step](model)` applied before those steps (each while every request decodes
    and none waits); and the engine."""
    import copy

    model = copy.deepcopy(long_model("llama_gqa"))
    eng = engine(model, **options)
    for i, prompt in enumerate(prompts):
        eng.add_request(str(i), prompt, params)
    done, step = {}, 0
    while eng.has_unfinished_requests():
        if step in changes:
            assert not eng.scheduler.waiting and eng.scheduler.running
            changes[step](model)
        done.update({o.request_id: o.outputs[0].token_ids for o in eng.step() if o.finished})
        step += 1
    return done, eng


@pytest.mark.parametrize("options", [dict(cuda_graphs=True), dict(cuda_graphs=False,
                                                                   compile="eager")],
                         ids=["graphs", "compiled"])
def test_graphs_follow_weights_updated_or_replaced_between_steps(traced, options):
    """A graph reads the parameters it was captured with: an in-place update (an optimizer
    step) reaches it as it is, a replaced Parameter, `.data` or module makes it captured
    anew (and a compiled forward looked up anew), even while every request decodes and
    none waits. Tokens equal an eager engine's on a copy of the model changed alike, step
    for step."""
    import copy

    prompts = random_prompts(8, 4, 3, 9)
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)

    def change(model, step):  # (the engine's model: a copy of the test model)
        layers = model.model.layers
        if step == 4:  # in place
            with torch.no_grad():
                layers[0].mlp.down_proj.weight.mul_(1.5)
        elif step == 7:  # a new Parameter
            layers[1].mlp.up_proj.weight = torch.nn.Parameter(-layers[1].mlp.up_proj.weight)
        elif step == 10:  # new storage
            layers[0].self_attn.k_proj.weight.data = layers[0].self_attn.k_proj.weight * 0.5
        elif step == 12:  # a new layer in place of one
            mlp = layers[1].mlp = copy.deepcopy(layers[1].mlp)
            with torch.no_grad():
                mlp.gate_proj.weight.mul_(-2)

    changes = {step: functools.partial(change, step=step) for step in (4, 7, 10, 12)}
    eager, _ = run_changing(prompts, params, changes, cuda_graphs=False)
    graphed, eng = run_changing(prompts, params, changes, **options)
    assert eager == graphed
    assert eng.runner.compile_error is None
    assert eng.runner.graphs is None or eng.runner.graphs.stats()["replays"] > 8


@pytest.mark.parametrize("options", [dict(cuda_graphs=True), dict(cuda_graphs=False,
                                                                   compile="eager"),
                                     dict(cuda_graphs=True, compile="eager")],
                         ids=["graphs", "compiled", "compiled graphs"])
def test_an_adapter_put_into_the_model_between_steps_reaches_graphs_and_compiled_forwards(
        traced, tmp_path, options):
    """Loading an adapter into the model (Transformers' `load_adapter` replaces its layers
    in place), disabling and enabling it change the forward's path while every request
    decodes: graphs are captured anew and the compiled forward looked up anew (neither
    runs the path it was made with). Tokens equal an eager engine's changed alike."""
    import copy

    from peft import LoraConfig, TaskType, get_peft_model

    torch.manual_seed(21)
    get_peft_model(copy.deepcopy(long_model("llama_gqa")), LoraConfig(
        task_type=TaskType.CAUSAL_LM, r=4, target_modules="all-linear",
        init_lora_weights=False)).save_pretrained(tmp_path)
    prompts = random_prompts(9, 4, 3, 9)
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    changes = {4: lambda m: m.load_adapter(str(tmp_path)), 7: lambda m: m.disable_adapters(),
               10: lambda m: m.enable_adapters()}
    eager, _ = run_changing(prompts, params, changes, cuda_graphs=False)
    changed, eng = run_changing(prompts, params, changes, **options)
    assert eager == changed
    assert eng.runner.compile_error is None
