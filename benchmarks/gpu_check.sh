#!/usr/bin/env bash
# One command for a CUDA machine: install what is missing, run the GPU tests (kernels,
# device_map across devices) and the benchmarks (kernels, generate, engine; tensor
# parallelism with two or more GPUs), write everything to OUT_DIR. Its timeouts add up to
# under 10 minutes on one GPU.
#
#   bash benchmarks/gpu_check.sh OUT_DIR [WHEEL_DIR]
#
# WHEEL_DIR: optional folder of wheels (transformers 5.23 and its needs, hypothesis, ...)
# installed offline into a private site folder when the machine lacks them.
set -uo pipefail
out=${1:?usage: gpu_check.sh OUT_DIR [WHEEL_DIR]}
wheels=${2:-}
cd "$(dirname "$0")/.."
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if [ -n "$wheels" ] && ls "$wheels"/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/hf_paged_site "$wheels"/*.whl || exit 1
  export PYTHONPATH=/tmp/hf_paged_site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
export HF_PAGED_CACHE=${HF_PAGED_CACHE:-/tmp/hf_paged_cache}

{ nvidia-smi; python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'transformers', transformers.__version__)"; } > "$out/env.txt" 2>&1
cat "$out/env.txt"

# Build the CUDA extension once up front so its compile time shows on its own.
timeout 90 python3 -c "import time; t=time.time(); from hf_paged.kernels import cuda_ops; cuda_ops.load(); print(f'cuda kernels built in {time.time()-t:.0f}s')" 2>&1 | tee "$out/cuda_build.txt"

# CPU-side checks (generate parity, emulated CUDA, compile-only) run in CI: GPU tests only here.
timeout 130 python3 -m pytest tests/kernels/test_kernels.py tests/kernels/test_kernel_features.py \
  tests/kernels/test_kv_quant.py \
  -q -x -p no:cacheprovider -k "not emulated and not compile" 2>&1 | tee "$out/tests.txt" | tail -15
tests_rc=${PIPESTATUS[0]}
# device_map across real device boundaries: CPU + GPU here, two GPUs where there are two.
timeout 45 python3 -m pytest tests/distributed/test_device_map.py -q -p no:cacheprovider \
  -k "cpu_and_gpu or two_gpus" 2>&1 | tee "$out/tests_device_map.txt" | tail -5
[ "${PIPESTATUS[0]}" -eq 0 ] || tests_rc=1

# The engine's compiled forward (torch.compile, Inductor), async scheduling and CUDA graphs
# (captured for real; eager and compiled, against the engine without graphs) on the GPU.
timeout 50 python3 -m pytest tests/engine/test_compile.py tests/engine/test_async_scheduling.py \
  -q -p no:cacheprovider -k cuda 2>&1 | tee "$out/tests_compile.txt" | tail -5
[ "${PIPESTATUS[0]}" -eq 0 ] || tests_rc=1
timeout 40 python3 -m pytest tests/engine/test_cuda_graphs.py -q -s -p no:cacheprovider \
  -k on_gpu 2>&1 | tee "$out/tests_cuda_graphs.txt" | tail -8
[ "${PIPESTATUS[0]}" -eq 0 ] || tests_rc=1
# Decode steps with and without CUDA graphs (tiny Llama: the host's share shows).
timeout 40 python3 benchmarks/bench_engine.py --device cuda --cuda-graphs \
  --out "$out/bench_cuda_graphs.json" 2>&1 | tee "$out/bench_cuda_graphs.txt"

timeout 75 python3 benchmarks/bench_attention.py --out "$out/bench_attention.json" 2>&1 | tee "$out/bench_attention.txt"
timeout 45 python3 benchmarks/bench_generate.py --device cuda --repeats 1 --no-cb 2>&1 | tee "$out/bench_generate.txt"
# The engine on a Llama-7B-shaped random model in bf16 (16 GiB of KV).
timeout 80 python3 benchmarks/bench_engine.py --device cuda --dtype bfloat16 --model-size 7b \
  --requests 48 --kv-mib 16384 --methods engine,static-paged,static-dynamic --no-prefix-section \
  --out "$out/bench_engine.json" 2>&1 | tee "$out/bench_engine.txt"
# Tensor parallelism (NCCL) where there are at least two GPUs: TP=1 vs TP=2, 7B shape.
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -ge 2 ]; then
  for n in 1 2; do
    timeout 100 torchrun --nproc-per-node "$n" benchmarks/bench_tp.py --device cuda \
      --dtype bfloat16 --model-size 7b --requests 48 --kv-mib 8192 2>&1 | tee "$out/bench_tp_$n.txt" | tail -3
  done
fi
exit "$tests_rc"
