#!/usr/bin/env bash
# Batched decode on the generators' default weights: for each model, `batch` different short
# prompts (~20 tokens) decoded together for 32 greedy tokens each, tokens/s over the whole call
# (prefill included) at batch 1, 4, 8 and 16, and the ratio to batch 1 (the reference run, same
# script, same machine, same threads). Table in docs/models.md. Run by hand:
#
#     bash benches/batched_decode.sh [THREADS] [MODELS...]
set -euo pipefail
cd "$(dirname "$0")/.."
threads="${1:-2}"
shift || true
models=("$@")
if [ ${#models[@]} -eq 0 ]; then
  models=(smollm2-135m-instruct-q4_1 qwen2.5-coder-0.5b-instruct-q4_k_m qwen2.5-coder-1.5b-instruct-q4_k_m)
fi
for model in "${models[@]}"; do
  RAYON_NUM_THREADS="$threads" cargo run --quiet --example generator_bench -- --model "$model" --batches 1,4,8,16 --repeat 2 --weights q8
done
