"""Run by tests/test_tensor_parallel.py under `torchrun --nproc-per-node 2` (gloo, CPU).

Loads the model folder argv[1] with tp_plan="auto" and writes, from rank 0, a JSON of
{case: {"stock": tokens, "paged": tokens}} to argv[2]: stock TP generate and paged TP
generate of the same inputs, for greedy, beams, seeded sampling and a left-padded batch.
Every rank checks that its paged tokens equal rank 0's.
"""

import json
import sys
import warnings

import torch
import torch.distributed as dist

warnings.simplefilter("ignore")

import hf_paged  # noqa: E402,F401
from transformers import AutoModelForCausalLM, DistributedConfig  # noqa: E402


def main():
    folder, out_path = sys.argv[1], sys.argv[2]
    model = AutoModelForCausalLM.from_pretrained(
        folder, distributed_config=DistributedConfig(tp_plan="auto"), dtype=torch.float32).eval()
    ids = torch.tensor([[0, 0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15], [0, 0, 0, 0, 0, 3, 4]])
    mask = (ids != 0).long()
    cases = {
        "greedy": dict(do_sample=False),
        "beams": dict(do_sample=False, num_beams=3, num_return_sequences=2),
        "sampling": dict(do_sample=True, top_k=20, num_return_sequences=2),
    }
    results = {}
    for name, kwargs in cases.items():
        row = {}
        for paged in (False, True):
            torch.manual_seed(7)
            extra = dict(cache_implementation="paged", return_dict_in_generate=True) if paged \
                else {}
            out = model.generate(ids, attention_mask=mask, max_new_tokens=8, **kwargs, **extra)
            if paged:
                cache = out.past_key_values
                assert cache.num_kv_heads == model.config.num_key_value_heads // 2
                out = out.sequences
            row["paged" if paged else "stock"] = out.tolist()
        results[name] = row
    write_from_rank0(results, out_path)


def write_from_rank0(results, out_path):
    """Checks every rank got the same results; rank 0 writes them; the group ends."""
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    assert all(g == gathered[0] for g in gathered), "ranks disagree"
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
