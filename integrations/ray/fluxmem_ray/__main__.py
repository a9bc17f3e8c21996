"""`python -m fluxmem_ray PIPELINE.toml --shards N --binary PATH --run-id R`.

Connects to the Ray cluster (`--address`, else RAY_ADDRESS, else a local Ray), runs the
pipeline, prints the per-stage summary (a table, or JSON with --json) on stdout. Exit status 0
on success, 1 when a stage failed (its stderr is in the message).
"""

import argparse
import json
import os
import sys

import ray

from .contract import STAGES, FluxmemError
from .pipeline import Options, run_pipeline


def parse(argv):
    parser = argparse.ArgumentParser(prog="python -m fluxmem_ray", description=__doc__.splitlines()[0])
    parser.add_argument("pipeline", help="the pipeline file (same path on every node)")
    parser.add_argument("--shards", type=int, required=True, help="N: shards of each map stage")
    parser.add_argument("--run-id", required=True, help="the run id (the same id resumes a killed run)")
    parser.add_argument("--binary", default=os.environ.get("FLUXMEM_BIN", "fluxmem"),
                        help="the fluxmem binary, a path valid on every node (default: $FLUXMEM_BIN or fluxmem on PATH)")
    parser.add_argument("--store", help="store directory when the pipeline file names none")
    parser.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS, else a local Ray)")
    parser.add_argument("--workers", type=int, help="most actors per map stage (default: N)")
    parser.add_argument("--gpus-per-worker", type=float, help="GPUs per actor/task (default: 1 when the cluster has GPUs)")
    parser.add_argument("--cpus-per-worker", type=float, default=1.0, help="CPUs per actor/task (default: 1)")
    parser.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated subsequence of {','.join(STAGES)}")
    parser.add_argument("--embed-in-processes", action="store_true",
                        help="run the shards of embed and of connect's model work as fluxmem processes, not in actors that keep the model (fluxmem_py)")
    parser.add_argument("--embed-batch", type=int, default=256, help="plan items per Ray batch of the embed actors")
    parser.add_argument("--consolidate-in-processes", action="store_true",
                        help="run consolidate's shards as fluxmem processes, not in actors that keep the plan's models (fluxmem_py)")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    # Every fluxmem process gets the driver's FLUXMEM_* settings (models cache, device...).
    env = {k: v for k, v in os.environ.items() if k.startswith("FLUXMEM_") and k != "FLUXMEM_BIN"}
    ray.init(address=args.address, log_to_driver=True)
    options = Options(
        shards=args.shards,
        workers=args.workers,
        gpus_per_worker=args.gpus_per_worker,
        cpus_per_worker=args.cpus_per_worker,
        stages=tuple(s.strip() for s in args.stages.split(",") if s.strip()),
        embed_in_actors=not args.embed_in_processes,
        embed_batch=args.embed_batch,
        consolidate_in_actors=not args.consolidate_in_processes,
    )
    try:
        summary = run_pipeline(args.pipeline, args.run_id, options, binary=args.binary, store=args.store, env=env)
    except (FluxmemError, ValueError, ray.exceptions.RayError) as error:
        print(f"fluxmem_ray: {error}", file=sys.stderr)
        return 1
    print(json.dumps(summary.as_dict(), indent=2) if args.json else summary.table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
