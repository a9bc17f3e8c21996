#!/usr/bin/env python3
"""Connect under several --memory-mb budgets on one store: wall time, CPU time, peak RSS, how
the night was fitted (groups of episodes, fact partitions), and whether the edges written are
the same as under the first budget (the sha256 of every edge shard the connect commits wrote).

A synthetic fleet (synth_fleet.py) with FACTS facts and EPISODES episodes is ingested and
embedded once; each budget connects its own copy of that store.

Usage:
  connect_memory.py --episodes 1000 --facts 100000 --budgets 4096,512,128,64 \\
      [--embedder hash-384] [--bin target/release/fluxmem] [--work DIR]
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
sys.path.insert(0, HERE)
from run import timed  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--episodes", type=int, required=True)
    parser.add_argument("--facts", type=int, required=True)
    parser.add_argument("--budgets", default="4096,512,128,64", help="comma list of --memory-mb values; the first is the reference")
    parser.add_argument("--embedder", default="hash-384")
    parser.add_argument("--bin", default=os.path.join(REPO, "target", "release", "fluxmem"))
    parser.add_argument("--work", default=None)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    budgets = [int(b) for b in args.budgets.split(",")]
    work = args.work or tempfile.mkdtemp(prefix="fluxmem-connect-memory-")
    for old in ("store", "logs") + tuple(f"store-{b}" for b in budgets):
        if os.path.exists(os.path.join(work, old)):
            shutil.rmtree(os.path.join(work, old))
    logs, store = os.path.join(work, "logs"), os.path.join(work, "store")
    os.makedirs(logs)
    log = open(os.path.join(work, "stderr.log"), "w")
    synth = [sys.executable, os.path.join(HERE, "synth_fleet.py")]
    common = ["--seed", str(args.seed), "--facts", str(args.facts)]
    subprocess.run(synth + ["facts", "--out", os.path.join(logs, "facts.jsonl")] + common, check=True)
    subprocess.run(synth + ["episodes", "--out", os.path.join(logs, "episodes.jsonl"), "--from", "0", "--to", str(args.episodes)] + common, check=True)
    model = ["--model", args.embedder]
    for cmd in (["ingest", logs], ["embed"] + model):
        timed([args.bin, "--store", store] + cmd, log)
    rows = []
    for budget in budgets:
        copy = os.path.join(work, f"store-{budget}")
        shutil.copytree(store, copy)
        before = {s["file"] for s in json.load(open(os.path.join(copy, "manifest.json")))["shards"]}
        wall, rss, stdout, cpu, stolen = timed([args.bin, "--store", copy, "connect", "--json", "--memory-mb", str(budget)] + model, log)
        report = json.loads(stdout)
        after = json.load(open(os.path.join(copy, "manifest.json")))["shards"]
        edges = sorted(s["sha256"] for s in after if s["file"] not in before and s["table"] == "edges")
        rows.append({"budget": budget, "wall": wall, "cpu": cpu, "stolen": stolen, "rss": rss, "groups": report["groups"],
                     "partitions": report.get("fact_partitions", 0), "ground": report["ground_edges"], "link": report["link_edges"], "edges": edges})
        shutil.rmtree(copy)
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "edges"}), file=sys.stderr)
    print(f"\nbenches/scale/connect_memory: {args.episodes} episodes, {args.facts} facts; {args.bin}; {args.embedder}; work dir {work}\n")
    print("| --memory-mb | wall s | CPU s | stolen s | peak RSS MB | RSS / budget | groups | fact partitions | ground edges | link edges | edges = first budget's |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        same = "yes" if r["edges"] == rows[0]["edges"] else "**no**"
        print(f"| {r['budget']} | {r['wall']:.1f} | {r['cpu']:.1f} | {r['stolen']:.1f} | {r['rss']:.0f} | {r['rss'] / r['budget']:.2f} | {r['groups']} | "
              f"{r['partitions'] or 'held whole'} | {r['ground']} | {r['link']} | {same} |")


if __name__ == "__main__":
    main()
