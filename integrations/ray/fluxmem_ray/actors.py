"""Ray Data actors that run fluxmem's execute steps in-process, keeping their model loaded.

Embed is planned first (``fluxmem run P --run-id R --stage embed --plan``: the texts to embed,
each once, in fixed buckets, in ``<store>/scratch/embed/<R>/items.parquet``), and so is connect's
model work (``--stage connect --plan``: the texts of its ground queries, in
``<store>/scratch/embed/connect@<R>/``). Then
:func:`execute_embed_plan` reads the plan's items with ``ray.data.read_parquet``, runs
:class:`EmbedActor` over them with ``map_batches`` on a fixed actor pool (``num_gpus`` per
actor; each actor loads the model once, through the ``fluxmem_py`` extension module built from
crates/fluxmem-py, and the model runs with the GIL released) and writes the vectors with
``write_parquet`` to the plan's ``results/``. The commit (``--stage embed --merge N``) checks
every result against the plan and commits the shard files of a single-machine run, byte for
byte: which actor embedded what, in which batches and order, and how often a batch was retried
do not change them. Connect's commit (``--stage connect --merge N``) connects with the
plan's vectors in the model's place and writes a single-machine connect's shard files.

Consolidate is planned once too (``--stage consolidate --plan``: the clusters, with the settings
and the models by name). :class:`ConsolidateActor` loads the plan's models once
(``fluxmem_py.ConsolidateExecutor``: embedder, generator, judge or replay model) and runs the
shards it is given in-process, each as ``--stage consolidate --shard I/N`` would, into its
staging store; the merge (``--merge N``) checks that every shard followed the plan.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pyarrow as pa
import ray

from .contract import EXIT_DEGRADED


def plan_dir(store: str | os.PathLike, run_id: str, stage: str = "embed") -> Path:
    """The folder of the plan of ``stage``'s texts for ``run_id``
    (``fluxmem_embed::plan::stage_plan_dir``)."""
    folder = Path(store) / "scratch" / "embed"
    return folder / run_id if stage == "embed" else folder / f"{stage}@{run_id}"


# The columns of a plan's items that an actor reads.
ITEMS = pa.schema([("key", pa.string()), ("text", pa.string())])


def _fluxmem_py(env: dict[str, str] | None):
    """The ``fluxmem_py`` module, with the fluxmem environment (``FLUXMEM_MODELS``: where the
    models are) a subprocess would get set in this process."""
    os.environ.update(env or {})
    try:
        import fluxmem_py
    except ImportError as error:
        raise RuntimeError(
            "the fluxmem_py module is not installed on this node: build it with "
            "`maturin develop -m crates/fluxmem-py/Cargo.toml` (or install its wheel)"
        ) from error
    return fluxmem_py


class EmbedActor:
    """A Ray Data actor: embeds batches of a plan's items (``key``, ``text`` columns) with the
    plan's model, loaded once, into result rows (``plan``, ``key``, ``vector``)."""

    def __init__(self, store: str, run_id: str, device: str | None = None, batch_size: int = 32,
                 env: dict[str, str] | None = None, stage: str = "embed"):
        self.executor = _fluxmem_py(env).EmbedExecutor(store, run_id, device=device, batch_size=batch_size, stage=stage)
        self.gpu_ids = [str(g) for g in ray.get_gpu_ids()]

    def __call__(self, batch: pa.Table) -> pa.Table:
        # One record batch of the two string columns, which crosses into Rust through the Arrow
        # C data interface and comes back as result rows the same way, without a copy of the
        # columns (``EmbedExecutor.embed_arrow``).
        items = batch.select(["key", "text"]).cast(ITEMS).combine_chunks()
        records = items.to_batches() or [pa.RecordBatch.from_pylist([], schema=ITEMS)]
        return pa.Table.from_batches([self.executor.embed_arrow(record) for record in records])


def execute_embed_plan(
    store: str | os.PathLike,
    run_id: str,
    workers: int,
    batch_size: int = 256,
    gpus_per_worker: float = 0.0,
    cpus_per_worker: float = 1.0,
    device: str | None = None,
    model_batch: int = 32,
    shuffle_seed: int | None = None,
    env: dict[str, str] | None = None,
    actor: type = EmbedActor,
    stage: str = "embed",
) -> dict:
    """Executes the plan of ``stage``'s texts (``embed``, or ``connect``'s ground queries) for
    ``run_id`` in the store at ``store`` on the connected Ray cluster: ``workers`` actors,
    ``batch_size`` items a Ray batch (``model_batch`` texts a forward), the items in plan order
    or shuffled with ``shuffle_seed``; ``env`` is set in each actor's environment. Returns what
    ran."""
    folder = plan_dir(store, run_id, stage)
    items = folder / "items.parquet"
    if not items.is_file():
        raise FileNotFoundError(f"{items}: no {stage} plan; run `fluxmem run P --run-id {run_id} --stage {stage} --plan` first")
    # The read and write tasks take no CPU of their own, and the actors leave one CPU free for
    # read_parquet's file listing (a task of one CPU that takes no resource arguments): on a
    # cluster the actors fill, a read waiting for a CPU and a pool waiting for rows deadlock.
    workers = max(1, workers)
    spare = ray.cluster_resources().get("CPU", 1.0) - 1.0
    if workers * cpus_per_worker > spare:
        cpus_per_worker = max(0.01, spare / workers)
    dataset = ray.data.read_parquet(str(items), num_cpus=0).select_columns(["key", "text"])
    # The plan is one file: split it so that every actor gets rows.
    dataset = dataset.repartition(workers * 4)
    if shuffle_seed is not None:
        dataset = dataset.random_shuffle(seed=shuffle_seed)
    dataset = dataset.map_batches(
        actor,
        fn_constructor_kwargs={"store": str(store), "run_id": run_id, "device": device, "batch_size": model_batch,
                               "env": env, "stage": stage},
        batch_format="pyarrow",
        batch_size=batch_size,
        compute=ray.data.ActorPoolStrategy(size=workers),
        num_gpus=gpus_per_worker,
        num_cpus=cpus_per_worker,
    )
    dataset.write_parquet(str(folder / "results"), ray_remote_args={"num_cpus": 0})
    return {"workers": workers, "cpus_per_worker": cpus_per_worker, "batch_size": batch_size,
            "shuffle_seed": shuffle_seed, "plan_dir": str(folder), "stage": stage}



class ConsolidateActor:
    """A Ray Data actor: runs consolidate shards (the ``id`` column of its batches: shard
    indices of ``count``) of the run's shared cluster plan in-process, with the plan's models
    loaded once across them. Its rows are those of a shard subprocess (``shard``, ``seconds``,
    ``exit_code``, ``record``, ``gpu_ids``, ``node``, ``pid``)."""

    def __init__(self, store: str, run_id: str, count: int, device: str | None = None,
                 env: dict[str, str] | None = None):
        self.executor = _fluxmem_py(env).ConsolidateExecutor(store, run_id, device=device)
        self.count = count
        self.gpu_ids = [str(g) for g in ray.get_gpu_ids()]
        self.node = socket.gethostname()

    def __call__(self, batch: dict) -> dict:
        rows = ShardRows(self.gpu_ids, self.node)
        for index in batch["id"]:
            started = time.monotonic()
            record = self.executor.execute(int(index), self.count)
            degraded = json.loads(record)["status"].startswith("degraded")
            # The exit status a shard subprocess would give ("done, but degraded" is not a failure).
            rows.add(int(index), time.monotonic() - started, EXIT_DEGRADED if degraded else 0, record)
        return rows.columns


class ShardRows:
    """The rows a shard worker returns for its batch, one per shard it ran (``shard``,
    ``seconds``, ``exit_code``, ``record`` as JSON text, and where it ran: ``gpu_ids``,
    ``node``, ``pid``)."""

    def __init__(self, gpu_ids: list[str], node: str):
        self.where = (",".join(gpu_ids), node, os.getpid())
        self.columns = {"shard": [], "seconds": [], "exit_code": [], "record": [], "gpu_ids": [], "node": [], "pid": []}

    def add(self, shard: int, seconds: float, exit_code: int, record: str) -> None:
        values = (shard, seconds, exit_code, record) + self.where
        for column, value in zip(self.columns, values):
            self.columns[column].append(value)
