#!/usr/bin/env bash
# Runs the whole fluxmem test suite. First installs what a fresh machine lacks (idempotent,
# quick when everything is there): the Python packages the shard-reading test uses and the
# local models the model tests use, and Ray for the Ray integration's test.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! .venv/bin/python -c "import pyarrow, duckdb, skills_ref" 2>/dev/null; then
  echo "setting up .venv for the Python shard-reading and skill-validation tests" >&2
  python3 -m venv .venv
  .venv/bin/pip install --quiet --disable-pip-version-check -r tests/python/requirements.txt
fi
if ! .venv/bin/python -c "import ray.data, pytest" 2>/dev/null || ! [ -x .venv/bin/maturin ]; then
  echo "installing Ray and maturin into .venv for the Ray integration test (integrations/ray)" >&2
  .venv/bin/pip install --quiet --disable-pip-version-check -r integrations/ray/requirements.txt
fi

# Models the real-model tests use (cached in FLUXMEM_MODELS, default ~/.cache/fluxmem/models;
# a no-op when already installed and verified).
cargo run --quiet -- models fetch all-minilm-l6-v2 smollm2-135m-instruct-q4_1 gemma3-270m-q4_k_m \
  qwen2.5-coder-0.5b-instruct-q4_k_m qwen2.5-coder-1.5b-instruct-q4_k_m

# Tests named `dev_data_*` measure on the dev data in ../shared/data (the project's shared folder
# beside the repo; FLUXMEM_DEV_DATA overrides). Where it is missing they are left out, and this
# says which; everything else still runs.
dev_data="${FLUXMEM_DEV_DATA:-$PWD/../shared/data}"
if [ -d "$dev_data" ]; then
  export FLUXMEM_DEV_DATA="$dev_data"
  cargo test --workspace "$@"
else
  skipped=$(grep -rhoE --include='*.rs' 'fn dev_data_[a-z0-9_]+' crates tests src | sed 's/^fn //' | sort | paste -sd, -)
  note="NOTE: dev-data tests not run (no dev data at $dev_data; put the project's shared/ beside the repo or set FLUXMEM_DEV_DATA): ${skipped//,/, }"
  # Said once, last, whether the rest passes or fails.
  trap 'echo "$note" >&2' EXIT
  cargo test --workspace "$@" -- --skip dev_data_
fi

# The Ray integration: the pipeline through Ray (2 shards, a logical GPU) gives the same store
# as the single-machine run, and embed's execute step in actors that keep the model commits the
# single run's shard files. Uses the binary cargo test just built (in CARGO_TARGET_DIR when set)
# and the actors' extension module fluxmem_py (crates/fluxmem-py), built here into .venv.
VIRTUAL_ENV="$PWD/.venv" .venv/bin/maturin develop --quiet -m crates/fluxmem-py/Cargo.toml
PYTHONDONTWRITEBYTECODE=1 FLUXMEM_BIN="${CARGO_TARGET_DIR:-$PWD/target}/debug/fluxmem" .venv/bin/python -m pytest -q -rA -p no:cacheprovider integrations/ray/tests
