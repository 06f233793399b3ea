#!/usr/bin/env bash
# hf-paged serve vs transformers serve (continuous batching, and plain) on one model folder,
# one after the other on this machine, same trace and the same 768 MiB KV budget.
#
#   bash benchmarks/serving_comparison.sh OUT_DIR [RATES] [NUM_REQUESTS]
#
# Writes OUT_DIR/serving.json, OUT_DIR/serving.png and each server's log.
set -uo pipefail
out=${1:?usage: serving_comparison.sh OUT_DIR [RATES] [NUM_REQUESTS]}
rates=${2:-0.5,1,2,inf}
num=${3:-48}
cd "$(dirname "$0")/.."
mkdir -p "$out"
model="$out/model"
[ -f "$model/config.json" ] || python3 benchmarks/bench_serving.py --make-model "$model"
kv_bytes=$((768 * 1024 * 1024))
blocks=$((kv_bytes / (16 * 65536)))  # 16-token blocks of the 168M model (64 KiB per token)

run() {  # name port extra-bench-args -- server command...
  local name=$1 port=$2 extra=$3
  shift 4
  "$@" > "$out/$name.log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 300); do
    curl -sf "http://127.0.0.1:$port/health" > /dev/null && break
    sleep 1
  done
  python3 benchmarks/bench_serving.py --url "http://127.0.0.1:$port" --model "$model" \
    --name "$name" --rates "$rates" --num-requests "$num" --out "$out/serving.json" $extra
  kill "$pid"
  wait "$pid" 2> /dev/null
}

run hf-paged 8401 "" -- python3 -m hf_paged.serve "$model" --port 8401 \
  --served-model-name "$model" --kv-cache-bytes "$kv_bytes" --log-level warning
run "transformers-serve-cb" 8402 "--openai-only" -- transformers serve "$model" \
  --continuous-batching --host 127.0.0.1 --port 8402 --cb-block-size 16 \
  --cb-num-blocks "$blocks" --log-level warning
run "transformers-serve" 8403 "--openai-only" -- transformers serve "$model" \
  --host 127.0.0.1 --port 8403 --log-level warning
python3 benchmarks/bench_serving.py --out "$out/serving.json" --plot "$out/serving.png"
