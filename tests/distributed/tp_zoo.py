"""Run by tests/distributed/test_tensor_parallel.py under `torchrun --nproc-per-node 2` (gloo,
CPU): every model folder given loaded with tp_plan="auto", stock TP generate against paged TP
generate (greedy on a left-padded batch, seeded sampling).

    tp_zoo.py OUT_JSON FOLDER...

Rank 0 writes {folder: {"stock": ..., "paged": ..., "kv_heads": ...} or {"stock_error": why}}.
"""

import sys
import warnings
from pathlib import Path

import torch

warnings.simplefilter("ignore")

import hf_paged  # noqa: E402,F401
from transformers import AutoModelForCausalLM, DistributedConfig  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tp_generate import write_from_rank0  # noqa: E402


def run(folder):
    model = AutoModelForCausalLM.from_pretrained(
        folder, distributed_config=DistributedConfig(tp_plan="auto"), dtype=torch.float32).eval()
    ids = torch.tensor([[0, 0, 0, 5, 6, 7, 8, 9], [9, 10, 11, 12, 13, 14, 15, 16]])
    mask = (ids != 0).long()
    result = {}
    for name, kwargs in (("greedy", dict(do_sample=False)),
                         ("sampling", dict(do_sample=True, top_k=20, num_return_sequences=2))):
        torch.manual_seed(5)
        try:
            stock = model.generate(ids, attention_mask=mask, max_new_tokens=8, **kwargs)
        except Exception as err:  # noqa: BLE001 - stock TP cannot run it: nothing to compare
            return {"stock_error": f"{type(err).__name__}: {err}"[:300]}
        torch.manual_seed(5)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=8, **kwargs,
                             cache_implementation="paged", return_dict_in_generate=True)
        result[name] = {"stock": stock.tolist(), "paged": out.sequences.tolist()}
        result["kv_heads"] = out.past_key_values.num_kv_heads
        result["cache"] = type(out.past_key_values).__name__
    return result


def main():
    out_path, folders = sys.argv[1], sys.argv[2:]
    write_from_rank0({folder: run(folder) for folder in folders}, out_path)


if __name__ == "__main__":
    main()
