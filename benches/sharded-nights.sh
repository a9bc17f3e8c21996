#!/usr/bin/env bash
# A sharded night reads only new files: two nights of `fluxmem run --stage ingest` in N shards
# and a merge, the first over F files of R records, the second with F/20 new files beside them.
# Prints, per binary given, the files each night's shards read and left unread (the ledger's)
# and the night's wall time.
#
#   bash benches/sharded-nights.sh target/debug/fluxmem [OTHER_BINARY...]
#
# Environment: FILES (200), RECORDS (200), SHARDS (2). Uses a temporary directory.
set -euo pipefail
files=${FILES:-200} records=${RECORDS:-200} shards=${SHARDS:-2}
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
log() { # log NAME FIRST: a JSONL file of $records episodes from id FIRST
  python3 - "$work/logs/$1" "$2" "$records" <<'PY'
import sys
path, first, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
with open(path, "w") as out:
    for k in range(first, first + count):
        out.write('{"episode_id":"e%d","task":"refund order %d","steps":[{"observation":"please refund %d","action":"refund"}],"outcome":{"success":true}}\n' % (k, k, k))
PY
}
cat > "$work/p.toml" <<'TOML'
name = "sharded-nights"
store = "store"
seed = 1
[models]
embedder = "all-minilm-l6-v2"
generator = "none"
judge = "none"
device = "cpu"
[[inputs]]
paths = ["logs/*.jsonl"]
TOML
printf "| binary | night | files in the folder | files read (all shards) | left unread by the ledger | seconds |\n|---|---|---|---|---|---|\n"
for given in "$@"; do
  bin="$(realpath "$given")"
  rm -rf "$work/store" "$work/logs"
  mkdir -p "$work/logs"
  for ((f = 0; f < files; f++)); do log "a-$f.jsonl" $((f * records)); done
  for night in 1 2; do
    if [ "$night" = 2 ]; then
      for ((f = 0; f < files / 20; f++)); do log "b-$f.jsonl" $(((files + f) * records)); done
    fi
    start=$(date +%s.%N)
    read_total=0 unread_total=0
    for ((i = 0; i < shards; i++)); do
      out=$(cd "$work" && "$bin" run p.toml --stage ingest --shard "$i/$shards" --json 2>/dev/null | tail -1)
      read_total=$((read_total + $(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["counts_in"]["files"])' "$out")))
      unread_total=$((unread_total + $(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["counts_in"].get("unchanged_files", 0))' "$out")))
    done
    (cd "$work" && "$bin" run p.toml --stage ingest --merge "$shards" > /dev/null 2>&1)
    end=$(date +%s.%N)
    printf "| %s | %s | %s | %s | %s | %.2f |\n" "$given" "$night" "$(ls "$work/logs" | wc -l)" "$read_total" "$unread_total" "$(echo "$end - $start" | bc)"
  done
done
