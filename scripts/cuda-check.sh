#!/usr/bin/env bash
# Compiles fluxmem with `--features cuda` on a machine without a GPU: NVIDIA's CUDA compiler and
# headers come from PyPI as wheels (pinned below) into a venv under target/, and candle's
# kernels are compiled to PTX for the compute capability in CUDA_COMPUTE_CAP (default 90, the
# H100/H200 of the GPU machine). `cargo check` runs every build script (nvcc included) and
# type-checks every `cfg(feature = "cuda")` path; it links nothing, so no driver is needed.
# Used by .ci/run; a GPU run needs `cargo build --release --features cuda` with the same env.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="target/cuda-venv"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
# cudarc 0.19 knows CUDA up to 13.4: the toolkit is pinned to 13.0, every part the same release.
"$venv/bin/pip" install -q \
  "nvidia-cuda-nvcc==13.0.88" "nvidia-cuda-runtime==13.0.96" "nvidia-cuda-crt==13.0.88" \
  "nvidia-nvvm==13.0.88" "nvidia-cuda-cccl==13.0.85"
cuda="$(cd "$venv" && pwd)/lib/python$("$venv/bin/python" -c 'import sys; print(f"{sys.version_info.major}.{sys.version_info.minor}")')/site-packages/nvidia/cu13"
[ -x "$cuda/bin/nvcc" ] || { echo "cuda-check: no nvcc at $cuda/bin/nvcc" >&2; exit 1; }
export CUDA_ROOT="$cuda" CUDA_PATH="$cuda" PATH="$cuda/bin:$PATH"
export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
export CARGO_TARGET_DIR="${CUDA_TARGET_DIR:-target/cuda}"
nvcc --version | tail -1
cargo check --features cuda
echo "cuda-check: cargo check --features cuda passed (compute capability $CUDA_COMPUTE_CAP)"
