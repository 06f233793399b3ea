"""Run by tests/test_tensor_parallel.py under `torchrun --nproc-per-node 2` (gloo, CPU).

The engine on a model loaded with tp_plan="auto": rank 0 schedules and samples, every rank
runs the forwards. Rank 0 writes the token ids of each request to argv[2] (JSON).
With argv[3] == "die", rank 1 exits abruptly at its third step; with "fail", rank 0's third
forward raises (after the step was broadcast); with "refuse", every rank is first given each
of REFUSED (each rank writes what it raised: rank 1 to argv[2] + ".1"), then OPTIONS."""

import json
import os
import sys
import warnings

import torch
import torch.distributed as dist

warnings.simplefilter("ignore")

from hf_paged import LLM, SamplingParams  # noqa: E402
from hf_paged.engine import ModelRunner, engine_options, run_worker  # noqa: E402
from transformers import AutoModelForCausalLM, DistributedConfig  # noqa: E402

OPTIONS = dict(block_size=4, num_blocks=20, max_num_seqs=4, max_num_batched_tokens=16,
               admission_headroom=0)  # admit eagerly: preempt often


# Options that rank 0 refuses, checked on every rank alike (a rank that took one would wait
# for steps while rank 0 went on to other collectives).
REFUSED = [dict(OPTIONS, speculative_config={"method": "bogus"}),
           dict(OPTIONS, speculative_config={"method": "draft_model", "model": "/nowhere",
                                             "num_speculative_tokens": 2}),
           dict(OPTIONS, enable_prefix_caching="yes"), dict(OPTIONS, bogus_option=1)]


def refusals(build) -> list[str]:
    errors = []
    for options in REFUSED:
        try:
            build(options)
            errors.append("accepted")
        except (ValueError, TypeError) as err:  # (who refused: the same on every rank)
            errors.append(str(err).replace("run_worker()", "LLM()"))
    return errors


def prompts():
    return [[3 + (7 * i + j) % 90 for j in range(1 + (5 * i) % 23)] for i in range(10)]


def main():
    folder, out_path = sys.argv[1], sys.argv[2]
    model = AutoModelForCausalLM.from_pretrained(
        folder, distributed_config=DistributedConfig(tp_plan="auto"), dtype=torch.float32).eval()
    refuse = sys.argv[3:] == ["refuse"]
    if dist.get_rank() == 0:
        refused = refusals(lambda options: LLM(model, **options)) if refuse else []
        llm = LLM(model, **OPTIONS)
        if sys.argv[3:] == ["fail"]:
            forwards = [0]
            forward = llm.engine.runner.forward

            def failing(*args):
                forwards[0] += 1
                if forwards[0] == 3:
                    raise RuntimeError("injected failure")
                return forward(*args)

            llm.engine.runner.forward = failing
        greedy = llm.generate(prompts(), SamplingParams(temperature=0, max_tokens=12,
                                                        ignore_eos=True), use_tqdm=False)
        sampled = llm.generate(prompts()[:3], SamplingParams(temperature=1.0, seed=3,
                                                             max_tokens=8, n=2), use_tqdm=False)
        stats = llm.stats()
        llm.shutdown()  # (the finalizer would too, at exit; once)
        with open(out_path, "w") as f:
            json.dump({"greedy": [o.outputs[0].token_ids for o in greedy],
                       "sampled": [[c.token_ids for c in o.outputs] for o in sampled],
                       "preemptions": stats.num_preemptions,
                       "kv_heads": llm.engine.pool.num_kv_heads, "refused": refused}, f)
    else:
        if refuse:
            with open(out_path + ".1", "w") as f:
                json.dump(refusals(lambda options: run_worker(model, **options)), f)
        # Ranks above 0 build only the model runner (no scheduler, no requests).
        runner = ModelRunner(model, **engine_options(OPTIONS)[0])
        if sys.argv[3:] == ["die"]:
            steps = [0]
            execute = runner.execute

            def dying(*args):
                steps[0] += 1
                if steps[0] == 3:
                    os._exit(7)
                return execute(*args)

            runner.execute = dying
        runner.worker_loop()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
