"""Runs a fluxmem pipeline on a Ray cluster.

For each map stage (ingest, embed, connect, consolidate) the driver builds a Ray Data dataset of shard
indices 0..N-1 (``from_items``) and runs ``map_batches`` over it with an actor pool
(``ActorPoolStrategy(size=workers)``, ``num_gpus`` per actor when the cluster has GPUs). Each actor runs one
``fluxmem run P --run-id R --stage S --shard I/N`` subprocess per shard and returns the stage
record it prints. When all N shards are done the driver runs the merge (``--merge N``), which
commits their union into the main store. The global stages (refine, export) run
once, as one Ray task (with ``num_gpus`` when there are GPUs), in order.

Known limits, stated plainly:

- Embed, and connect's model work (the vectors of its ground queries), run their execute
  steps in Ray Data actors that keep the model loaded (``Options.embed_in_actors``, the
  default; ``fluxmem_ray.actors``, through the ``fluxmem_py`` module). Connect's retrieval
  then runs in its commit, one process. Consolidate's shards run in-process in actors that
  keep the plan's models (generator, embedder, judge or replay model) loaded across the shards
  each runs (``Options.consolidate_in_actors``, the default); more shards than actors spread
  the clusters in smaller parts over the same loaded models. For ingest the worker is the Rust
  binary, one process per shard, and no rows stream through Ray. The store itself is the data
  plane: every node (the driver included) must see the store directory, the pipeline file,
  its inputs and the binary at the same paths (a shared filesystem).
- Embed is a map stage planned once: one Ray task lists the texts to embed in 64 fixed
  buckets (``--stage embed --plan``), the actors (or, without them, each shard process) embed
  them into the plan's result files, and the merge checks every result against the plan and
  commits the shard files of a single-machine run, byte for byte. Connect the same
  (``--stage connect --plan``: its ground queries' texts); its merge connects with the
  results in the model's place.
- Consolidate is a map stage planned once: one Ray task clusters the store
  (``--stage consolidate --plan``, recorded in the store with the settings and models every
  shard runs with), then every shard induces the skills of the planned clusters it owns (by a
  hash of the cluster's episodes), so no shard depends on another's floating point; a shard
  run with other settings is refused, and the merge refuses a shard that did not follow the
  plan. See
  docs/scale-out.md for the clustering-at-scale choice.
- Stages already marked done in the store for the run id are skipped, so a re-run of a killed
  driver resumes; a re-run shard resumes its staging store.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from dataclasses import dataclass, field

import ray

from . import actors, contract
from .contract import GLOBAL_STAGES, MAP_STAGES, STAGES, Invocation

# The driver ships this package to the workers by value, so a cluster needs Ray, the fluxmem
# binary and (for the stages run in actors: embed, connect's model work, consolidate) the
# fluxmem_py module, not this package.
ray.cloudpickle.register_pickle_by_value(sys.modules[__package__])


@dataclass
class Options:
    """How the pipeline is spread over the cluster."""

    shards: int
    """N: map stages run as shards 0..N-1."""
    workers: int | None = None
    """Most actors per map stage (default: N)."""
    gpus_per_worker: float | None = None
    """GPUs per actor and per global-stage task; None: 1 when the cluster has GPUs, else 0.
    A fraction (0.5) lets several actors share one GPU."""
    cpus_per_worker: float = 1.0
    """CPUs per actor and per global-stage task."""
    stages: tuple[str, ...] = STAGES
    """The stages to run, a subsequence of STAGES in that order."""
    progress_bars: bool = False
    """Show Ray Data's progress bars."""
    embed_in_actors: bool = True
    """The execute steps of embed and of connect's model work in-process in Ray Data actors
    that keep the model loaded (``fluxmem_ray.actors``, needs the ``fluxmem_py`` module);
    False: one ``fluxmem`` process a shard, as the other map stages."""
    embed_batch: int = 256
    """Plan items per Ray batch of the embed actors."""
    consolidate_in_actors: bool = True
    """Consolidate's shards in-process in Ray Data actors that keep the plan's models loaded
    across the shards each runs (``fluxmem_ray.actors.ConsolidateActor``, needs the
    ``fluxmem_py`` module); False: one ``fluxmem`` process a shard."""


class ShardWorker:
    """A Ray Data actor: runs the fluxmem binary for each shard index of its batches."""

    def __init__(self, invocation: Invocation, stage: str, count: int):
        self.invocation = invocation
        self.stage = stage
        self.count = count
        # Ray sets CUDA_VISIBLE_DEVICES for the actor; the subprocess inherits it.
        self.gpu_ids = [str(g) for g in ray.get_gpu_ids()]
        self.node = socket.gethostname()

    def __call__(self, batch: dict) -> dict:
        rows = actors.ShardRows(self.gpu_ids, self.node)
        for index in batch["id"]:
            result = contract.run_shard(self.invocation, self.stage, int(index), self.count)
            rows.add(result["shard"], result["seconds"], result["exit_code"], _dumps(result["record"]))
        return rows.columns


def _dumps(value) -> str:
    return json.dumps(value, sort_keys=True)


def _run_global_task(invocation: Invocation, stage: str) -> dict:
    result = contract.run_global(invocation, stage)
    result["gpu_ids"] = [str(g) for g in ray.get_gpu_ids()]
    result["node"] = socket.gethostname()
    return result


@dataclass
class Summary:
    """What a Ray run did: per stage, its mode, wall time and the records fluxmem printed."""

    run_id: str
    pipeline: str
    store: str
    shards: int
    gpus_per_worker: float
    stages: list[dict] = field(default_factory=list)
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return {
            "run_id": self.run_id,
            "pipeline": self.pipeline,
            "store": self.store,
            "shards": self.shards,
            "gpus_per_worker": self.gpus_per_worker,
            "seconds": self.seconds,
            "stages": self.stages,
        }

    def table(self) -> str:
        lines = [f"run {self.run_id} of {self.pipeline} on Ray: {self.shards} shards, {self.seconds:.1f}s"]
        for stage in self.stages:
            if stage["mode"] == "map":
                shard_seconds = ", ".join(f"{s['seconds']:.1f}" for s in stage["shards"])
                where = "in actors" if stage.get("in_actors") else "processes"
                detail = f"shards ({where}) [{shard_seconds}]s, merge {stage['merge']['seconds']:.1f}s"
            elif stage["mode"] == "actors":
                detail = (f"plan {stage['plan']['seconds']:.1f}s, {stage['execute']['workers']} actors "
                          f"{stage['execute']['seconds']:.1f}s, commit {stage['merge']['seconds']:.1f}s")
            elif stage["mode"] == "commit":
                detail = f"plan {stage['plan']['seconds']:.1f}s with nothing to execute, commit {stage['merge']['seconds']:.1f}s"
            elif stage["mode"] == "global":
                detail = f"one task, {stage['record'].get('status', '')}"
            else:
                detail = "done earlier in this run (skipped)"
            lines.append(f"  {stage['name']:<12} {stage['mode']:<7} {stage['seconds']:7.1f}s  {detail}")
        return "\n".join(lines)


def run_pipeline(pipeline: str, run_id: str, options: Options, binary: str = "fluxmem", store: str | None = None,
                 env: dict[str, str] | None = None) -> Summary:
    """Runs ``pipeline`` with run id ``run_id`` on the connected Ray cluster (``ray.init``
    must have been called). ``binary`` must be a path valid on every node; ``env`` is added to
    the environment of every fluxmem process (e.g. ``FLUXMEM_MODELS``)."""
    if not ray.is_initialized():
        raise RuntimeError("connect to a Ray cluster first (ray.init(address=...))")
    if options.shards < 1:
        raise ValueError(f"shards must be at least 1, not {options.shards}")
    unknown = [s for s in options.stages if s not in STAGES]
    if unknown or list(options.stages) != [s for s in STAGES if s in options.stages]:
        raise ValueError(f"stages {list(options.stages)}: expected a subsequence of {list(STAGES)}")
    pipeline = os.path.abspath(pipeline)
    binary = os.path.abspath(binary) if os.sep in binary else binary
    gpus = options.gpus_per_worker
    if gpus is None:
        gpus = 1.0 if ray.cluster_resources().get("GPU", 0) > 0 else 0.0
    invocation = Invocation(binary=binary, pipeline=pipeline, run_id=run_id, store=store, env=env)
    store_path = contract.store_dir(pipeline, store)
    ray.data.DataContext.get_current().enable_progress_bars = options.progress_bars
    summary = Summary(run_id=run_id, pipeline=pipeline, store=str(store_path), shards=options.shards, gpus_per_worker=gpus)
    started = time.monotonic()
    for stage in options.stages:
        stage_started = time.monotonic()
        if contract.stage_done(store_path, stage, run_id):
            entry = {"name": stage, "mode": "skipped"}
        elif stage in MAP_STAGES:
            entry = _map_stage(invocation, stage, options, gpus)
        else:
            assert stage in GLOBAL_STAGES
            task = ray.remote(num_gpus=gpus, num_cpus=options.cpus_per_worker, max_retries=0)(_run_global_task)
            entry = {"name": stage, "mode": "global", **ray.get(task.remote(invocation, stage))}
        entry["seconds"] = time.monotonic() - stage_started
        summary.stages.append(entry)
    summary.seconds = time.monotonic() - started
    return summary


def _actors_that_fit(options: Options, gpus: float) -> int:
    """How many shard actors the cluster can hold at once (at least 1)."""
    resources = ray.cluster_resources()
    fit = int(resources.get("CPU", 1) // options.cpus_per_worker) if options.cpus_per_worker > 0 else 1 << 30
    if gpus > 0:
        fit = min(fit, int(resources.get("GPU", 0) // gpus))
    return max(1, fit)


def _run_plan_task(invocation: Invocation, stage: str) -> dict:
    return contract.run_plan(invocation, stage)


def _map_stage(invocation: Invocation, stage: str, options: Options, gpus: float) -> dict:
    count = options.shards
    plan = None
    if stage in contract.PLANNED_STAGES:
        # One task plans for every shard (consolidate clusters once), on a worker's resources.
        task = ray.remote(num_gpus=gpus, num_cpus=options.cpus_per_worker, max_retries=0)(_run_plan_task)
        plan = ray.get(task.remote(invocation, stage))
    workers = max(1, min(options.workers or count, count, _actors_that_fit(options, gpus)))
    # A disabled stage plans nothing (its shards skip it); a plan with no text to embed needs
    # no worker, only its commit.
    planned = plan is not None and plan["record"].get("status") == "planned"
    if stage in ("embed", "connect") and planned and plan["record"]["counts_out"]["items"] == 0:
        merge = contract.run_merge(invocation, stage, count)
        return {"name": stage, "mode": "commit", "plan": plan, "merge": merge}
    if stage in ("embed", "connect") and options.embed_in_actors and planned:
        return _embed_in_actors(invocation, stage, options, gpus, plan, workers)
    # Consolidate's shards in actors that keep the plan's models, else a process a shard.
    if stage == "consolidate" and options.consolidate_in_actors and planned:
        worker, kwargs = actors.ConsolidateActor, {
            "store": str(contract.store_dir(invocation.pipeline, invocation.store)),
            "run_id": invocation.run_id, "count": count, "env": invocation.env,
        }
    else:
        worker, kwargs = ShardWorker, {"invocation": invocation, "stage": stage, "count": count}
    # from_items puts the N rows in the object store from the driver: no read task competes
    # with the actors for CPUs (on a small cluster a read task and a full pool can deadlock).
    dataset = ray.data.from_items([{"id": i} for i in range(count)], override_num_blocks=count).map_batches(
        worker,
        fn_constructor_kwargs=kwargs,
        batch_size=1,
        # A fixed pool: an autoscaling one starts with one actor and may never grow for a
        # handful of long shards.
        compute=ray.data.ActorPoolStrategy(size=workers),
        num_gpus=gpus,
        num_cpus=options.cpus_per_worker,
    )
    fanout_started = time.monotonic()
    rows = sorted(dataset.take_all(), key=lambda row: row["shard"])
    fanout_seconds = time.monotonic() - fanout_started
    shards = [
        {
            "shard": int(row["shard"]),
            "seconds": float(row["seconds"]),
            "exit_code": int(row["exit_code"]),
            "record": json.loads(row["record"]),
            "gpu_ids": [g for g in row["gpu_ids"].split(",") if g],
            "node": row["node"],
            "pid": int(row["pid"]),
        }
        for row in rows
    ]
    if [s["shard"] for s in shards] != list(range(count)):
        raise contract.FluxmemError(f"stage {stage}: shards {[s['shard'] for s in shards]} came back, expected 0..{count - 1}")
    merge = contract.run_merge(invocation, stage, count)
    entry = {"name": stage, "mode": "map", "fanout_seconds": fanout_seconds, "shards": shards, "merge": merge,
             "in_actors": worker is not ShardWorker}
    if plan is not None:
        entry["plan"] = plan
    return entry


def _embed_in_actors(invocation: Invocation, stage: str, options: Options, gpus: float, plan: dict,
                     workers: int) -> dict:
    """The execute step of embed (or of connect's model work) in Ray Data actors that keep the
    model (``fluxmem_ray.actors``), then the commit (``--merge``), which checks every result
    against the plan."""
    started = time.monotonic()
    store = contract.store_dir(invocation.pipeline, invocation.store)
    execute = actors.execute_embed_plan(
        store,
        invocation.run_id,
        stage=stage,
        workers=workers,
        batch_size=options.embed_batch,
        gpus_per_worker=gpus,
        cpus_per_worker=options.cpus_per_worker,
        env=invocation.env,
    )
    execute["seconds"] = time.monotonic() - started
    merge = contract.run_merge(invocation, stage, options.shards)
    return {"name": stage, "mode": "actors", "plan": plan, "execute": execute, "merge": merge}
