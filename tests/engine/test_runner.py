"""The model runner: the device side of a step, all a tensor-parallel rank above 0 builds."""

from __future__ import annotations

import torch

from conftest import make_model
from hf_paged import LLMEngine, SamplingParams
from hf_paged.engine import ModelRunner
from hf_paged.hf.switch import paged_attention


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
