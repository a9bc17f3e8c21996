#!/usr/bin/env bash
# The GPU check (examples/gpu_check.rs, whose docs say what each row measures): golden vectors,
# batch and order invariance of the embedder, the largest difference from the CPU, embedding
# and generation throughput, as one table (stdout, and gpu-check.md in $OUT or target/gpu-check).
#
# The GPU machine has no cargo, so the check is built where cargo is, into target/gpu-check/
# (the binary and its assets: MiniLM's tokenizer, config, tensor shapes and the golden vectors;
# the weights are random ones of MiniLM's shape, made on the spot), and that folder is carried:
#
#   bash scripts/gpu-check.sh --device cpu                 # the dry run CI makes (build + run)
#   bash scripts/gpu-check.sh --device cuda --build-only   # here: the CUDA build (nvcc from PyPI)
#   bash scripts/gpu-check.sh --device cuda                # on the GPU machine: run what was carried
#
# Other flags go to the check (--texts N, --generator NAME). The CUDA binary links the CUDA 13.0
# runtime libraries (cudart, cublas, curand, from PyPI here) and the driver's libcuda.so.1: the
# GPU machine needs those (a CUDA 12 machine lacks libcublas.so.13; build with its toolkit's
# versions there). It is carried gzipped, and unpacked on the GPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
device=cuda
build_only=0
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --device) device="$2"; shift 2 ;;
    --build-only) build_only=1; shift ;;
    *) extra+=("$1"); shift ;;
  esac
done
dir=target/gpu-check
if command -v cargo >/dev/null 2>&1; then
  mkdir -p "$dir"
  # The CPU build writes the assets (and is the check itself on --device cpu).
  cargo build --quiet --example gpu_check
  cpu_check="${CARGO_TARGET_DIR:-target}/debug/examples/gpu_check"
  "$cpu_check" --prepare "${FLUXMEM_MODELS:-$HOME/.cache/fluxmem/models}/all-minilm-l6-v2" \
    --assets "$dir/assets"
  if [ "$device" = cpu ]; then
    cp "$cpu_check" "$dir/gpu_check"
  else
    cuda_target="${CUDA_TARGET_DIR:-target/cuda}"
    CUDA_TARGET_DIR="$cuda_target" bash scripts/cuda-check.sh \
      cargo build --example gpu_check --features cuda
    # Stripped and gzipped: the CUDA binary carries candle's PTX kernels (about 62 MiB
    # stripped, 15 MiB gzipped), and what travels with the tree is at most 64 MiB.
    strip --strip-all -o "$dir/gpu_check" "$cuda_target/debug/examples/gpu_check"
    gzip -9 -f "$dir/gpu_check"
  fi
fi
if [ ! -x "$dir/gpu_check" ] && [ -f "$dir/gpu_check.gz" ]; then
  if [ "$build_only" = 0 ]; then
    gunzip -k -f "$dir/gpu_check.gz" && chmod +x "$dir/gpu_check"
  fi
fi
if [ "$build_only" = 1 ]; then
  rm -f "$dir/gpu-check.md"
  echo "gpu-check: built $dir ($(du -sh "$dir" | cut -f1)); carry it to the GPU machine"
  exit 0
fi
[ -x "$dir/gpu_check" ] || {
  echo "gpu-check: no $dir/gpu_check here; build it where cargo is: bash scripts/gpu-check.sh --device $device --build-only" >&2
  exit 1
}
out="${OUT:-$dir}"
mkdir -p "$out"
"$dir/gpu_check" --device "$device" --assets "$dir/assets" --out "$out/gpu-check.md" "${extra[@]}"
