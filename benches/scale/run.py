#!/usr/bin/env python3
"""benches/scale: what a night costs as the history grows.

Runs night 1 over N synthetic episodes (benches/scale/synth_fleet.py: 2 tenants, 40 task
families, 400 facts, 4-7 steps an episode), then nights 2.. with N/10 new episodes each, every
stage as its own `fluxmem` command under /usr/bin/time, the way a nightly job runs them. The log
folder keeps every night's file, as a fleet's log archive does: ingest's ledger must skip the
old ones. Prints, per night and stage, wall seconds, peak RSS, rows and bytes written, and the
store's size and amplification (rows stored / live rows, from `store compact --json`).

Usage: benches/scale/run.py --episodes N [--nights K] [--bin target/release/fluxmem]
                            [--work DIR] [--consolidate] [--json OUT] [--embedder NAME]

--embedder hash-384 runs embed and connect on the weight-free hashing embedder: the store-bound
costs (reading, writing, kNN, BM25, credit, compaction) at a size where the 2 CPU cores cannot
afford the neural model's forward passes; embed's and connect's model time is then not in the
table (measure it with the default model at a smaller N).

Build first: cargo build --release. Embedding runs the local all-minilm-l6-v2 (fetched by
scripts/test.sh or `fluxmem models fetch`).
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def manifest(store):
    path = os.path.join(store, "manifest.json")
    if not os.path.exists(path):
        return {"shards": [], "version": 0}
    return json.load(open(path))


def index_bytes(store, shard):
    """Bytes of a shard's key index file, 0 when it has none (steps, edits)."""
    path = os.path.join(store, "keys", os.path.basename(shard["file"]) + ".keys")
    return os.path.getsize(path) if os.path.exists(path) else 0


def disk_bytes(store):
    total = 0
    for root, _, files in os.walk(store):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    return total


def steal_seconds():
    """CPU time the hypervisor gave to others, all cores (from /proc/stat; 0 where absent)."""
    try:
        fields = open("/proc/stat").readline().split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK") if len(fields) > 8 else 0.0
    except (OSError, ValueError):
        return 0.0


def timed(cmd, log):
    """Runs cmd; returns (wall seconds, peak RSS MB, stdout, CPU seconds (user + system), stolen seconds)."""
    with tempfile.NamedTemporaryFile("r", suffix=".time") as tf:
        full = ["/usr/bin/time", "-f", "%e %M %U %S", "-o", tf.name] + cmd
        stolen = steal_seconds()
        out = subprocess.run(full, stdout=subprocess.PIPE, stderr=log, text=True)
        stolen = steal_seconds() - stolen
        if out.returncode not in (0, 3):
            sys.exit(f"{' '.join(cmd)} failed with {out.returncode}; see {log.name}")
        wall, rss_kb, user, system = tf.read().split()[-4:]
    return float(wall), int(rss_kb) / 1024, out.stdout, float(user) + float(system), stolen


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--episodes", type=int, required=True)
    parser.add_argument("--nights", type=int, default=2)
    parser.add_argument("--bin", default=os.path.join(REPO, "target", "release", "fluxmem"))
    parser.add_argument("--work", default=None)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--consolidate", action="store_true", help="also run consolidate (the generator: slow on CPU)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--last-night", type=int, default=None, metavar="EPISODES", help="episodes of the last night (default N/10): the same small night on stores of different sizes shows what grows with history")
    parser.add_argument("--snapshot", default=None, metavar="STAGE", help="copy the store to WORK/before-STAGE before the last night's STAGE (to profile it again)")
    parser.add_argument("--facts", type=int, default=None, help="facts of the fleet (synth_fleet.py's default: 400)")
    parser.add_argument("--connect-memory-mb", type=int, default=None, help="connect's --memory-mb (default: connect's)")
    parser.add_argument("--embedder", default=None, help="embedding model of embed and connect (default: the store default; hash-384: no model)")
    args = parser.parse_args()
    work = args.work or tempfile.mkdtemp(prefix=f"fluxmem-scale-{args.episodes}-")
    # A fresh store and log folder: logs of an earlier run would be night 1's input.
    for old in ("store", "logs"):
        if os.path.exists(os.path.join(work, old)):
            shutil.rmtree(os.path.join(work, old))
    logs = os.path.join(work, "logs")
    os.makedirs(logs, exist_ok=True)
    store = os.path.join(work, "store")
    log = open(os.path.join(work, "stderr.log"), "w")
    synth = [sys.executable, os.path.join(HERE, "synth_fleet.py")]
    facts = ["--facts", str(args.facts)] if args.facts else []
    subprocess.run(synth + ["facts", "--out", os.path.join(logs, "facts.jsonl"), "--seed", str(args.seed)] + facts, check=True)
    fm = [args.bin, "--store", store]
    model = ["--model", args.embedder] if args.embedder else []
    stages = [("ingest", ["ingest", logs]), ("embed", ["embed"] + model), ("connect", ["connect", "--json"] + model + (["--memory-mb", str(args.connect_memory_mb)] if args.connect_memory_mb else [])), ("refine", ["refine"])]
    if args.consolidate:
        stages.append(("consolidate", ["consolidate"] + model))
    # Compaction, then the export of the skills (without --consolidate there are none: it then
    # measures the read an export makes to find them).
    tail = [("compact", ["store", "compact", "--json"]), ("export", ["export", "skills", "--out", os.path.join(work, "export")])]
    rows = []
    start = 0
    for night in range(1, args.nights + 1):
        count = args.episodes if night == 1 else max(1, args.episodes // 10)
        if night == args.nights and night > 1 and args.last_night:
            count = args.last_night
        path = os.path.join(logs, f"episodes-night{night:02d}.jsonl")
        subprocess.run(synth + ["episodes", "--out", path, "--from", str(start), "--to", str(start + count), "--seed", str(args.seed)] + facts, check=True)
        start += count
        for name, cmd in stages + tail:
            if name == args.snapshot and night == args.nights:
                copy = os.path.join(work, f"before-{name}")
                if os.path.exists(copy):
                    shutil.rmtree(copy)
                shutil.copytree(store, copy)
            before = manifest(store)
            listed = {s["file"] for s in before["shards"]}
            wall, rss, stdout, cpu, stolen = timed(fm + cmd, log)
            after = manifest(store)
            new = [s for s in after["shards"] if s["file"] not in listed]
            row = {
                "night": night, "new_episodes": count, "stage": name, "seconds": wall, "rss_mb": round(rss, 1),
                "cpu_seconds": round(cpu, 2), "stolen_seconds": round(stolen, 2),
                "rows_written": sum(s["rows"] for s in new),
                # A keyed shard's key index (keys/<shard>.keys) is written with it and counted with it.
                "bytes_written": sum(s["bytes"] + index_bytes(store, s) for s in new),
                "store_bytes": sum(s["bytes"] + index_bytes(store, s) for s in after["shards"]), "disk_bytes": disk_bytes(store),
            }
            if name == "connect":
                report = json.loads(stdout)
                row["groups"], row["fact_partitions"] = report["groups"], report.get("fact_partitions", 0)
            if name == "compact":
                report = json.loads(stdout)
                row["amplification"] = {t: round(v["rows_after"] / max(1, v["live_rows"]), 3) for t, v in report["tables"].items() if t != "edits"}
                row["live_rows"] = {t: v["live_rows"] for t, v in report["tables"].items()}
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
    embedder = args.embedder or "the default embedder"
    print(f"\nbenches/scale: N = {args.episodes} episodes, then {args.nights - 1} night(s) of N/10; {args.bin}; {embedder}; work dir {work}\n")
    # CPU s: user + system of the command (less sensitive than wall time to a busy host);
    # stolen s: CPU time the hypervisor gave to other guests meanwhile, all cores (a noisy run).
    # MB written and store MB: shards with their key indexes; disk MB: everything under the
    # store directory (retired shards kept for readers, the commit history, the ingest ledger).
    print("| night | stage | wall s | CPU s | stolen s | peak RSS MB | rows written | MB written | store MB | disk MB | amplification (nodes/edges/embeddings) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        amp = r.get("amplification")
        amp = "/".join(f"{amp.get(t, 1.0):.2f}" for t in ("nodes", "edges", "embeddings")) if amp else ""
        print(f"| {r['night']} (+{r['new_episodes']}) | {r['stage']} | {r['seconds']:.1f} | {r['cpu_seconds']:.1f} | {r['stolen_seconds']:.1f} | {r['rss_mb']:.0f} | {r['rows_written']} | "
              f"{r['bytes_written'] / 1e6:.2f} | {r['store_bytes'] / 1e6:.2f} | {r['disk_bytes'] / 1e6:.2f} | {amp} |")
    for r in rows:
        if r["stage"] == "connect" and (r["groups"] > 1 or r["fact_partitions"]):
            print(f"\nnight {r['night']}: connect took the night's episodes in {r['groups']} group(s)"
                  + (f" and spilled the facts to {r['fact_partitions']} partitions" if r["fact_partitions"] else "") + " to fit its --memory-mb")
    if args.nights >= 2:
        print("\n| stage | night 2 / night 1, wall | night 2 / night 1, CPU | night 2 / night 1, bytes written |")
        print("|---|---|---|---|")
        for name in [s for s, _ in stages + tail]:
            one = next(r for r in rows if r["night"] == 1 and r["stage"] == name)
            two = next(r for r in rows if r["night"] == 2 and r["stage"] == name)
            ratio = lambda a, b: f"{a / b:.2f}" if b else "n/a"
            print(f"| {name} | {ratio(two['seconds'], one['seconds'])} | {ratio(two['cpu_seconds'], one['cpu_seconds'])} | {ratio(two['bytes_written'], one['bytes_written'])} |")
    if args.json:
        json.dump(rows, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
