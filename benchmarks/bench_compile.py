"""Seconds a compiled engine (`LLM(model, compile=True)`) takes to its first outputs on
Llama, Mistral (sliding window) and Falcon (new decoder architecture) models of
bench_layouts.py's shape: each in a fresh process (Dynamo's caches live in the process),
with Inductor's on-disk cache as it is (warm after a first run) or, with --cold, a new
empty one. One JSON line. Made for A/B runs of two checkouts, interleaved:

    git worktree add /tmp/base <rev>
    for i in 1 2 3; do
      PYTHONPATH=/tmp/base python benchmarks/bench_compile.py
      python benchmarks/bench_compile.py
    done

The workload: 6 prompts of 6 to 18 tokens, 8 new tokens each, greedy (prompt steps and
decode steps: two graphs traced).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

KINDS = ("llama", "mistral", "falcon")


def first_outputs(kind: str) -> float:
    """Seconds from building the engine to the end of its first generate (this process)."""
    import torch

    import hf_paged
    from bench_layouts import make

    torch.set_num_threads(1)
    model = make(kind)
    prompts = [[5 + i, 6, 7, 8, 9, 10 + i] * (1 + i % 3) for i in range(6)]
    start = time.perf_counter()
    llm = hf_paged.LLM(model, block_size=4, num_blocks=200, compile=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts],
                 hf_paged.SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    seconds = time.perf_counter() - start
    if llm.engine.runner.compile_error is not None:
        raise SystemExit(f"{kind}: the forward ran eagerly: {llm.engine.runner.compile_error}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cold", action="store_true", help="an empty Inductor cache each")
    parser.add_argument("--kinds", default=",".join(KINDS),
                        help=f"comma-separated model kinds to time (of {', '.join(KINDS)})")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # (the child process)
    args = parser.parse_args()
    if args.one:
        print(first_outputs(args.one))
        return
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(
        [p for p in (env.get("PYTHONPATH"), os.path.dirname(os.path.abspath(__file__))) if p])
    unknown = sorted(set(args.kinds.split(",")) - set(KINDS))
    if unknown:
        parser.error(f"--kinds: unknown {', '.join(unknown)}; known: {', '.join(KINDS)}")
    seconds = {}
    for kind in args.kinds.split(","):
        with tempfile.TemporaryDirectory() as cache:
            if args.cold:
                env["TORCHINDUCTOR_CACHE_DIR"] = cache
            out = subprocess.run([sys.executable, __file__, "--one", kind], env=env,
                                 capture_output=True, text=True)
        if out.returncode:
            raise SystemExit(f"{kind}: the timed child failed:\n{out.stderr[-4000:]}")
        seconds[kind] = round(float(out.stdout.split()[-1]), 2)
    import hf_paged

    print(json.dumps({"hf_paged": os.path.dirname(hf_paged.__file__), "cold": args.cold,
                      "seconds_to_first_outputs": seconds}))


if __name__ == "__main__":
    main()
