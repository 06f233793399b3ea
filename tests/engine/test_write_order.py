"""Writes whose order a GPU does not keep.

On CUDA, an indexed write that names one cell twice (`t[idx] = v` with a repeated index,
a KV write with a repeated slot, a block copy into one block twice) keeps an arbitrary one
of the values; on CPU the last one wins, so a test on CPU passes where a GPU goes wrong.
These tests run the engine and `generate()` through forks, copy-on-write, preemption by
recompute and by swap, prefix hits, beams and padded batches, and fail on any such write.
"""

from __future__ import annotations

import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import make_model
from hf_paged import LLM, SamplingParams
from hf_paged.kernels import backends
from test_engine import random_prompts

aten = torch.ops.aten
INDEX_PUTS = (aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default)
INDEX_COPIES = (aten.index_copy_.default, aten.index_copy.default)


def _where() -> str:
    return "".join(line for line in traceback.format_stack()[:-2] if "hf_paged" in line)


def _repeats(index: torch.Tensor) -> bool:
    return index.shape[0] != torch.unique(index, dim=0).shape[0]


class RepeatedWrites(TorchDispatchMode):
    """Records every indexed write (without accumulation) that names a cell twice."""

    def __init__(self):
        super().__init__()
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in INDEX_PUTS and not (args[3] if len(args) > 3 else kwargs.get("accumulate")):
            index = [i for i in args[1] if i is not None and i.dtype != torch.bool]
            if index and _repeats(torch.stack([i.reshape(-1) for i in
                                               torch.broadcast_tensors(*index)], 1)):
                self.found.append(f"{func}: {_where()}")
        if func in INDEX_COPIES and _repeats(args[2]):
            self.found.append(f"{func}: {_where()}")
        return func(*args, **kwargs)


@pytest.fixture
def repeated(monkeypatch):
    """The recorder, with every backend's KV write and block copy checked too."""
    mode = RepeatedWrites()
    for cls in [c for c in vars(backends).values()
                if isinstance(c, type) and issubclass(c, backends.Backend)]:
        if "write_kv" in vars(cls):
            def write_kv(self, k_cache, v_cache, key, value, slots, _real=cls.write_kv):
                if _repeats(slots[slots >= 0]):
                    mode.found.append(f"KV slots: {_where()}")
                return _real(self, k_cache, v_cache, key, value, slots)
            monkeypatch.setattr(cls, "write_kv", write_kv)
        if "copy_blocks" in vars(cls):
            def copy_blocks(self, kv, src, dst, _real=cls.copy_blocks):
                if _repeats(dst) or set(src.tolist()) & set(dst.tolist()):
                    mode.found.append(f"block copies: {_where()}")
                return _real(self, kv, src, dst)
            monkeypatch.setattr(cls, "copy_blocks", copy_blocks)
    return mode


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_engine_steps_write_each_cell_once(repeated, backend):
    model = make_model("llama_gqa", max_position_embeddings=1400)
    system = random_prompts(60, 1, 9, 9)[0]
    prompts = random_prompts(5, 12, 2, 40, shared=system)
    sampled = [SamplingParams(temperature=0.9, seed=i, max_tokens=16, n=3) for i in range(12)]
    with repeated:
        for mode in ("recompute", "swap"):
            llm = LLM(model, block_size=4, num_blocks=30, max_num_seqs=8, backend=backend,
                      max_num_batched_tokens=32, admission_headroom=0, preemption_mode=mode,
                      enable_prefix_caching=True)
            llm.generate(prompts, sampled, use_tqdm=False)
            assert llm.engine.stats().num_preemptions > 0
            assert llm.engine.stats().prefix_cache_hit_tokens > 0
    assert repeated.found == []


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_generate_writes_each_cell_once(repeated, backend):
    model = make_model("llama_gqa")
    ids = torch.tensor(random_prompts(61, 2, 10, 10))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # a left-padded row
    paged = dict(cache_implementation="paged", pad_token_id=0, attention_mask=mask,
                 cache_config={"block_size": 4, "backend": backend})
    with repeated:
        model.generate(ids, max_new_tokens=6, num_beams=3, num_return_sequences=2,
                       do_sample=False, **paged)
        model.generate(ids, max_new_tokens=6, do_sample=True, num_return_sequences=3, **paged)
    assert repeated.found == []


@pytest.mark.parametrize("kind", ["gemma3", "speculative"])
def test_kv_groups_and_speculation_write_each_cell_once(repeated, kind):
    """Sliding and full layers in groups of tables of their own (blocks leaving the window
    freed), and n-gram drafts verified and rolled back, with forks and preemption."""
    from zoo import make_arch

    model = make_arch("gemma3") if kind == "gemma3" else make_model("llama_gqa")
    options = {} if kind == "gemma3" else dict(speculative_config=dict(
        method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, min_acceptance=0.0))
    system = random_prompts(62, 1, 9, 9)[0]
    prompts = [p + p[:6] for p in random_prompts(7, 10, 6, 30, shared=system)]  # repeats
    sampled = [SamplingParams(temperature=0.0 if i % 2 else 0.9, seed=i, max_tokens=16,
                              n=1 + i % 3) for i in range(10)]
    with repeated:
        llm = LLM(model, block_size=4, num_blocks=16 if kind == "gemma3" else 40,
                  max_num_seqs=8, max_num_batched_tokens=32, admission_headroom=0,
                  enable_prefix_caching=True, **options)
        outputs = llm.generate(prompts, sampled, use_tqdm=False)
        stats = llm.engine.stats()
    assert all(o.error is None for o in outputs) and stats.num_preemptions > 0
    assert kind == "gemma3" or stats.spec_accepted_tokens > 0
    assert repeated.found == []
