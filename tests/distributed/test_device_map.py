"""Models spread over devices (`device_map`): one KV pool shard per device.

The placement logic (which layer runs where, grouping into shards) is tested on CPU with
accelerate-style hooks; the split pool itself runs on CPU by giving the cache a placement
with several shards on the CPU, each metadata copy made real by a clone, and is compared
token by token with DynamicCache. Real device boundaries run where CUDA devices exist.
"""

from __future__ import annotations

import copy
import types

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

import hf_paged
from hf_paged import HFPagedError, PagedCache, Placement, SamplingParams, model_placement
from hf_paged.metadata import ForwardMetadata
from hf_paged.placement import (
    input_device, layer_devices, logits_index_device, normalize_device,
)
from conftest import assert_same, both, left_padded_batch, make_model
from test_engine import random_prompts, run_engine, stock_greedy

CPU = torch.device("cpu")
KINDS = ["llama_gqa", "mistral_sw", "falcon_mq", "falcon_new", "falcon_alibi"]
# Three shards, one of them holding layers that are not neighbours.
SPLIT = Placement((CPU, CPU, CPU), ((0, 3), (1,), (2,)))
_models: dict = {}


def four_layer_model(kind: str):
    if kind not in _models:
        _models[kind] = make_model(kind, num_hidden_layers=4)
        # The class's one-token route probe, here rather than inside a test counting copies.
        from hf_paged.hf.probe import route_reason
        assert route_reason(_models[kind]) is None
    return _models[kind]


@pytest.fixture
def split(monkeypatch):
    """Makes every model's KV placement SPLIT and every metadata copy a real one (a clone);
    counts forwards and copies."""
    counts = {"forwards": 0, "copies": 0}
    def placement(model, n):  # SPLIT, or even and odd layers for other depths
        return SPLIT if n == 4 else Placement((CPU, CPU), (tuple(range(0, n, 2)),
                                                           tuple(range(1, n, 2))))

    monkeypatch.setattr(hf_paged.integration, "model_placement", placement)
    monkeypatch.setattr(hf_paged.engine.runner, "model_placement", placement)

    def to(meta, device):
        counts["copies"] += 1
        return meta.map_tensors(torch.clone)

    monkeypatch.setattr(ForwardMetadata, "to", to)
    build = hf_paged.cache.build_metadata

    def counted(*args, **kwargs):
        counts["forwards"] += 1
        return build(*args, **kwargs)

    monkeypatch.setattr(hf_paged.cache, "build_metadata", counted)
    return counts


# -- placement logic ----------------------------------------------------------------------------
def test_placement_groups_layers_by_device_in_order_of_first_use():
    p = Placement.of_layers(["cuda:1", "cuda:1", torch.device("cuda", 0), "cuda:1", 0])
    assert p.devices == (torch.device("cuda", 1), torch.device("cuda", 0))
    assert p.layers == ((0, 1, 3), (2, 4))
    assert p.where == ((0, 0), (0, 1), (1, 0), (0, 2), (1, 1))
    assert p.primary == torch.device("cuda", 1) and not p.is_single
    assert Placement.of_layers(["cpu", "cpu:0", CPU]) == Placement.single(3, "cpu")
    assert Placement.of_layers(["cpu", "cpu:0", CPU]).is_single
    swap = p.on("cpu")
    assert swap.layers == p.layers and set(swap.devices) == {CPU}
    assert hash(p) == hash(Placement.of_layers(["cuda:1"] * 2 + ["cuda:0", "cuda:1", "cuda:0"]))


def test_placement_rejects_layers_missing_or_repeated():
    with pytest.raises(ValueError, match="layers 0..n-1 once each"):
        Placement((CPU,), ((0, 2),))
    with pytest.raises(ValueError, match="layers 0..n-1 once each"):
        Placement((CPU, CPU), ((0, 1), (1,)))
    with pytest.raises(ValueError, match="one layer list per device"):
        Placement((CPU,), ((0,), (1,)))
    with pytest.raises(ValueError, match="placement covers 3 layers"):
        hf_paged.kv_pool.KVPool(4, 2, 8, 4, 8, torch.float32, Placement.single(3, CPU), False)


def test_normalize_device():
    assert normalize_device("cpu:0") == CPU
    assert normalize_device(2) == torch.device(
        getattr(torch.accelerator.current_accelerator(), "type", "cuda"), 2)
    assert normalize_device("cuda:3") == torch.device("cuda", 3)


@pytest.mark.parametrize("kind", ["llama_gqa", "falcon_new", "deepseek_v3", "dbrx"])
def test_layer_devices_follow_accelerate_hooks_then_weights(kind):
    """(DeepSeek-V3's attention holds a latent KV projection, DBRX's a fused one.)"""
    from zoo import make_arch

    torch.manual_seed(0)
    model = (make_arch(kind, num_hidden_layers=4, n_layers=4) if kind in ("deepseek_v3", "dbrx")
             else type(four_layer_model(kind))(four_layer_model(kind).config)).eval()
    assert model_placement(model, 4) == Placement.single(4, CPU)  # not dispatched
    attention = [m for m in model.modules() if type(m).__name__.endswith("Attention")
                 and hasattr(m, "layer_idx")]
    assert len(attention) == 4
    # Layers 0-1 run on GPU 0 (an int, as accelerate writes it), layer 2 on cuda:1; layer 3's
    # hook chain (a SequentialHook) names cuda:1 in its second hook; none is a CPU weight.
    attention[0]._hf_hook = types.SimpleNamespace(execution_device=0)
    attention[1]._hf_hook = types.SimpleNamespace(execution_device=torch.device("cuda", 0))
    attention[2]._hf_hook = types.SimpleNamespace(execution_device="cuda:1")
    attention[3]._hf_hook = types.SimpleNamespace(
        hooks=[types.SimpleNamespace(), types.SimpleNamespace(execution_device="cuda:1")])
    model.hf_device_map = {"model.layers.0": 0, "model.layers.1": 0, "model.layers.2": 1,
                           "model.layers.3": "cpu"}
    accel = getattr(torch.accelerator.current_accelerator(), "type", "cuda")
    p = model_placement(model, 4)
    assert p.devices == (torch.device(accel, 0), torch.device("cuda", 1))
    assert p.layers == ((0, 1), (2, 3))
    # Without a hook, a layer runs where its attention weights are.
    del attention[2]._hf_hook
    assert layer_devices(model, 4)[2] == CPU


def test_offloaded_device_map_runs_on_one_pool_and_equals_stock(tmp_path, tokenizer,
                                                                monkeypatch):
    """A real accelerate dispatch on this machine: some layers on the CPU, some offloaded to
    disk (run on the CPU), the embeddings too (the model's first weight is then on "meta"):
    one shard; generate and the engine equal stock. The class's route probe runs on this
    model (its input goes where the hooks run it, not to the embeddings' "meta")."""
    monkeypatch.setattr(hf_paged.hf.probe, "_checked", {})
    four_layer_model("llama_gqa").save_pretrained(tmp_path / "m")
    device_map = {"model.embed_tokens": "disk", "model.layers.0": "cpu", "model.layers.1": "disk",
                  "model.layers.2": "cpu", "model.layers.3": "disk", "model.norm": "cpu",
                  "model.rotary_emb": "cpu", "lm_head": "cpu"}
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m", device_map=device_map,
                                                 offload_folder=str(tmp_path / "off")).eval()
    assert model.device.type == "meta" and input_device(model) == CPU
    assert model_placement(model) == Placement.single(4, CPU)
    ids, mask = left_padded_batch([5, 9, 2])
    for extra in (dict(do_sample=False), dict(num_beams=3, num_return_sequences=2)):
        ref, out = both(model, input_ids=ids, attention_mask=mask, max_new_tokens=8,
                        return_dict_in_generate=True, **extra)
        assert_same(ref, out)
        assert out.past_key_values.pool.placement.is_single
    engine = hf_paged.LLMEngine(model, block_size=4, num_blocks=64)
    assert engine.device == CPU and "logits_to_keep" in model._hf_hook.skip_keys
    prompts = [[5, 9, 14, 3], [40, 41, 42, 43, 44, 45, 46], [7]]
    done = run_engine(engine, prompts, SamplingParams(temperature=0, max_tokens=6,
                                                      ignore_eos=True))
    for i, prompt in enumerate(prompts):
        assert done[str(i)].outputs[0].token_ids == stock_greedy(model, prompt, 6)


def test_a_class_first_served_after_accelerate_hooked_its_model(tmp_path, monkeypatch):
    """accelerate's hooks call the forward a module had when the model was dispatched: the
    forward of a class hf-paged wraps at its first paged call (all but Llama, Mistral and
    Falcon), wrapped after that, was not reached (HFPagedError: the cache not prepared)."""
    from hf_paged.generate import patches
    from zoo import make_arch

    model = make_arch("qwen3")
    model.save_pretrained(tmp_path / "m")
    for owner in (type(model), type(model.model)):  # as in a process new to the class
        if (owner, "forward") in patches._originals:
            monkeypatch.setattr(owner, "forward", patches._originals[owner, "forward"])
            monkeypatch.delitem(patches._originals, (owner, "forward"))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "m", device_map={"": "disk"},
                                                 offload_folder=str(tmp_path / "off")).eval()
    ids, mask = left_padded_batch([5, 9, 2])
    assert_same(*both(model, input_ids=ids, attention_mask=mask, max_new_tokens=6,
                      do_sample=False, return_dict_in_generate=True))


@pytest.mark.parametrize("offload", ["cpu_offload", "disk_offload"])
def test_a_model_offloaded_module_by_module_runs_where_its_hooks_run_it(
        tmp_path, monkeypatch, offload):
    """accelerate's cpu_offload / disk_offload hook every module (not the model, and no
    `hf_device_map`): the KV pool and the inputs go to the hooks' execution device."""
    import accelerate

    monkeypatch.setattr(hf_paged.hf.probe, "_checked", {})
    model = copy.deepcopy(four_layer_model("llama_gqa"))
    if offload == "cpu_offload":
        accelerate.cpu_offload(model, execution_device=CPU)
    else:
        accelerate.disk_offload(model, str(tmp_path / "off"), execution_device=CPU)
    assert model.device.type == "meta" and input_device(model) == CPU
    assert model_placement(model) == Placement.single(4, CPU)
    ids, mask = left_padded_batch([5, 9, 2])
    ref, out = both(model, input_ids=ids, attention_mask=mask, max_new_tokens=6,
                    do_sample=False, return_dict_in_generate=True)
    assert isinstance(out.past_key_values, PagedCache)
    assert_same(ref, out)
    prompts = [[5, 9, 14, 3, 8, 1], [7]]
    engine = hf_paged.LLMEngine(model, block_size=4, num_blocks=64)
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    done = run_engine(engine, prompts, greedy)
    for i, prompt in enumerate(prompts):
        assert done[str(i)].outputs[0].token_ids == stock_greedy(model, prompt, 5)
    # The hooks load new tensors each forward, but no weight changed: prefixes are reused.
    assert run_engine(engine, prompts[:1], greedy)["0"].outputs[0].token_ids == \
        done["0"].outputs[0].token_ids
    assert engine.stats().prefix_cache_hit_tokens == 4


def test_logits_index_stays_on_the_host_past_accelerate_hooks():
    """The final norm of a dispatched model may sit on another device than the inputs: the
    index of the rows to keep must not be moved to the input device by the top hook."""
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    seen = {}

    class Top(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values=None, logits_to_keep=0):
            seen.update(ids=input_ids.device, keep=logits_to_keep.device)
            return input_ids

    top = Top()
    add_hook_to_module(top, AlignDevicesHook(execution_device="meta",
                                             skip_keys="past_key_values"))
    assert input_device(top) == torch.device("meta")
    top(input_ids=torch.tensor([[1, 2]]), logits_to_keep=torch.tensor([1]))
    assert seen == {"ids": torch.device("meta"), "keep": torch.device("meta")}  # as it was
    assert logits_index_device(top) == CPU
    top(input_ids=torch.tensor([[1, 2]]), logits_to_keep=torch.tensor([1]))
    assert seen == {"ids": torch.device("meta"), "keep": CPU}
    assert top._hf_hook.skip_keys == ["past_key_values", "logits_to_keep"]
    plain = four_layer_model("llama_gqa")
    assert logits_index_device(plain) == plain.device == input_device(plain)


# -- a pool split in shards ---------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", ["greedy", "beams", "sample", "return_sequences"])
def test_split_pool_generate_equals_stock(kind, mode, split):
    model = four_layer_model(kind)
    ids, mask = left_padded_batch([6, 11, 1, 8], seed=3)
    extra = {"greedy": dict(do_sample=False),
             "beams": dict(num_beams=3, do_sample=False),
             "sample": dict(do_sample=True, top_k=20),
             "return_sequences": dict(do_sample=True, num_return_sequences=3)}[mode]
    ref, out = both(model, seed=5, input_ids=ids, attention_mask=mask, max_new_tokens=12,
                    return_dict_in_generate=True, **extra)
    assert_same(ref, out)
    cache = out.past_key_values
    assert cache.pool.placement == SPLIT
    assert [kv.shape[0] for kv in cache.pool.shards] == [2, 1, 1]
    # One copy of the metadata per shard per forward, not per layer.
    assert split["forwards"] > 0 and split["copies"] == 3 * split["forwards"]
    stats = cache.memory_stats()
    (cpu,) = stats.devices.values()  # three shards, all on the CPU here
    assert cpu.device == "cpu" and cpu.num_layers == 4
    assert cpu.pool_bytes == stats.pool_bytes == cache.pool.nbytes
    assert cpu.kv_bytes_in_use == stats.kv_bytes_in_use > 0
    assert cpu.bytes_per_token == stats.bytes_per_token


def test_memory_stats_per_device():
    """Figures per device for layers 0-2 on one device and layer 3 on another (the meta
    device stands in: the accounting needs no forward)."""
    model = four_layer_model("llama_gqa")
    placement = Placement((CPU, torch.device("meta")), ((0, 1, 2), (3,)))
    cache = PagedCache(model.config, {"block_size": 4, "num_blocks": 10}, dtype=torch.float16,
                       placement=placement)
    cache.tables.resize(2)
    cache.tables.append([5, 9])  # 2 + 3 blocks
    stats = cache.memory_stats()
    per_layer = 2 * 2 * 16 * 2  # K+V, KV heads, head_dim, float16: bytes per token per layer
    assert stats.bytes_per_token == 4 * per_layer and stats.blocks_in_use == 5
    assert stats.devices == {
        "cpu": hf_paged.DeviceMemory("cpu", 3, 3 * per_layer, 10 * 4 * 3 * per_layer,
                                     5 * 4 * 3 * per_layer),
        "meta": hf_paged.DeviceMemory("meta", 1, per_layer, 10 * 4 * per_layer,
                                      5 * 4 * per_layer),
    }
    assert sum(d.kv_bytes_in_use for d in stats.devices.values()) == stats.kv_bytes_in_use
    assert sum(d.pool_bytes for d in stats.devices.values()) == stats.pool_bytes


@pytest.mark.parametrize("kind", ["llama_gqa", "falcon_new"])
def test_each_shard_holds_the_keys_of_its_layers(kind):
    model = four_layer_model(kind)
    ids = torch.randint(3, 90, (2, 13), generator=torch.Generator().manual_seed(1))
    cache = PagedCache(model.config, {"block_size": 4}, placement=SPLIT)
    ref = DynamicCache(config=model.config)
    with torch.no_grad(), hf_paged.integration.paged_attention(model):
        paged_logits = model(ids, past_key_values=cache).logits
    with torch.no_grad():
        ref_logits = model(ids, past_key_values=ref).logits
    torch.testing.assert_close(paged_logits, ref_logits, rtol=1e-5, atol=1e-5)
    bs = cache.block_size
    for layer in range(4):
        shard, index = SPLIT.where[layer]
        kv = cache.pool.shards[shard][index]  # [2, NB, bs, Hkv, D]
        for row in range(2):
            slots = torch.tensor([b * bs + i for b in cache.tables.tables[row] for i in range(bs)])
            stored = kv[0].reshape(-1, *kv.shape[-2:])[slots[:13]]  # [13, Hkv, D]
            expected = ref.layers[layer].keys[row].transpose(0, 1)  # [13, Hkv', D]
            if expected.shape[1] != stored.shape[1]:  # Falcon broadcasts KV heads before caching
                expected = expected[:, :: expected.shape[1] // stored.shape[1]]
            torch.testing.assert_close(stored, expected)


def test_sized_split_pool_budget_covers_all_devices(split):
    model = four_layer_model("llama_gqa")
    ids, mask = left_padded_batch([4, 7])
    per_block = 4 * 2 * 2 * 16 * 8 * 4  # layers, K+V, KV heads, head_dim, block, float32
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5,
                         cache_implementation="paged", return_dict_in_generate=True,
                         cache_config={"block_size": 8, "max_kv_bytes": 10 * per_block})
    pool = out.past_key_values.pool
    assert pool.blocks.num_blocks == 10 and pool.nbytes == 10 * per_block
    assert [kv.shape[2] for kv in pool.shards] == [10, 10, 10]
    again = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5,
                           cache_implementation="paged", return_dict_in_generate=True,
                           cache_config={"block_size": 8, "max_kv_bytes": 10 * per_block})
    assert again.past_key_values.pool is pool  # the model's sized pool is kept
    assert_same(out, model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5))


def test_a_cache_passed_to_generate_takes_the_model_placement(split):
    model = four_layer_model("mistral_sw")
    ids, mask = left_padded_batch([9, 3])
    cache = PagedCache(model.config)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10,
                         past_key_values=cache)
    assert cache.pool.placement == SPLIT
    assert_same(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10), out)


def test_keys_on_another_device_than_their_shard_are_a_named_error():
    model = four_layer_model("llama_gqa")
    on_meta = Placement((CPU, torch.device("meta")), ((0, 1), (2, 3)))
    cache = PagedCache(model.config, placement=on_meta)
    with pytest.raises(HFPagedError, match="Layer 2 computed its keys on cpu, but its KV pool "
                                           "is on meta"):
        with torch.no_grad(), hf_paged.integration.paged_attention(model):
            model(torch.tensor([[5, 6, 7]]), past_key_values=cache)


def test_metadata_copy_moves_every_tensor():
    """ForwardMetadata.to(device) carries every tensor, parts included (the meta device
    shows any left behind)."""
    model = four_layer_model("llama_gqa")
    from hf_paged.engine import LLMEngine

    engine = LLMEngine(model, block_size=4, num_blocks=64)
    meta = engine.runner.metadata([0, 1], [0, 3], [5, 1])[0]  # parts: the decode, the chunk
    assert meta.parts is not None
    meta.key_hidden = torch.zeros(2, 8, dtype=torch.bool)
    moved = meta.to(torch.device("meta"))

    def tensors(m):
        for name, value in vars(m).items():
            if isinstance(value, torch.Tensor):
                yield name, value
        for part, positions in m.parts or ():
            yield "positions", positions
            yield from tensors(part)

    found = dict(tensors(moved))
    assert {"block_tables", "slot_mapping", "seq_lens", "query_pos", "positions",
            "key_hidden"} <= set(found)
    assert all(t.device.type == "meta" for _, t in tensors(moved))
    assert meta.to(CPU) is meta


# -- the engine on a split pool -----------------------------------------------------------------
@pytest.mark.parametrize("kind", ["llama_gqa", "falcon_alibi"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_engine_on_a_split_pool_equals_stock(kind, mode, split):
    model = four_layer_model(kind)
    system = [7 + i % 50 for i in range(20)]
    prompts = random_prompts(2, 10, 1, 40, shared=system)
    max_tokens = [10 + (i * 5) % 13 for i in range(len(prompts))]
    refs = [stock_greedy(model, p, m) for p, m in zip(prompts, max_tokens)]
    engine = hf_paged.LLMEngine(model, block_size=4, num_blocks=30, max_num_seqs=5,
                       max_num_batched_tokens=32, preemption_mode=mode,
                       admission_headroom=0)  # admit eagerly: preempt often
    assert engine.pool.placement == SPLIT
    if mode == "swap":
        assert engine.cpu_pool.placement.layers == SPLIT.layers
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    done = run_engine(engine, prompts, params, [(i * 3) % 11 for i in range(len(prompts))])
    for i, ref in enumerate(refs):
        assert done[str(i)].outputs[0].token_ids == ref, f"request {i}"
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hit_tokens > 0
    assert stats.blocks_used == 0


# -- real device boundaries ---------------------------------------------------------------------
def _dispatched(device_map: dict, main_device):
    import accelerate

    model = copy.deepcopy(four_layer_model("llama_gqa"))
    return accelerate.dispatch_model(model, device_map=device_map, main_device=main_device)


def _check_dispatched(model, expected_devices):
    placement = model_placement(model, 4)
    assert [str(d) for d in placement.devices] == expected_devices
    ids, mask = left_padded_batch([5, 12, 3])
    ids, mask = ids.to(model.device), mask.to(model.device)
    for extra in (dict(do_sample=False), dict(num_beams=3, num_return_sequences=2)):
        ref, out = both(model, input_ids=ids, attention_mask=mask, max_new_tokens=10,
                        return_dict_in_generate=True, **extra)
        assert_same(ref, out)
        stats = out.past_key_values.memory_stats()
        assert list(stats.devices) == expected_devices
        assert [d.num_layers for d in stats.devices.values()] == [2, 2]
    engine = hf_paged.LLMEngine(model, block_size=16, num_blocks=64)
    assert engine.pool.placement == placement
    prompts = random_prompts(4, 6, 1, 40)
    done = run_engine(engine, prompts, SamplingParams(temperature=0, max_tokens=8,
                                                      ignore_eos=True))
    for i, prompt in enumerate(prompts):
        assert done[str(i)].outputs[0].token_ids == stock_greedy(model, prompt, 8)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_layers_on_cpu_and_gpu():
    """Layers 0-1 run on the CPU, 2-3 on the GPU: metadata built on the CPU, copied to the
    GPU once per forward; each device attends with its own backend."""
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu",
                  "model.layers.1": "cpu", "model.layers.2": 0, "model.layers.3": 0,
                  "model.norm": 0, "lm_head": 0}
    model = _dispatched(device_map, "cpu")
    _check_dispatched(model, ["cpu", "cuda:0"])
    # Asking for Triton by name: the GPU layers get it, the CPU layers the reference.
    ids, mask = left_padded_batch([5, 12, 3])
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10,
                         do_sample=False, cache_implementation="paged",
                         cache_config={"backend": "triton"}, return_dict_in_generate=True)
    assert [b.name for b in out.past_key_values._backends] == ["torch", "triton"]
    assert_same(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10,
                               do_sample=False), out)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_layers_on_two_gpus():
    device_map = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0,
                  "model.layers.1": 0, "model.layers.2": 1, "model.layers.3": 1,
                  "model.norm": 1, "lm_head": 1}
    model = _dispatched(device_map, 0)
    _check_dispatched(model, ["cuda:0", "cuda:1"])


def test_serve_loads_with_a_device_map(tmp_path, capsys):
    from hf_paged import serve

    four_layer_model("falcon_new").save_pretrained(tmp_path / "m")
    for spec in ("auto", '{"": "cpu"}'):
        args = serve.parser().parse_args([str(tmp_path / "m"), "--device-map", spec])
        model, _ = serve.load(args)
        assert model_placement(model, 4) == Placement.single(4, CPU)
    with pytest.raises(SystemExit):
        serve.parser().parse_args([str(tmp_path / "m"), "--device-map", "everywhere"])
    assert "expected auto, balanced" in capsys.readouterr().err
    args = serve.parser().parse_args([str(tmp_path / "m"), "--device-map", "auto",
                                      "--device", "cpu"])
    with pytest.raises(SystemExit, match="cannot be combined with --device"):
        serve.load(args)


@pytest.mark.parametrize("kind", ["llama_gqa", "falcon_mq"])
def test_split_pool_assisted_prompt_lookup_and_streaming(kind, split):
    from transformers.generation.streamers import BaseStreamer

    class Collect(BaseStreamer):
        def __init__(self):
            self.chunks = []

        def put(self, value):
            self.chunks.append(value.clone())

        def end(self):
            pass

    model = four_layer_model(kind)
    assistant = make_model(kind, seed=4)  # a two-layer draft model: its own split pool
    ids = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 10, 11, 5, 6]])
    for extra in (dict(assistant_model=assistant), dict(prompt_lookup_num_tokens=3)):
        ref, out = both(model, input_ids=ids, max_new_tokens=12, do_sample=False, **extra)
        assert_same(ref, out)
    streamer = Collect()
    out = model.generate(input_ids=ids, max_new_tokens=6, do_sample=False, streamer=streamer,
                         cache_implementation="paged")
    assert torch.equal(torch.cat([c.reshape(-1) for c in streamer.chunks]), out[0])


@pytest.mark.parametrize("method", ["lora", "prefix"])
def test_split_pool_serves_peft_adapters(method, split):
    from peft import LoraConfig, PrefixTuningConfig, TaskType, get_peft_model

    base = make_model("llama_gqa", num_hidden_layers=4)
    config = (LoraConfig(task_type=TaskType.CAUSAL_LM, r=4, target_modules="all-linear",
                         init_lora_weights=False) if method == "lora"
              else PrefixTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=5))
    model = get_peft_model(base, config).eval()
    if method == "prefix":
        torch.manual_seed(1)
        with torch.no_grad():
            for p in model.prompt_encoder.parameters():
                p.normal_(0, 1)
    ids, mask = left_padded_batch([4, 9], seed=2)
    for extra in (dict(do_sample=False), dict(num_beams=2)):
        ref, out = both(model, input_ids=ids, attention_mask=mask, max_new_tokens=8,
                        return_dict_in_generate=True, **extra)
        assert_same(ref, out)
        assert out.past_key_values.pool.placement == SPLIT


# -- every architecture of the zoo on a split pool ------------------------------------------------
@pytest.mark.parametrize("name", ["qwen3", "gemma2", "gemma3", "gpt_oss", "deepseek_v3",
                                  "phi", "cohere2"])
def test_split_pool_serves_every_architecture(name, split):
    """Layers spread over shards keep one KV group (the windows still apply per layer;
    nothing is released while full layers are there), in generate and in the engine."""
    from zoo import make_arch

    model = make_arch(name)
    ids, mask = left_padded_batch([6, 11, 9], seed=3)
    for extra in (dict(do_sample=False), dict(num_beams=3, do_sample=False)):
        ref, out = both(model, seed=5, input_ids=ids, attention_mask=mask, max_new_tokens=10,
                        return_dict_in_generate=True, eos_token_id=None, **extra)
        assert_same(ref, out)
        cache = out.past_key_values
        assert len(cache.pool.shards) > 1 and not cache.groups.is_hybrid
    prompts = random_prompts(3, 5, 1, 20)
    refs = [stock_greedy(model, p, 8) for p in prompts]
    engine = hf_paged.LLMEngine(model, block_size=4, num_blocks=40, max_num_seqs=3,
                                max_num_batched_tokens=8)
    assert len(engine.pool.shards) > 1
    done = run_engine(engine, prompts, [SamplingParams(temperature=0, max_tokens=8,
                                                       ignore_eos=True)] * len(prompts))
    for i, ref in enumerate(refs):
        assert done[str(i)].outputs[0].token_ids == ref, (name, i)
