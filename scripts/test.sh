#!/usr/bin/env bash
# Runs the whole fluxmem test suite. First installs what a fresh machine lacks (idempotent,
# quick when everything is there): the Python packages the shard-reading test uses and the
# local models the model tests use.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! .venv/bin/python -c "import pyarrow, duckdb" 2>/dev/null; then
  echo "setting up .venv for the Python shard-reading test" >&2
  python3 -m venv .venv
  .venv/bin/pip install --quiet --disable-pip-version-check -r tests/python/requirements.txt
fi

# Models the real-model tests use (cached in FLUXMEM_MODELS, default ~/.cache/fluxmem/models;
# a no-op when already installed and verified).
cargo run --quiet -- models fetch all-minilm-l6-v2 smollm2-135m-instruct-q4_1 gemma3-270m-q4_k_m

cargo test --workspace "$@"
