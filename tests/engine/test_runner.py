"""The model runner: the device side of a step, all a tensor-parallel rank above 0 builds."""

from __future__ import annotations

import pytest
import torch

from conftest import make_model
from hf_paged import LLM, LLMEngine, SamplingParams
from hf_paged.engine import ModelRunner
from hf_paged.errors import HFPagedError
from hf_paged.hf.switch import paged_attention
from hf_paged.kv.metadata import DeviceBlockTable, build_metadata
from zoo import make_arch


def _decode_inputs(engine):
    seqs = list(engine.scheduler.running)
    rows, context = [s.row for s in seqs], [s.num_computed for s in seqs]
    meta = engine.runner.metadata(rows, context, [1] * len(seqs))[0]
    return meta, torch.tensor([[3] * len(seqs)]), torch.tensor([context])


def test_a_decode_forward_traces_as_one_graph():
    """The forward's metadata arrives as arguments: torch.compile can trace a decode step
    of the engine whole (no graph break), and the traced forward gives the eager logits."""
    model = make_model("llama_gqa")
    engine = LLMEngine(model, num_blocks=64, block_size=4, backend="torch")
    for i in range(3):
        engine.add_request(str(i), [5 + i, 6, 7, 8, 9 + i], SamplingParams(max_tokens=4))
    engine.step()
    meta, ids, positions = _decode_inputs(engine)
    runner = engine.runner
    keep = torch.arange(ids.shape[1])

    def forward(ids, positions):
        kv = runner.access.forward(meta)
        return runner.model(input_ids=ids, position_ids=positions, past_key_values=kv,
                            use_cache=True, logits_to_keep=keep, paged_kv=kv).logits

    with torch.inference_mode(), paged_attention(runner.base):
        eager = forward(ids, positions)
        explained = torch._dynamo.explain(forward)(ids, positions)
        torch._dynamo.reset()
    assert explained.graph_break_count == 0 and explained.graph_count == 1, \
        explained.break_reasons
    with torch.inference_mode(), paged_attention(runner.base):
        again = forward(ids, positions)  # the same slots rewritten with the same values
    torch.testing.assert_close(again, eager)


def test_a_runner_alone_runs_the_engines_steps():
    """A ModelRunner (no scheduler, no requests) executes the DeviceStep an engine built and
    writes the same KV: what a rank above 0 does with rank 0's broadcast."""
    model = make_model("llama_gqa")
    sent = []
    engine = LLMEngine(model, num_blocks=64, block_size=4)
    engine.runner.broadcast = sent.append  # what rank 0 sends the other ranks
    engine.add_request("a", [5, 6, 7, 8, 9], SamplingParams(max_tokens=3, temperature=0))
    engine.step()
    worker = ModelRunner(model, num_blocks=64, block_size=4)
    assert not hasattr(worker, "scheduler")
    (logits,) = worker.execute(sent[0])
    assert logits.shape == (1, model.config.vocab_size)
    torch.testing.assert_close(worker.pool.layer_kv(0), engine.pool.layer_kv(0))


def _same_metadata(host_built, reference):
    for name in ("block_tables", "block_tables_i32", "context_lens", "seq_lens", "query_pos",
                 "slot_mapping"):
        assert torch.equal(getattr(host_built, name), getattr(reference, name)), name
    for name in ("is_query", "token_index", "max_seq_len", "num_new", "packed",
                 "seq_lens_host", "parts"):
        assert getattr(host_built, name) == getattr(reference, name), name


@pytest.mark.parametrize("kind", ["llama_gqa", "gemma3"])
def test_decode_metadata_from_the_host_mirror_equals_the_device_build(kind):
    """A decode step's slots come from the block table's host lists: for rows that crossed
    block boundaries, were preempted and came back (new blocks in reused rows), in every KV
    group of a hybrid model, the metadata equals `build_metadata` over the device table."""
    model = make_arch("gemma3") if kind == "gemma3" else make_model(kind)
    engine = LLMEngine(model, num_blocks=24, block_size=4, max_num_seqs=6,
                       admission_headroom=0)
    for i in range(6):
        engine.add_request(str(i), [5 + i] * (3 + 4 * i), SamplingParams(max_tokens=12 + i,
                                                                         ignore_eos=True))
    runner, table, checked = engine.runner, engine.runner.device_table, []
    own = runner.metadata

    def metadata(rows, context, counts, context_t=None):  # the engine's own calls
        metas = own(rows, context, counts, context_t)
        if counts.count(1) == len(counts):
            for g, meta in enumerate(metas):
                device = table.group(g).index_select(0, torch.tensor(rows))
                for r, ids in zip(rows, device.tolist()):
                    host = table.host[g * runner.max_num_seqs + r]
                    assert ids[:len(host)] == host and not any(ids[len(host):])
                _same_metadata(meta, build_metadata(
                    device, torch.tensor(context), counts, 1, max(context) + 1,
                    runner.block_size, packed=True, seq_lens_host=[c + 1 for c in context]))
                checked.append(len(rows))
        return metas

    runner.metadata = metadata
    while engine.has_unfinished_requests():
        engine.step()
    assert len(checked) > 10 and max(checked) > 1
    assert engine.stats().num_preemptions > 0 or kind == "gemma3"  # (its windows free blocks)


def test_a_mirrored_table_grows_and_refuses_forks():
    table = DeviceBlockTable(3, 2, torch.device("cpu"), num_groups=2, host_mirror=True)
    table.apply([(0, 0, 7), (4, 5, 9), (2, 1, 3)])  # row 4: group 1's row 1; column 5 grows it
    assert table.table.shape[1] >= 6
    for row, ids in enumerate(table.host):
        assert ids == table.table[row, :len(ids)].tolist()
        assert not table.table[row, len(ids):].any()
    with pytest.raises(HFPagedError, match="takes entries only"):
        table.fork(torch.tensor([0, 0, 1]))


def test_each_block_table_cell_is_written_once_a_step(monkeypatch):
    """A fork points its last column at the parent's partly filled block and, in the same
    step, copy-on-write points it at the copy. A GPU writes duplicate indices in no set
    order, so the device table gets one write per cell: the step's last entry."""
    from hf_paged.kv import metadata

    given, written = [], []
    apply, to_device = DeviceBlockTable.apply, metadata.to_device

    def spy_apply(self, entries):
        given.append(list(entries))
        return apply(self, entries)

    def spy_to_device(values, device):
        if values and isinstance(values[0], tuple) and len(values[0]) == 3:  # table entries
            written.append(list(values))
        return to_device(values, device)

    monkeypatch.setattr(DeviceBlockTable, "apply", spy_apply)
    monkeypatch.setattr(metadata, "to_device", spy_to_device)
    from test_engine import random_prompts

    llm = LLM(make_model("llama_gqa"), block_size=4, num_blocks=200, max_num_seqs=8)
    llm.generate(random_prompts(5, 12, 2, 40),
                 [SamplingParams(temperature=0.9, seed=i, max_tokens=10, n=2) for i in range(12)],
                 use_tqdm=False)
    cells = lambda entries: {(r, c) for r, c, _ in entries}  # noqa: E731
    assert any(len(cells(e)) < len(e) for e in given)  # the workload makes duplicates
    assert written and all(len(cells(e)) == len(e) for e in written)
    last = [{(r, c): b for r, c, b in e} for e in given if e]
    assert [{(r, c): b for r, c, b in e} for e in written] == last
