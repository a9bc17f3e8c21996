#!/usr/bin/env bash
# Submits a whole fluxmem night to Slurm as a chain of jobs, each waiting (afterok) for the one
# before, in the stages' order: each map stage (ingest, embed, connect, consolidate) an array
# of N shards, then its merge; embed, connect and consolidate plan first (one step lists the
# texts for the model in fixed buckets, or clusters once; the shards do their part of the plan;
# the merge checks and commits). Refine and export run once each.
#
#   integrations/slurm/submit-nightly.sh PIPELINE.toml N [RUN_ID]
#
# RUN_ID defaults to nightly-<today>; the same id re-submitted resumes (finished stages are
# skipped by fluxmem, finished shards by their staging stores). Extra sbatch options (account,
# partition) go in SBATCH_* environment variables, which sbatch reads itself.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
pipeline="$(realpath "${1:?usage: submit-nightly.sh PIPELINE.toml N [RUN_ID]}")"
shards="${2:?number of shards N}"
run_id="${3:-nightly-$(date -u +%Y-%m-%d)}"
[[ "$shards" =~ ^[1-9][0-9]*$ ]] || { echo "N must be a positive integer, not '$shards'" >&2; exit 2; }

export FLUXMEM_PIPELINE="$pipeline" FLUXMEM_RUN_ID="$run_id"
dependency=()
submit() { # prints the job id
  sbatch --parsable "${dependency[@]}" --export=ALL "$@" | cut -d';' -f1
}
for stage in ingest embed connect refine consolidate export; do
  case $stage in
    refine|export)
      job=$(FLUXMEM_STAGE=$stage FLUXMEM_MERGE= FLUXMEM_PLAN= submit --job-name="fluxmem-$stage" "$here/fluxmem-step.sbatch")
      dependency=(--dependency="afterok:$job")
      echo "$stage: job $job"
      continue ;;
    embed|connect|consolidate)
      # Embed and connect list the texts for the model in fixed buckets (connect's: its ground
      # queries); consolidate clusters once and records the clusters with its settings.
      job=$(FLUXMEM_STAGE=$stage FLUXMEM_MERGE= FLUXMEM_PLAN=1 submit --job-name="fluxmem-plan-$stage" "$here/fluxmem-step.sbatch")
      dependency=(--dependency="afterok:$job") ;;
  esac
  job=$(FLUXMEM_STAGE=$stage FLUXMEM_PLAN= submit --job-name="fluxmem-$stage" --array="0-$((shards - 1))" "$here/fluxmem-nightly.sbatch")
  dependency=(--dependency="afterok:$job")
  job=$(FLUXMEM_STAGE=$stage FLUXMEM_MERGE=$shards FLUXMEM_PLAN= submit --job-name="fluxmem-merge-$stage" "$here/fluxmem-step.sbatch")
  dependency=(--dependency="afterok:$job")
  echo "$stage: $shards shards, then merge (job $job)"
done
echo "run $run_id submitted; the last job is $job"
