#!/usr/bin/env bash
# Compiles fluxmem with `--features cuda` on a machine without a GPU: NVIDIA's CUDA compiler and
# headers come from PyPI as wheels (pinned below) into a venv under target/, and candle's
# kernels are compiled to PTX for the compute capability in CUDA_COMPUTE_CAP (default 90, the
# H100/H200 of the GPU machine). `cargo check` runs every build script (nvcc included) and
# type-checks every `cfg(feature = "cuda")` path; it links nothing, so no driver is needed.
# Used by .ci/run. With arguments, runs them in that environment instead of the check (the GPU
# check's build: `scripts/cuda-check.sh cargo build --example gpu_check --features cuda`).
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
if [ $# -gt 0 ]; then
  # A build links: the runtime libraries candle's CUDA path links (cudarc's dynamic linking),
  # as their unversioned names, and a stub of the driver's libcuda.so.1 (SONAME) (every cu* entry point
  # cudarc declares, doing nothing: the GPU machine's driver is the real one at run time).
  "$venv/bin/pip" install -q \
    "nvidia-cuda-nvrtc==13.0.88" "nvidia-curand==10.4.0.35" "nvidia-cublas==13.0.2.14"
  for lib in "$cuda"/lib/lib{cudart,nvrtc,curand,cublas,cublasLt}.so.*; do
    case "$lib" in *builtins*|*.alt.*) continue ;; esac
    ln -sf "$(basename "$lib")" "${lib%%.so.*}.so"
  done
  cudarc="$(cargo metadata --format-version 1 --features cuda 2>/dev/null | "$venv/bin/python" -c '
import json, sys
print(next(p["manifest_path"] for p in json.load(sys.stdin)["packages"] if p["name"] == "cudarc").rsplit("/", 1)[0])')"
  mkdir -p "$cuda/lib/stubs"
  grep -ohE "fn cu[A-Za-z0-9_]+\(" "$cudarc/src/driver/sys/mod.rs" | sort -u \
    | sed -E 's/fn (cu[A-Za-z0-9_]+)\(/int \1(void) { return 999; }/' > "$cuda/lib/stubs/cuda_stub.c"
  # In lib/ itself, which cudarc's build script searches whether or not stubs/ existed then.
  cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$cuda/lib/libcuda.so" "$cuda/lib/stubs/cuda_stub.c"
fi
export CUDA_ROOT="$cuda" CUDA_PATH="$cuda" PATH="$cuda/bin:$PATH"
export CUDA_COMPUTE_CAP="${CUDA_COMPUTE_CAP:-90}"
export CARGO_TARGET_DIR="${CUDA_TARGET_DIR:-target/cuda}"
nvcc --version | tail -1
if [ $# -gt 0 ]; then
  exec "$@"
fi
cargo check --features cuda
# The Python module the Ray actors load (crates/fluxmem-py) is no dependency of the binary:
# its CUDA build is checked on its own.
cargo check -p fluxmem-py --features cuda
echo "cuda-check: cargo check --features cuda passed for the binary and fluxmem-py (compute capability $CUDA_COMPUTE_CAP)"
