"""Consolidate's shards, run in one Ray actor that keeps the plan's models, commit what
`fluxmem run`'s shard processes commit.

The samples in data/ are ingested, embedded, connected and refined into one store, which is
copied twice. On one copy consolidate is planned (`--stage consolidate --plan`), run as 3 shard
processes (`--shard I/3`) and merged (`--merge 3`); on the other the same steps run, but the
3 shards run in one Ray Data actor (`fluxmem_ray.actors.ConsolidateActor`, through
`fluxmem_py.ConsolidateExecutor`: the models loaded once for all three). Both merges commit
shard files with the same SHA-256. An executor for a run with no plan is refused, naming the
command that plans. Needs FLUXMEM_BIN, the embedding model in FLUXMEM_MODELS and the
`fluxmem_py` module (scripts/test.sh builds it with maturin).
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import ray

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fluxmem_ray.actors import ConsolidateActor  # noqa: E402
from samples import binary, models_env, samples_pipeline  # noqa: E402

RUN_ID = "ray-consolidate-1"
SHARDS = 3

PIPELINE = samples_pipeline(
    """\
name = "ray-consolidate"
store = "store"
seed = 7
""",
    """\
# Skills worded by template (`generator = "none"`); mining, PEMS and eta run as in production.
[consolidate]
enabled = true
max_rounds = 1

[report]
dir = "runs"

# The merges' own shard files are compared.
[compact]
enabled = false
""",
)


def fluxmem(pipeline: Path, *args: str, codes=(0,)) -> dict:
    """Runs `fluxmem run` on ``pipeline``; returns the JSON record a plan, shard or merge
    prints last (``{}`` for a whole stage's run, which prints a summary for people)."""
    done = subprocess.run(
        [binary(), "run", str(pipeline), "--run-id", RUN_ID, "--no-progress", *args],
        capture_output=True, text=True, env={**os.environ, **models_env()},
    )
    assert done.returncode in codes, f"{args} failed ({done.returncode}):\n{done.stderr}"
    lines = done.stdout.splitlines()
    return json.loads(lines[-1]) if lines and lines[-1].startswith("{") else {}


def merged_files(store: Path) -> list:
    """(table, rows, sha256) of the shard files the consolidate merge committed."""
    manifest = json.loads((store / "manifest.json").read_text())
    merge = {c["version"] for c in manifest["commits"] if c["stage"] == "merge-consolidate"}
    return [(s["table"], s["rows"], s["sha256"]) for s in manifest["shards"] if s["commit"] in merge]


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("ray-consolidate")
    (root / "base").mkdir()
    (root / "base" / "pipeline.toml").write_text(PIPELINE)
    for stage in ("ingest", "embed", "connect", "refine"):
        fluxmem(root / "base" / "pipeline.toml", "--stage", stage)
    for name in ("processes", "actor"):
        shutil.copytree(root / "base", root / name)
    plans = {name: fluxmem(root / name / "pipeline.toml", "--stage", "consolidate", "--plan")
             for name in ("processes", "actor")}

    processes = root / "processes" / "pipeline.toml"
    # A shard whose clusters give no skill is degraded (exit 4), not failed.
    for index in range(SHARDS):
        fluxmem(processes, "--stage", "consolidate", "--shard", f"{index}/{SHARDS}", codes=(0, 4))
    fluxmem(processes, "--stage", "consolidate", "--merge", str(SHARDS))

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        rows = ray.data.from_items([{"id": i} for i in range(SHARDS)], override_num_blocks=SHARDS).map_batches(
            ConsolidateActor,
            fn_constructor_kwargs={"store": str(root / "actor" / "store"), "run_id": RUN_ID, "count": SHARDS,
                                   "env": models_env()},
            batch_size=1,
            compute=ray.data.ActorPoolStrategy(size=1),
            num_cpus=1,
        ).take_all()
    finally:
        ray.shutdown()
    fluxmem(root / "actor" / "pipeline.toml", "--stage", "consolidate", "--merge", str(SHARDS))
    return {"root": root, "plans": plans, "rows": sorted(rows, key=lambda r: r["shard"])}


def test_one_actor_runs_every_shard_of_the_plan(stores):
    rows, plan = stores["rows"], stores["plans"]["actor"]["details"]
    assert [r["shard"] for r in rows] == list(range(SHARDS))
    assert len({r["pid"] for r in rows}) == 1, "one actor, its models loaded once, ran the three shards"
    records = [json.loads(r["record"]) for r in rows]
    assert all(r["exit_code"] in (0, 4) for r in rows), rows
    assert all(rec["details"]["shared_plan"] == plan["sha256"] for rec in records), records
    handled = [rec["details"]["clusters"] - rec["details"]["other_shards"] for rec in records]
    assert sum(handled) == plan["clusters"] > 0, (handled, plan)
    assert sum(rec["counts_out"]["skills_new"] for rec in records) > 0, records


def test_the_merges_commit_the_same_shard_files(stores):
    root = stores["root"]
    processes = merged_files(root / "processes" / "store")
    assert {table for table, _, _ in processes} >= {"nodes", "edges", "embeddings"}, processes
    assert merged_files(root / "actor" / "store") == processes


def test_an_executor_without_a_plan_is_refused(stores):
    import fluxmem_py

    with pytest.raises(ValueError, match="--stage consolidate --plan"):
        fluxmem_py.ConsolidateExecutor(str(stores["root"] / "base" / "store"), "no-such-run")
