#!/usr/bin/env python3
"""`query` latency and peak RSS for one tenant, alone in its store and beside other tenants'
data (OTHERS times as many episodes, in TENANTS other tenants), with the hashing embedder.

The tenant's store is ingested, embedded, connected and indexed (`store index`; not with
--no-index) once; a copy gets the other tenants'
episodes and facts, embedded and connected too. QUERIES questions (the tenant's task families,
seeded) are asked of each store, one `fluxmem query` process each, as a service would; wall time
and peak RSS per query come from /usr/bin/time. The table gives p50 and p95 of each and the
ratio of the crowded store to the lone one (1.00: the other tenants cost nothing).

Usage:
  query_tenants.py --episodes 1000 [--others 10] [--tenants 10] [--queries 50]
                   [--embedder hash-384] [--bin target/release/fluxmem] [--work DIR] [--no-index]
"""
import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
from run import timed  # noqa: E402

TENANT = "tenant0"


def synth(kind, out, args, extra):
    cmd = [sys.executable, os.path.join(HERE, "synth_fleet.py"), kind, "--out", out] + extra
    subprocess.run(cmd, check=True)


def renamed(path, prefix):
    """The file with every tenant renamed `prefix` + name (other tenants never share a name)."""
    out = path[: -len(".jsonl")] + "-renamed.jsonl"
    with open(path) as src, open(out, "w") as dst:
        for line in src:
            record = json.loads(line)
            record["tenant"] = prefix + record.get("tenant", "default")
            dst.write(json.dumps(record) + "\n")
    return out


def night(store, files, args, log):
    fluxmem = [args.bin, "--store", store, "--no-progress"]
    subprocess.run(fluxmem + ["ingest"] + files, check=True, stdout=log, stderr=log)
    for stage in (["embed"], ["connect"]):
        subprocess.run(fluxmem + stage + ["--model", args.embedder], check=True, stdout=log, stderr=log)
    if not args.no_index:
        # What `fluxmem run` does after its stages: the tenants' vector indexes.
        subprocess.run(fluxmem + ["store", "index"], check=True, stdout=log, stderr=log)


def queries(store, texts, args, log):
    walls, rss = [], []
    for text in texts:
        cmd = [args.bin, "--store", store, "--no-progress", "query", "--tenant", TENANT, "--model", args.embedder, "--json", text]
        wall, peak, _, _, _ = timed(cmd, log)
        walls.append(wall * 1000)
        rss.append(peak)
    return walls, rss


def p(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--episodes", type=int, required=True)
    parser.add_argument("--others", type=int, default=10)
    parser.add_argument("--tenants", type=int, default=10)
    parser.add_argument("--queries", type=int, default=50)
    parser.add_argument("--embedder", default="hash-384")
    parser.add_argument("--bin", default=os.path.join(REPO, "target", "release", "fluxmem"))
    parser.add_argument("--work", default=None)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--no-index", action="store_true", help="no `store index` after the nights (queries read the shards)")
    args = parser.parse_args()
    work = args.work or tempfile.mkdtemp(prefix="fluxmem-query-tenants-")
    os.makedirs(work, exist_ok=True)
    log = open(os.path.join(work, "log.txt"), "w")
    mine_episodes = os.path.join(work, "mine.jsonl")
    mine_facts = os.path.join(work, "mine-facts.jsonl")
    synth("episodes", mine_episodes, args, ["--from", "0", "--to", str(args.episodes), "--tenants", "1", "--seed", str(args.seed)])
    synth("facts", mine_facts, args, ["--tenants", "1", "--seed", str(args.seed)])
    lone = os.path.join(work, "lone")
    shutil.rmtree(lone, ignore_errors=True)
    night(lone, [mine_episodes, mine_facts], args, log)
    crowded = os.path.join(work, "crowded")
    shutil.rmtree(crowded, ignore_errors=True)
    shutil.copytree(lone, crowded)
    theirs = os.path.join(work, "theirs.jsonl")
    their_facts = os.path.join(work, "theirs-facts.jsonl")
    n = args.episodes * args.others
    synth("episodes", theirs, args, ["--from", "0", "--to", str(n), "--tenants", str(args.tenants), "--seed", str(args.seed + 1)])
    synth("facts", their_facts, args, ["--tenants", str(args.tenants), "--seed", str(args.seed + 1), "--facts", str(400 * args.others)])
    night(crowded, [renamed(theirs, "other-"), renamed(their_facts, "other-")], args, log)
    texts = []
    with open(mine_episodes) as f:
        tasks = [json.loads(line)["task"] for line in f]
    rng = random.Random(args.seed)
    texts = [rng.choice(tasks) for _ in range(args.queries)]
    rows = {}
    for name, store in (("alone", lone), ("beside others", crowded)):
        rows[name] = queries(store, texts, args, log)
    print(f"query of tenant {TENANT} ({args.episodes} episodes), {args.queries} queries, embedder {args.embedder}, bin {args.bin}, {'no index' if args.no_index else 'indexed'}")
    print(f"other tenants: {args.tenants} tenants, {n} episodes, {400 * args.others} facts")
    print(f"{'store':<16}{'p50 ms':>10}{'p95 ms':>10}{'p50 RSS MB':>12}{'p95 RSS MB':>12}")
    for name, (walls, rss) in rows.items():
        print(f"{name:<16}{p(walls, 0.5):>10.0f}{p(walls, 0.95):>10.0f}{p(rss, 0.5):>12.1f}{p(rss, 0.95):>12.1f}")
    (w1, r1), (w2, r2) = rows["alone"], rows["beside others"]
    print(f"{'ratio':<16}{p(w2, .5) / p(w1, .5):>10.2f}{p(w2, .95) / p(w1, .95):>10.2f}{p(r2, .5) / p(r1, .5):>12.2f}{p(r2, .95) / p(r1, .95):>12.2f}")


main()
