#!/usr/bin/env python3
"""Rows per second of the map stages through the Ray path, against the in-process run.

The same synthetic fleet (benches/scale/synth_fleet.py) goes through ingest, embed and connect
twice with the same pipeline and run id: once as `fluxmem run --stage S` per stage (one process
a stage, on this machine), once through `fluxmem_ray.run_pipeline` on a local Ray (`ray.init`
with this machine's CPUs, N shards a stage, then the merge). Each stage's wall time includes
starting its processes and loading its model; the Ray path's includes its shards, the merge and
Ray's scheduling. The ratio is the Ray path's rows/s over the in-process run's, on the same
machine with the same threads (1.00: the plumbing costs nothing; on one machine the shards
compete for the same cores, so a ratio below 1 is the plumbing's cost, not a speed-up lost).

The Ray path runs twice: embed's execute step in Ray Data actors that keep the model loaded
(`actors`: fluxmem_py, built by scripts/test.sh) and in one `fluxmem` process a shard
(`processes`); both plan first and commit the same shards. Each embedder of `--embedders` gets
its table: `hash-384` is the weight-free hashing embedder
(a model that does next to nothing: the plumbing's cost alone), `all-minilm-l6-v2` the default.

Usage (from the repository root, with the Ray venv that scripts/test.sh installs):
  .venv/bin/python benches/ray_plumbing.py --bin target/debug/fluxmem [--episodes 2000]
      [--shards 2] [--embedders hash-384,all-minilm-l6-v2] [--work DIR]
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "integrations" / "ray"))

STAGES = ("ingest", "embed", "connect")
PIPELINE = """\
name = "ray-plumbing"
store = "{store}"
seed = 7

[models]
device = "cpu"
embedder = "{embedder}"
generator = "none"
judge = "none"

[[inputs]]
paths = ["{episodes}", "{facts}"]

[consolidate]
enabled = false

[export]
enabled = false

[report]
dir = "{store}-runs"
"""


def synth(kind, out, args, extra):
    command = [sys.executable, str(REPO / "benches" / "scale" / "synth_fleet.py"), kind, "--out", out, "--seed", "7"]
    subprocess.run(command + extra, check=True)


def pipeline(work, name, episodes, facts, embedder):
    path = os.path.join(work, f"{name}.toml")
    with open(path, "w") as out:
        out.write(PIPELINE.format(store=name, episodes=episodes, facts=facts, embedder=embedder))
    return path


def rows_of(record, stage):
    """The rows a stage worked on, from its record's counts."""
    counts = record["counts_out"]
    return {"ingest": counts.get("ingested", 0), "embed": counts.get("embedded", 0), "connect": counts.get("connected", 0)}[stage]


def in_process(binary, path):
    """Each stage as one `fluxmem run --stage S` process: (wall seconds, rows) per stage."""
    out = {}
    for stage in STAGES:
        started = time.monotonic()
        done = subprocess.run([binary, "run", path, "--run-id", "bench", "--stage", stage, "--json", "--no-progress"],
                              capture_output=True, text=True, check=True)
        seconds = time.monotonic() - started
        run = json.loads(done.stdout.strip().splitlines()[-1])
        record = next(s for s in run["stages"] if s["name"] == stage)
        out[stage] = (seconds, rows_of(record, stage))
    return out


def through_ray(binary, path, shards, embed_in_actors):
    """The same stages through fluxmem_ray: (wall seconds, rows) per stage. Embed and connect
    plan, then execute their model work in actors that keep the model (``embed_in_actors``) or
    in one process a shard, then commit: their rows are the commit's."""
    import fluxmem_ray

    options = fluxmem_ray.Options(shards=shards, stages=STAGES, gpus_per_worker=0.0, embed_in_actors=embed_in_actors)
    summary = fluxmem_ray.run_pipeline(path, "bench", options, binary=binary)
    out = {}
    for stage in summary.stages:
        if "plan" in stage:
            # A planned stage (embed, connect): its shards or actors embed texts, its commit
            # does the stage's work.
            rows = rows_of(stage["merge"]["record"], stage["name"])
        else:
            rows = sum(rows_of(s["record"], stage["name"]) for s in stage["shards"])
        out[stage["name"]] = (stage["seconds"], rows)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bin", required=True)
    parser.add_argument("--episodes", type=int, default=2000)
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--embedders", default="hash-384,all-minilm-l6-v2")
    parser.add_argument("--work")
    args = parser.parse_args()
    binary = os.path.abspath(args.bin)
    work = args.work or tempfile.mkdtemp(prefix="fluxmem-ray-plumbing-")
    os.makedirs(work, exist_ok=True)
    episodes = os.path.join(work, "episodes.jsonl")
    facts = os.path.join(work, "facts.jsonl")
    synth("episodes", episodes, args, ["--from", "0", "--to", str(args.episodes), "--tenants", "4"])
    synth("facts", facts, args, ["--tenants", "4"])
    import ray

    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    tables = []
    try:
        for embedder in args.embedders.split(","):
            for name in ("local", "actors", "processes"):
                shutil.rmtree(os.path.join(work, name), ignore_errors=True)
                shutil.rmtree(os.path.join(work, f"{name}-runs"), ignore_errors=True)
            local = in_process(binary, pipeline(work, "local", episodes, facts, embedder))
            for name, in_actors in (("actors", True), ("processes", False)):
                ray_path = through_ray(binary, pipeline(work, name, episodes, facts, embedder), args.shards, in_actors)
                tables.append((embedder, name, local, ray_path))
    finally:
        ray.shutdown()
    print(f"ray plumbing: {args.episodes} episodes of 4 tenants, {args.shards} shards, {os.cpu_count()} CPUs, bin {args.bin}")
    print(f"{'embedder':<18}{'ray embed':<11}{'stage':<10}{'rows':>8}{'local s':>10}{'local rows/s':>14}{'ray s':>9}{'ray rows/s':>12}{'ratio':>8}")
    for embedder, name, local, ray_path in tables:
        for stage in STAGES:
            (ls, lr), (rs, rr) = local[stage], ray_path[stage]
            if lr != rr:
                raise SystemExit(f"{stage}: the Ray path worked on {rr} rows, the local run on {lr}")
            lrate, rrate = lr / ls, rr / rs
            print(f"{embedder:<18}{name:<11}{stage:<10}{lr:>8}{ls:>10.1f}{lrate:>14.0f}{rs:>9.1f}{rrate:>12.0f}{rrate / lrate:>8.2f}")


main()
