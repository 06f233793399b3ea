#!/usr/bin/env bash
# One command for a CUDA machine: install what is missing, run the GPU tests (kernels,
# compiled forward, CUDA graphs, device_map across devices) and the benchmarks (kernels,
# engine, generate; tensor parallelism with two or more GPUs). Everything printed goes to
# OUT_DIR/log.txt (with a per-step summary at its end), the benchmark rows to OUT_DIR/*.json.
# The steps' time limits add up to under 9.5 minutes on one GPU; the most telling run first.
#
#   bash benchmarks/gpu_check.sh OUT_DIR [WHEEL_DIR]
#   GPU_CHECK_STEPS=cuda-build,kernel-tests bash benchmarks/gpu_check.sh OUT_DIR  # some steps
#
# WHEEL_DIR: optional folder of wheels (transformers 5.23 and its needs, ...) installed
# offline into a private site folder when the machine lacks them (benchmarks/fetch_gpu_wheels.sh).
set -uo pipefail
out=${1:?usage: gpu_check.sh OUT_DIR [WHEEL_DIR]}
wheels=${2:-}
cd "$(dirname "$0")/.."
mkdir -p "$out"
log="$out/log.txt"
: > "$log"
export PYTHONUNBUFFERED=1
if [ -n "$wheels" ] && ls "$wheels"/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/hf_paged_site "$wheels"/*.whl >>"$log" 2>&1 || exit 1
  export PYTHONPATH=/tmp/hf_paged_site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
export HF_PAGED_CACHE=${HF_PAGED_CACHE:-/tmp/hf_paged_cache}
summary=""
failed=0

selected() { [ -z "${GPU_CHECK_STEPS:-}" ] || [[ ",$GPU_CHECK_STEPS," == *",$1,"* ]]; }

# step NAME SECONDS [--bench] COMMAND...: runs COMMAND under a time limit, its output appended
# to the log; a failing test step makes the script fail, a failing benchmark is only reported.
step() {
  local name=$1 limit=$2 bench=0; shift 2
  selected "$name" || return 0
  if [ "$1" = "--bench" ]; then bench=1; shift; fi
  local start=$SECONDS
  echo "=== $name (limit ${limit}s): $*" | tee -a "$log"
  timeout "$limit" "$@" >>"$log" 2>&1
  local rc=$?
  local line="$name: rc=$rc in $((SECONDS - start))s"
  echo "$line" | tee -a "$log"
  summary+="$line"$'\n'
  if [ "$rc" -ne 0 ] && [ "$bench" -eq 0 ]; then failed=1; fi
}

# A test that hangs fails alone with its traceback (pytest-timeout, where installed) rather
# than taking its step's later tests and summary down with it.
per_test=$(python3 -c "import pytest_timeout" 2>/dev/null && echo "--timeout=80")
pytest=(python3 -m pytest -q -p no:cacheprovider -o addopts="" -rfE --tb=short $per_test)

step env 15 --bench bash -c "nvidia-smi; python3 -c \"import torch, triton, transformers; \
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, \
'transformers', transformers.__version__)\""
if [ "${GPU_CHECK_STEPS:-}" != "env" ] && \
    ! python3 -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
  echo "no CUDA device here: gpu_check.sh runs on a GPU machine (GPU_CHECK_STEPS=env checks" \
    "the environment alone)" | tee -a "$log"
  exit 2
fi
# The CUDA extension builds in the background (nvcc on the host's cores) while the engine
# tests, which do not use it, run on the GPU; its time shows on its own (37 s on one fresh
# H200 machine, over 60 s on another). A build cut short does not block later loads.
if selected cuda-build; then
  ( timeout 240 python3 -c "import time; t=time.time(); from hf_paged.kernels import cuda_ops; \
cuda_ops.load(); print(f'cuda kernels built in {time.time()-t:.0f}s')" >"$out/cuda_build.txt" 2>&1
    echo "rc=$?" >>"$out/cuda_build.txt" ) &
  build=$!
fi
# The engine on the GPU: eager against stock generate, async scheduling, the compiled forward
# (torch.compile, Inductor) and CUDA graphs captured for real (eager and compiled).
step engine-tests 150 "${pytest[@]}" --durations=6 tests/engine/test_async_scheduling.py \
  tests/engine/test_compile.py tests/engine/test_cuda_graphs.py \
  --maxfail=3 -k "on_cuda or on_gpu or triton_kernels"
# Decode steps with and without CUDA graphs (tiny Llama: the host's share shows).
step bench-cuda-graphs 30 --bench python3 benchmarks/bench_engine.py --device cuda --cuda-graphs \
  --out "$out/bench_cuda_graphs.json"
# The build's end (it has had the engine steps' time), then the kernels it built.
if [ -n "${build:-}" ]; then
  start=$SECONDS
  wait "$build"
  cat "$out/cuda_build.txt" >>"$log"
  line="cuda-build: $(tail -n 1 "$out/cuda_build.txt"), waited $((SECONDS - start))s for it"
  echo "$line" | tee -a "$log"
  summary+="$line"$'\n'
  grep -q "^rc=0$" "$out/cuda_build.txt" || failed=1
fi
# CPU-side checks (generate parity, emulated CUDA, compile-only) run in CI: GPU tests only here.
step kernel-tests 140 "${pytest[@]}" --maxfail=24 tests/kernels/test_kernel_features.py \
  tests/kernels/test_kv_quant.py tests/kernels/test_kernels.py -k "not emulated and not compile"
step bench-attention 45 --bench python3 benchmarks/bench_attention.py --iters 10 \
  --out "$out/bench_attention.json"
# The engine on a Llama-7B-shaped random model in bf16 (16 GiB of KV), with CUDA graphs of the
# eager forward and without, then stock static batches; each method's time prints as it ends.
step bench-engine-7b 75 --bench python3 benchmarks/bench_engine.py --device cuda --dtype bfloat16 \
  --model-size 7b --requests 48 --kv-mib 16384 --methods engine-cuda-graphs,engine,static-dynamic \
  --no-prefix-section --no-policy-rows --out "$out/bench_engine.json"
# device_map across real device boundaries: CPU + GPU here, two GPUs where there are two.
step device-map-tests 25 "${pytest[@]}" tests/distributed/test_device_map.py \
  -k "cpu_and_gpu or two_gpus"
step bench-generate 25 --bench python3 benchmarks/bench_generate.py --device cuda --repeats 1 --no-cb
# Tensor parallelism (NCCL) where there are at least two GPUs: TP=1 vs TP=2, 7B shape.
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -ge 2 ]; then
  for n in 1 2; do
    step "bench-tp-$n" 100 --bench torchrun --nproc-per-node "$n" benchmarks/bench_tp.py \
      --device cuda --dtype bfloat16 --model-size 7b --requests 48 --kv-mib 8192
  done
fi
printf '\n=== summary\n%s' "$summary" | tee -a "$log"
exit "$failed"
