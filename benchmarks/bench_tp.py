"""The engine workload under tensor parallelism: run with torchrun, compare world sizes.

    torchrun --nproc-per-node 1 benchmarks/bench_tp.py          # TP=1
    torchrun --nproc-per-node 2 benchmarks/bench_tp.py          # TP=2 (gloo on CPU)
    torchrun --nproc-per-node 2 benchmarks/bench_tp.py --device cuda --dtype bfloat16

Builds the random Llama of bench_engine.py (~168M; --model-size 7b for GPUs), saves it to a
temporary folder on rank 0, loads it with tp_plan="auto" on every rank, and runs
bench_engine.py's long-tailed requests through hf_paged.LLM; rank 0 prints output tokens/s.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import workload  # noqa: E402
from common import check_device, random_llama  # noqa: E402

from hf_paged import LLM, LLMEngine, SamplingParams  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=32, help="number of requests (32)")
    parser.add_argument("--kv-mib", type=int, default=512, help="KV budget per rank, MiB (512)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (each rank its own GPU)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="model and KV dtype (float32)")
    parser.add_argument("--model-size", default="168m", choices=["168m", "7b"],
                        help="random Llama shape (168m)")
    args = parser.parse_args()
    check_device(args.device)
    # Rank 0 builds and saves a random model while the others wait: allow for a 7B one.
    timeout = datetime.timedelta(hours=1)
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=timeout)
    else:  # Transformers would place a TP model on visible GPUs
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        dist.init_process_group("gloo", timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, args.dtype)
    folder = [tempfile.mkdtemp(prefix="hf_paged_tp_") if rank == 0 else None]
    dist.broadcast_object_list(folder, src=0)
    if rank == 0:
        shape = dict(hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=11008) \
            if args.model_size == "7b" else {}
        random_llama(dtype=dtype, **shape).save_pretrained(folder[0])
    dist.barrier()
    from transformers import AutoModelForCausalLM, DistributedConfig

    model = AutoModelForCausalLM.from_pretrained(
        folder[0], distributed_config=DistributedConfig(tp_plan="auto"), dtype=dtype).eval()
    options = dict(kv_cache_bytes=args.kv_mib * 2**20, block_size=16)
    requests = workload(args.requests, model.config.vocab_size, seed=0)
    if rank == 0:
        llm = LLM(model, **options)
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in requests]
        start = time.perf_counter()
        llm.generate([p for p, _ in requests], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        llm.engine.stop_workers()
        tokens = sum(n for _, n in requests)
        print(f"TP={world} ({dist.get_backend()}, {torch.get_num_threads()} threads per rank): "
              f"{len(requests)} requests, {tokens} output tokens in {seconds:.1f} s = "
              f"{tokens / seconds:.1f} tokens/s")
    else:
        LLMEngine(model, **options).worker_loop()
    dist.barrier()
    if rank == 0:  # (the saved model: 643 MB at 168M parameters)
        shutil.rmtree(folder[0], ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
