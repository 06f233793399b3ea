"""The engine's layer-list slices (hf/layer_list.py): inside an engine forward on its thread,
`layers[:n]` comes from a cache while the list holds the same modules; everywhere else a
slice is built as torch builds it. Engine tokens stay those of stock generate."""

from __future__ import annotations

import copy
import io
import threading

import torch
from torch import nn

from conftest import make_model
from hf_paged import LLM, SamplingParams
from hf_paged.hf.layer_list import SlicedOnceModuleList, cached_slices, use_cached_slices
from test_engine import random_prompts, stock_greedy
from zoo import NAMES, make_arch


def greedy(llm, prompts, max_tokens=10):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_engine_lists_reuse_their_slice_and_tokens_stay_stock():
    model = make_model("llama_gqa")
    keys = list(model.state_dict())
    prompts = random_prompts(0, 4, 2, 20)
    stock = [stock_greedy(model, p, 10) for p in prompts]
    llm = LLM(model, block_size=4, num_blocks=64)
    layers = model.model.layers
    assert type(layers) is SlicedOnceModuleList and isinstance(layers, nn.ModuleList)
    assert list(model.state_dict()) == keys
    built = []
    real = nn.ModuleList.__getitem__
    try:
        nn.ModuleList.__getitem__ = lambda self, i: built.append(i) or real(self, i)
        assert greedy(llm, prompts) == stock
    finally:
        nn.ModuleList.__getitem__ = real
    # One slice built for the first forward, reused by every later one.
    assert len([i for i in built if isinstance(i, slice)]) == 1
    assert [stock_greedy(model, p, 10) for p in prompts] == stock  # stock after the engine


def test_slices_are_cached_only_inside_the_switch_and_follow_edits():
    layers = nn.ModuleList([nn.Linear(2, 2) for _ in range(3)])
    use_cached_slices(nn.Sequential(layers))
    assert layers[:2] is not layers[:2]  # outside: torch's own slicing
    with cached_slices():
        first = layers[:2]
        assert layers[:2] is first and list(first) == list(layers)[:2]
        assert layers[1:] is not first and list(layers[1:]) == list(layers)[1:]
        assert layers[1] is list(layers)[1]  # (an index is not a slice)
        layers[0] = nn.Linear(2, 2)  # an edited list is sliced anew
        assert list(layers[:2]) == list(layers)[:2]
        layers.append(nn.Linear(2, 2))
        assert list(layers[:]) == list(layers) and len(layers[:]) == 4
        del layers[3]
        assert len(layers[:]) == 3
        seen = []
        other = threading.Thread(target=lambda: seen.append(layers[:] is layers[:]))
        other.start()
        other.join()
        assert seen == [False]  # another thread slices as torch does
    assert layers[:] is not layers[:]


def test_a_switched_list_copies_saves_and_loads_as_a_module_list():
    model = make_model("llama_gqa")
    use_cached_slices(model)
    with cached_slices():
        model.model.layers[:2]  # (something cached)
    twin = copy.deepcopy(model)
    assert type(twin.model.layers) is SlicedOnceModuleList
    with cached_slices():
        assert all(a is b for a, b in zip(twin.model.layers[:2], twin.model.layers))
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_only_plain_module_lists_switch():
    class Own(nn.ModuleList):
        pass

    outer = nn.Sequential(nn.ModuleList([nn.ReLU()]), Own([nn.ReLU()]))
    use_cached_slices(outer)
    assert type(outer[0]) is SlicedOnceModuleList and type(outer[1]) is Own


def test_every_architecture_keeps_stock_tokens_with_cached_slices():
    prompts = random_prompts(3, 3, 2, 16)
    for name in NAMES:
        model = make_arch(name)
        stock = [stock_greedy(model, p, 8) for p in prompts]
        llm = LLM(model, block_size=4, num_blocks=96)
        assert greedy(llm, prompts, 8) == stock, name
