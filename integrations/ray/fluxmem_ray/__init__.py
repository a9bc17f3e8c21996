"""fluxmem on Ray: runs a fluxmem pipeline on a Ray cluster through the `fluxmem run` shard
contract (map stages as Ray Data `map_batches` over shard indices on an actor pool, merges on
the driver, global stages as one Ray task). See docs/scale-out.md.

    import ray, fluxmem_ray
    ray.init(address="auto")
    summary = fluxmem_ray.run_pipeline("pipelines/nightly.toml", run_id="nightly-2026-11-29",
                                       options=fluxmem_ray.Options(shards=8),
                                       binary="/opt/fluxmem/bin/fluxmem")
    print(summary.table())
"""

from .actors import ConsolidateActor, EmbedActor, execute_embed_plan
from .contract import GLOBAL_STAGES, MAP_STAGES, STAGES, FluxmemError, Invocation, run_global, run_merge, run_shard
from .pipeline import Options, Summary, run_pipeline

__all__ = [
    "ConsolidateActor",
    "EmbedActor",
    "FluxmemError",
    "GLOBAL_STAGES",
    "Invocation",
    "MAP_STAGES",
    "Options",
    "STAGES",
    "Summary",
    "execute_embed_plan",
    "run_global",
    "run_merge",
    "run_pipeline",
    "run_shard",
]
