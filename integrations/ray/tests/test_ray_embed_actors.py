"""Embed's execute step in Ray actors that keep the model loaded commits `fluxmem run`'s shards.

The samples in data/ are ingested into one store per case and embedded: once by `fluxmem run
--stage embed` (the reference), and three times through the plan (`--stage embed --plan`),
executed by `fluxmem_ray.execute_embed_plan` on a local Ray (`ray.init(num_cpus=2,
num_gpus=1)`, half a GPU per actor) and committed by `--stage embed --merge`:

- 1 actor, 256 items a batch;
- 2 actors, 7 items a batch;
- 2 actors, 5 items a batch, the items shuffled, and the first actor process to get a batch
  dying on it (Ray restarts the actor and retries the batch).

Each commits embedding shard files with the reference's SHA-256. A result altered to carry
another plan's digest is refused by the commit. Needs FLUXMEM_BIN, the embedding model in
FLUXMEM_MODELS and the `fluxmem_py` module (scripts/test.sh builds it with maturin).
"""

import json
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
from fluxmem_ray.actors import EmbedActor, plan_dir  # noqa: E402
from samples import binary, models_env, samples_pipeline  # noqa: E402

# The dying actor below is pickled with this module's code (workers cannot import tests).
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

RUN_ID = "ray-actors-1"

PIPELINE = samples_pipeline(
    """\
name = "ray-actors"
store = "store"
seed = 7
""",
    """\
[report]
dir = "runs"
""",
)


class DyingOnce(EmbedActor):
    """An actor whose process exits on its first batch, the first time any actor gets one (a
    marker file beside the plan says it happened)."""

    def __call__(self, batch):
        marker = Path(self.executor.plan_dir).parent / f"{RUN_ID}.died"
        try:
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return super().__call__(batch)
        os.close(fd)
        os._exit(1)


def fluxmem(pipeline: Path, *args: str, ok: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [binary(), "run", str(pipeline), "--run-id", RUN_ID, "--no-progress", *args],
        capture_output=True, text=True, env={**os.environ, **models_env()},
    )
    if ok:
        assert done.returncode == 0, f"{args} failed ({done.returncode}):\n{done.stderr}"
    return done


def ingested(root: Path, name: str) -> Path:
    """A pipeline in root/name whose store holds the ingested samples."""
    (root / name).mkdir()
    pipeline = root / name / "pipeline.toml"
    pipeline.write_text(PIPELINE)
    fluxmem(pipeline, "--stage", "ingest")
    return pipeline


def embed_files(store: Path) -> list:
    """(rows, sha256) of the shards the embed stage committed, in commit order."""
    manifest = json.loads((store / "manifest.json").read_text())
    embed = {c["version"] for c in manifest["commits"] if c["stage"] == "embed"}
    return [(s["rows"], s["sha256"]) for s in manifest["shards"] if s["commit"] in embed]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("ray-actors")
    pipeline = ingested(root, "single")
    fluxmem(pipeline, "--stage", "embed")
    files = embed_files(pipeline.parent / "store")
    assert files
    ray.init(num_cpus=2, num_gpus=1, include_dashboard=False, log_to_driver=False)
    try:
        yield root, files
    finally:
        ray.shutdown()


@pytest.mark.parametrize(
    "case, workers, batch, shuffle, actor",
    [
        ("one", 1, 256, None, EmbedActor),
        ("two", 2, 7, None, EmbedActor),
        ("shuffled", 2, 5, 11, DyingOnce),
    ],
)
def test_a_plan_executed_in_actors_commits_the_single_runs_shards(reference, case, workers, batch, shuffle, actor):
    root, expected = reference
    pipeline = ingested(root, case)
    store = pipeline.parent / "store"
    plan = json.loads(fluxmem(pipeline, "--stage", "embed", "--plan").stdout.splitlines()[-1])
    assert plan["status"] == "planned" and plan["counts_out"]["items"] > 0, plan
    ran = fluxmem_ray.execute_embed_plan(
        store, RUN_ID, workers=workers, batch_size=batch, gpus_per_worker=0.5, shuffle_seed=shuffle,
        env=models_env(), actor=actor,
    )
    results = list((plan_dir(store, RUN_ID) / "results").glob("*.parquet"))
    rows = sum(pq.read_metadata(f).num_rows for f in results)
    assert rows >= plan["counts_out"]["items"], (ran, rows)
    if actor is DyingOnce:
        assert (plan_dir(store, RUN_ID).parent / f"{RUN_ID}.died").exists(), "an actor died"
    merged = json.loads(fluxmem(pipeline, "--stage", "embed", "--merge", str(workers)).stdout.splitlines()[-1])
    assert merged["status"] == "merged" and merged["details"]["plan"] == plan["details"]["digest"], merged
    assert embed_files(store) == expected


def test_the_commit_refuses_a_result_of_another_plan(reference):
    root, _ = reference
    pipeline = ingested(root, "altered")
    store = pipeline.parent / "store"
    fluxmem(pipeline, "--stage", "embed", "--plan")
    fluxmem_ray.execute_embed_plan(store, RUN_ID, workers=1, gpus_per_worker=0.5, env=models_env())
    first = sorted((plan_dir(store, RUN_ID) / "results").glob("*.parquet"))[0]
    table = pq.read_table(first)
    table = table.set_column(0, "plan", pa.array(["an earlier plan"] * table.num_rows, pa.string()))
    pq.write_table(table, first)
    refused = fluxmem(pipeline, "--stage", "embed", "--merge", "1", ok=False)
    assert refused.returncode != 0 and "not this plan" in refused.stderr, refused.stderr


def test_arrow_batches_cross_without_changing_a_vector(reference):
    """`EmbedExecutor.embed_arrow` (the Arrow C data interface, which the actors call) gives the
    vectors `embed` gives, for any slice of the items (none included); it refuses columns that
    are not 32-bit-offset strings (the actors cast to them), a text that does not hash to its
    key and an object that is not a record batch."""
    import fluxmem_py
    import numpy as np

    root, _ = reference
    pipeline = ingested(root, "arrow")
    store = pipeline.parent / "store"
    fluxmem(pipeline, "--stage", "embed", "--plan")
    os.environ.update(models_env())
    executor = fluxmem_py.EmbedExecutor(str(store), RUN_ID, batch_size=4)
    items = pq.read_table(plan_dir(store, RUN_ID) / "items.parquet").select(["key", "text"])
    assert items.num_rows > 8
    for part in (items.slice(0, 1), items.slice(3, 7), items.slice(0, 0)):
        batch = part.combine_chunks().to_batches()
        batch = batch[0] if batch else pa.RecordBatch.from_pylist([], schema=part.schema)
        results = executor.embed_arrow(batch)
        assert results.schema.names == ["plan", "key", "vector"]
        assert results.column("key").to_pylist() == part.column("key").to_pylist()
        assert set(results.column("plan").to_pylist()) <= {executor.digest}
        expected = np.frombuffer(
            executor.embed(part.column("key").to_pylist(), part.column("text").to_pylist()), dtype="<f4"
        )
        flat = results.column("vector").flatten().to_numpy()
        assert flat.dtype == np.float32 and flat.tobytes() == expected.tobytes()
    wide = items.slice(0, 3).cast(pa.schema([("key", pa.large_string()), ("text", pa.large_string())]))
    with pytest.raises(RuntimeError, match="string column"):
        executor.embed_arrow(wide.combine_chunks().to_batches()[0])
    texts = items.column("text").to_pylist()
    swapped = pa.RecordBatch.from_pydict({"key": items.column("key").to_pylist()[:2], "text": texts[1::-1][:2]})
    with pytest.raises(RuntimeError, match="does not hash to its key"):
        executor.embed_arrow(swapped)
    with pytest.raises(ValueError, match="Arrow record batch"):
        executor.embed_arrow([1, 2, 3])
