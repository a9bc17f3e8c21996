"""The `fluxmem run` shard contract, as plain subprocess calls (no Ray here).

Every function runs the fluxmem binary once and returns its parsed JSON, so the Ray driver,
a test, or any other scheduler can drive the same steps:

- ``run_shard``: ``fluxmem run P --run-id R --stage S --shard I/N`` (map stages only);
- ``run_merge``: ``fluxmem run P --run-id R --stage S --merge N`` (once, after all N shards);
- ``run_global``: ``fluxmem run P --run-id R --stage S --json`` (refine, consolidate, export).

A non-zero exit (other than 3, "done but records were quarantined") raises ``FluxmemError``
carrying the command, the exit status and the tail of stderr.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

STAGES = ("ingest", "embed", "connect", "refine", "consolidate", "export")
MAP_STAGES = ("ingest", "embed", "connect", "consolidate")
GLOBAL_STAGES = ("refine", "export")

# `fluxmem` exit status for "done, but some input records were quarantined".
EXIT_QUARANTINED = 3
# `fluxmem` exit status for "done, but degraded": a stage produced nothing it was meant to (every
# cluster failed, 0 skills exported...); the record's `status` and `reasons` say what.
EXIT_DEGRADED = 4
STDERR_TAIL = 4000


class FluxmemError(RuntimeError):
    """A fluxmem invocation failed; the message has the command, exit status and stderr."""


@dataclass(frozen=True)
class Invocation:
    """What every call of the binary shares: where it is, the pipeline, the run id."""

    binary: str
    pipeline: str
    run_id: str
    store: str | None = None
    env: dict[str, str] | None = None

    def command(self, stage: str, *extra: str) -> list[str]:
        command = [self.binary, "run", self.pipeline, "--run-id", self.run_id, "--stage", stage, "--no-progress"]
        if self.store is not None:
            command += ["--store", self.store]
        return command + list(extra)


def _call(invocation: Invocation, command: list[str]) -> tuple[dict, float, int]:
    env = dict(os.environ)
    env.update(invocation.env or {})
    started = time.monotonic()
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    except OSError as error:
        raise FluxmemError(f"cannot start {command[0]!r}: {error}") from error
    seconds = time.monotonic() - started
    if done.returncode not in (0, EXIT_QUARANTINED, EXIT_DEGRADED):
        raise FluxmemError(
            f"`{' '.join(command)}` exited with status {done.returncode}; stderr:\n{done.stderr[-STDERR_TAIL:]}"
        )
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    if not lines:
        raise FluxmemError(f"`{' '.join(command)}` printed no JSON record; stderr:\n{done.stderr[-STDERR_TAIL:]}")
    try:
        record = json.loads(lines[-1])
    except json.JSONDecodeError as error:
        raise FluxmemError(f"`{' '.join(command)}`: last stdout line is not JSON ({error}): {lines[-1][:500]!r}") from error
    return record, seconds, done.returncode


# A shard that finds no main store creates it, holding the main store's writer lock for that
# moment; a second shard starting at the same instant fails with this error. Nothing was
# written by the failed shard, so it is retried after a short wait (the store exists by then).
LOCKED = "store is locked by another writer"
LOCK_RETRIES = (0.5, 1.0, 2.0, 4.0, 8.0)


def run_shard(invocation: Invocation, stage: str, index: int, count: int) -> dict:
    """Runs shard ``index`` of ``count`` of a map stage; returns its stage record and timing."""
    if stage not in MAP_STAGES:
        raise ValueError(f"stage {stage!r} is not a map stage ({', '.join(MAP_STAGES)})")
    command = invocation.command(stage, "--shard", f"{index}/{count}")
    for wait in LOCK_RETRIES + (None,):
        try:
            record, seconds, code = _call(invocation, command)
            return {"shard": index, "seconds": seconds, "exit_code": code, "record": record}
        except FluxmemError as error:
            if wait is None or LOCKED not in str(error):
                raise
            time.sleep(wait)
    raise AssertionError("unreachable")


# The map stages that plan once, before their shards (``--plan``): each shard then follows
# the plan, and the merge checks that every shard did (embed: the texts to embed in fixed
# buckets, each shard embedding its buckets; consolidate: the clusters).
PLANNED_STAGES = ("embed", "connect", "consolidate")


def run_plan(invocation: Invocation, stage: str) -> dict:
    """Plans the work of a map stage's shards once (embed: the texts; consolidate: the
    clusters), in the main store."""
    if stage not in PLANNED_STAGES:
        raise ValueError(f"stage {stage!r} does not plan its shards ({', '.join(PLANNED_STAGES)} do)")
    record, seconds, code = _call(invocation, invocation.command(stage, "--plan"))
    return {"seconds": seconds, "exit_code": code, "record": record}


def run_merge(invocation: Invocation, stage: str, count: int) -> dict:
    """Merges the ``count`` finished shards of a map stage into the main store."""
    record, seconds, code = _call(invocation, invocation.command(stage, "--merge", str(count)))
    return {"seconds": seconds, "exit_code": code, "record": record}


def run_global(invocation: Invocation, stage: str) -> dict:
    """Runs a whole stage on this machine (the global stages, or a map stage unsharded)."""
    run, seconds, code = _call(invocation, invocation.command(stage, "--json"))
    stages = [s for s in run.get("stages", []) if s.get("name") == stage]
    if len(stages) != 1:
        raise FluxmemError(f"the run record of stage {stage!r} lists stages {[s.get('name') for s in run.get('stages', [])]}")
    return {"seconds": seconds, "exit_code": code, "record": stages[0], "run_status": run.get("status")}


def store_dir(pipeline: str | os.PathLike, store: str | None = None) -> Path:
    """The store a pipeline writes, resolved as the binary does: the file's ``store`` key
    (relative to the file's directory), else ``store`` (the ``--store`` flag), else
    ``FLUXMEM_STORE``, else ``./fluxmem-store``."""
    path = Path(pipeline)
    with open(path, "rb") as file:
        settings = tomllib.load(file)
    if "store" in settings:
        configured = Path(settings["store"])
        return configured if configured.is_absolute() else path.parent / configured
    return Path(store or os.environ.get("FLUXMEM_STORE") or "fluxmem-store")


def stage_done(store: Path, stage: str, run_id: str) -> bool:
    """True when the store's manifest marks ``stage`` done for ``run_id`` (so it is skipped,
    as ``fluxmem run`` itself skips it on resume)."""
    manifest = store / "manifest.json"
    if not manifest.is_file():
        return False
    with open(manifest) as file:
        progress = json.load(file).get("progress", {})
    return progress.get(f"pipeline.{stage}", {}).get("run_id") == run_id
