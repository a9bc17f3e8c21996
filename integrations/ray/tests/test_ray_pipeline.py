"""The Ray path gives the same store as the single-machine run (the oracle).

Runs the samples in data/ through `fluxmem_ray.run_pipeline` on a local Ray with a logical GPU
(`ray.init(num_cpus=2, num_gpus=1)`, 2 shards, half a GPU per actor so both shards can run at
once) and through `fluxmem run` on another store with the same run id, then compares the two
stores table by table with pyarrow.

Needs FLUXMEM_BIN (the built binary; scripts/test.sh sets it to target/debug/fluxmem) and the
embedding model in FLUXMEM_MODELS (scripts/test.sh fetches it).
"""

import json
import struct
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fluxmem_ray  # noqa: E402
from samples import binary, models_env, samples_pipeline  # noqa: E402

RUN_ID = "ray-equivalence-1"
SHARDS = 2
# Everything is compared exactly, floats bit for bit. A text's embedding is a function of the
# text alone (it is padded to a length bucket of its own token count, and the CPU kernels never
# split a reduction across threads or rows; see crates/fluxmem-models/src/bert.rs), so the shards,
# which batch different subsets, produce the same vectors as the single run, and every weight,
# score and edit derived from them is then the same computation on the same numbers.

PIPELINE = samples_pipeline(
    """\
name = "ray-test"
store = "store"
seed = 7
""",
    """\
# Consolidate is a map stage: each shard clusters the same store and induces the skills of the
# clusters it owns. Skills are worded by template (`generator = "none"`: the real generator
# costs minutes per cluster in a debug build); mining, PEMS and eta run as in production.
[consolidate]
enabled = true
max_rounds = 1

# The export is a global stage and is tested elsewhere.
[export]
enabled = false
format = "jsonl"
out = "out/skills"

[report]
dir = "out/runs"

# The single run would compact after its stages, which the Ray driver does not: the stages'
# own shard files are compared (compaction is tested on its own).
[compact]
enabled = false
""",
)

KEYS = {
    "nodes": ("id",),
    "steps": ("episode_id", "step_index"),
    "edges": ("src", "dst", "kind"),
    "embeddings": ("node_id", "model_id"),
}


def live_rows(store: Path, table: str) -> dict:
    """The store's rows of `table` by key: for a key in several shards the highest commit wins."""
    manifest = json.loads((store / "manifest.json").read_text())
    rows = {}
    for shard in sorted((s for s in manifest["shards"] if s["table"] == table), key=lambda s: s["commit"]):
        for row in pq.read_table(store / shard["file"]).to_pylist():
            rows[tuple(row[k] for k in KEYS[table])] = row
    return rows


def edit_log(store: Path) -> dict:
    """The edit records by (stage, kind, target); each key appears once in these runs."""
    manifest = json.loads((store / "manifest.json").read_text())
    files = [store / s["file"] for s in manifest["shards"] if s["table"] == "edits"]
    rows = pa.concat_tables([pq.read_table(f) for f in files]).to_pylist() if files else []
    log = {}
    for row in rows:
        key = (row["stage"], row["kind"], row["target"])
        assert key not in log, f"edit {key} recorded twice in {store}"
        log[key] = {k: row[k] for k in ("run_id", "before", "after", "reason")}
    return log


def assert_same(expected, actual, where):
    """Equal JSON-like values; floats must be identical (same bits, so -0.0 != 0.0 and NaN == NaN)."""
    if isinstance(expected, float) or isinstance(actual, float):
        assert isinstance(actual, float) and isinstance(expected, float), (where, expected, actual)
        assert struct.pack("<d", expected) == struct.pack("<d", actual), (where, expected, actual)
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and sorted(expected) == sorted(actual), (where, expected, actual)
        for key in expected:
            assert_same(expected[key], actual[key], f"{where}.{key}")
    elif isinstance(expected, list):
        assert isinstance(actual, list) and len(expected) == len(actual), (where, expected, actual)
        for i, (a, b) in enumerate(zip(expected, actual)):
            assert_same(a, b, f"{where}[{i}]")
    else:
        assert expected == actual, (where, expected, actual)


def parsed(value):
    return json.loads(value) if isinstance(value, str) and value[:1] in "{[" else value


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("ray-equivalence")
    text = PIPELINE
    pipelines = {}
    for name in ("single", "ray"):
        (root / name).mkdir()
        pipelines[name] = root / name / "pipeline.toml"
        pipelines[name].write_text(text)
    env = models_env()

    single = subprocess.run(
        [binary(), "run", str(pipelines["single"]), "--run-id", RUN_ID, "--no-progress", "--json"],
        capture_output=True, text=True, env={**os.environ, **env},
    )
    assert single.returncode == 0, f"single-machine run failed ({single.returncode}):\n{single.stderr}"
    single_record = json.loads(single.stdout.splitlines()[-1])

    ray.init(num_cpus=2, num_gpus=1, include_dashboard=False, log_to_driver=False)
    try:
        summary = fluxmem_ray.run_pipeline(
            str(pipelines["ray"]), RUN_ID, fluxmem_ray.Options(shards=SHARDS, gpus_per_worker=0.5), binary=binary(), env=env
        )
    finally:
        ray.shutdown()
    print()
    print("single machine:", ", ".join(f"{s['name']} {s['seconds']:.1f}s" for s in single_record["stages"]))
    print(summary.table())
    return {"single": root / "single" / "store", "ray": root / "ray" / "store", "summary": summary, "single_record": single_record}


def test_map_stages_fanned_out_on_gpu_actors(stores):
    summary = stores["summary"]
    assert [s["name"] for s in summary.stages] == list(fluxmem_ray.STAGES)
    assert summary.gpus_per_worker == 0.5
    for stage in summary.stages:
        if stage["name"] in ("embed", "connect"):
            assert stage["mode"] == "actors", stage
        elif stage["name"] in fluxmem_ray.MAP_STAGES:
            assert stage["mode"] == "map"
            # Consolidate's shards ran in actors that keep the plan's models; ingest's in processes.
            assert stage["in_actors"] == (stage["name"] == "consolidate"), stage
            assert [s["shard"] for s in stage["shards"]] == list(range(SHARDS))
            for shard in stage["shards"]:
                assert shard["gpu_ids"], f"{stage['name']} shard {shard['shard']} ran on an actor without a GPU"
            assert stage["merge"]["record"]["status"] == "merged", stage["merge"]
        else:
            assert stage["mode"] == "global"
            assert stage["gpu_ids"], f"global stage {stage['name']} ran without a GPU"
            assert stage["record"]["status"] in ("done", "skipped (disabled)", "nothing new"), stage["record"]
    # Each ingest shard really did a part: together they ingested what the single run did.
    ingest = summary.stages[0]["shards"]
    single_ingest = stores["single_record"]["stages"][0]["counts_out"]
    assert all(0 < s["record"]["counts_out"]["ingested"] < single_ingest["ingested"] for s in ingest), ingest
    assert sum(s["record"]["counts_out"]["ingested"] for s in ingest) == single_ingest["ingested"]
    # The consolidate shards split the clusters between them: together they handled every
    # cluster the single run handled, and the single run made skills.
    consolidate = next(s for s in summary.stages if s["name"] == "consolidate")["shards"]
    single = next(s for s in stores["single_record"]["stages"] if s["name"] == "consolidate")
    handled = [s["record"]["details"]["clusters"] - s["record"]["details"]["other_shards"] for s in consolidate]
    # They clustered once: one plan, which every shard followed.
    plan = next(s for s in summary.stages if s["name"] == "consolidate")["plan"]["record"]
    assert plan["status"] == "planned" and plan["details"]["clusters"] == single["details"]["clusters"], plan
    assert all(s["record"]["details"]["shared_plan"] == plan["details"]["sha256"] for s in consolidate), consolidate
    assert all(h > 0 for h in handled), handled
    assert sum(handled) == single["details"]["clusters"], (handled, single["details"]["clusters"])
    assert single["counts_out"]["skills_new"] > 0, single
    assert not (stores["ray"] / "staging").exists() or not any((stores["ray"] / "staging").iterdir())
    # Embed planned once; Ray Data actors that keep the model (fluxmem_py) executed the plan
    # and the merge committed their vectors under the plan's digest, then removed the plan.
    embed = next(s for s in summary.stages if s["name"] == "embed")
    digest = embed["plan"]["record"]["details"]["digest"]
    assert embed["plan"]["record"]["status"] == "planned", embed["plan"]
    assert embed["execute"]["workers"] == SHARDS, embed["execute"]
    assert embed["merge"]["record"]["status"] == "merged", embed["merge"]
    assert embed["merge"]["record"]["details"]["plan"] == digest
    assert not (stores["ray"] / "scratch" / "embed" / RUN_ID).exists()
    # Connect's model work the same way: its ground queries' texts, planned and embedded.
    connect = next(s for s in summary.stages if s["name"] == "connect")
    assert connect["plan"]["record"]["status"] == "planned", connect["plan"]
    assert connect["plan"]["record"]["counts_out"]["items"] > 0, connect["plan"]
    assert connect["execute"]["stage"] == "connect", connect["execute"]
    assert connect["merge"]["record"]["details"]["plan"] == connect["plan"]["record"]["details"]["digest"]
    assert not (stores["ray"] / "scratch" / "embed" / f"connect@{RUN_ID}").exists()


@pytest.mark.parametrize("table", ["nodes", "steps"])
def test_same_rows(stores, table):
    single, sharded = live_rows(stores["single"], table), live_rows(stores["ray"], table)
    assert len(single) > 0
    assert sorted(single) == sorted(sharded)
    for key, row in single.items():
        assert sharded[key] == row, key


def test_same_edges(stores):
    single, sharded = live_rows(stores["single"], "edges"), live_rows(stores["ray"], "edges")
    assert {row["kind"] for row in single.values()} >= {"ground", "link", "distill"}
    assert sorted(single) == sorted(sharded)
    assert {row["run_id"] for row in single.values()} <= {f"connect@{RUN_ID}", f"refine@{RUN_ID}", f"consolidate@{RUN_ID}"}
    for key, row in single.items():
        other = sharded[key]
        for column in ("run_id", "active", "evidence", "stage", "created_at"):
            assert other[column] == row[column], (key, column)
        assert_same(row["weight"], other["weight"], f"{key} weight")
        assert_same(parsed(row["metadata"]), parsed(other["metadata"]), f"{key} metadata")


def test_same_embeddings(stores):
    single, sharded = live_rows(stores["single"], "embeddings"), live_rows(stores["ray"], "embeddings")
    assert len(single) == len(live_rows(stores["single"], "nodes"))
    assert sorted(single) == sorted(sharded)
    for key, row in single.items():
        assert sharded[key]["text_sha256"] == row["text_sha256"], key
        assert_same(row["vector"], sharded[key]["vector"], f"{key} vector")


@pytest.mark.parametrize("stage", ["embed", "connect"])
def test_planned_shards_byte_identical(stores, stage):
    """The planned embed commits the embedding shards of the single run's embed stage, and the
    planned connect the edge shards of its connect stage: the same files' bytes (later stages'
    vectors, of the skills, come from a sharded consolidate)."""
    def files(store):
        manifest = json.loads((store / "manifest.json").read_text())
        commits = {c["version"] for c in manifest["commits"] if c["stage"] == stage}
        return [(s["rows"], s["sha256"]) for s in manifest["shards"] if s["commit"] in commits]
    single = files(stores["single"])
    assert single
    assert files(stores["ray"]) == single


def test_same_refine_edits(stores):
    single, sharded = edit_log(stores["single"]), edit_log(stores["ray"])
    assert any(stage == "refine" for stage, _, _ in single)
    assert any(stage == "consolidate" for stage, _, _ in single), "the sharded consolidate's edits are compared too"
    assert sorted(single) == sorted(sharded)
    for key, edit in single.items():
        assert_same({k: parsed(v) for k, v in edit.items()}, {k: parsed(v) for k, v in sharded[key].items()}, str(key))
