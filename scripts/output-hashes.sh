#!/usr/bin/env bash
# The sha256 of every shard and key-index file, and of every exported skill file, that a binary
# writes for the demo pipeline and for a dev pipeline (tau-bench and ALFWorld dev of
# ../shared/data, generator none): the check that a refactor changes no output. Both run with
# `--run-id night` in a fixed folder, so two binaries' listings compare line for line:
#
#   bash scripts/output-hashes.sh BIN OUT.txt      # e.g. a build of the commit before, then after
#   diff before.txt after.txt                      # empty: the outputs are byte-identical
#
# The dev pipeline needs ../shared/data (FLUXMEM_DEV_DATA overrides); without it only the
# demo's are listed. Takes a few minutes (the demo runs the 1.5B generator).
set -euo pipefail
bin="$(realpath "$1")"
out="$(realpath -m "$2")"
repo="$(cd "$(dirname "$0")/.." && pwd)"
data="${FLUXMEM_DEV_DATA:-$repo/../shared/data}"
work=/tmp/fluxmem-output-hashes
rm -rf "$work" && mkdir -p "$work"
sed -e "s#^store = .*#store = \"$work/demo-store\"#" -e "s#\.\./fluxmem-out#$work/demo-out#" \
  -e "s#\.\./data/#$repo/data/#g" -e "s#\.\./\.\./shared/data/#$data/#" \
  "$repo/pipelines/demo.toml" > "$work/demo.toml"
(cd "$repo" && "$bin" run --run-id night "$work/demo.toml" > "$work/demo.log" 2>&1)
runs=(demo)
if [ -d "$data" ]; then
  cat > "$work/dev.toml" <<TOML
name = "dev"
store = "$work/dev-store"
seed = 42
[models]
embedder = "all-minilm-l6-v2"
generator = "none"
judge = "none"
device = "cpu"
[[inputs]]
paths = ["$data/tau-bench/gpt-4o-airline_dev.json"]
format = "tau-bench"
tenant = "airline"
[[inputs]]
paths = ["$data/alfworld/alfworld_3prompts_dev.json"]
format = "alfworld"
tenant = "alfworld"
[consolidate]
clusters = "auto"
max_rounds = 2
[export]
format = "skill-md"
out = "$work/dev-out/skills"
[report]
dir = "$work/dev-out/runs"
TOML
  "$bin" run --run-id night "$work/dev.toml" > "$work/dev.log" 2>&1
  runs+=(dev)
fi
: > "$out"
for run in "${runs[@]}"; do
  (cd "$work/$run-store" && find shards keys -type f | sort | xargs sha256sum | sed "s#^#$run store #") >> "$out"
  (cd "$work/$run-out/skills" && find . -type f | sort | xargs sha256sum | sed "s#^#$run skills #") >> "$out"
done
echo "output-hashes: $(wc -l < "$out") files listed in $out (runs: ${runs[*]})"
