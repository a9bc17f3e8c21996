#!/usr/bin/env bash
# Runs a fluxmem night on Kubernetes, in the stages' order: for each map stage (ingest, embed,
# connect, consolidate) an Indexed Job of N pods (shard $JOB_COMPLETION_INDEX of N), then a Job
# for its merge (embed, connect and consolidate: after a Job that plans them); one Job for each
# global stage (refine, export). Each step starts when the one before completed (polled with
# kubectl get); a failed step stops the night.
#
#   IMAGE=registry.example/fluxmem:0.1 integrations/k8s/run-nightly.sh /data/pipelines/nightly.toml N [RUN_ID]
#
# PIPELINE is the path inside the pods (on the fluxmem-data volume). PARALLELISM (default N)
# caps the pods of a stage running at once; TIMEOUT (seconds, default 21600) bounds each wait.
# Needs kubectl and envsubst (gettext). Re-running with the same RUN_ID resumes.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
export PIPELINE="${1:?usage: run-nightly.sh PIPELINE N [RUN_ID]}"
export SHARDS="${2:?number of shards N}"
export RUN_ID="${3:-nightly-$(date -u +%Y-%m-%d)}"
export IMAGE="${IMAGE:?set IMAGE to an image with the fluxmem binary on PATH}"
export PARALLELISM="${PARALLELISM:-$SHARDS}"
timeout_s="${TIMEOUT:-21600}"
[[ "$SHARDS" =~ ^[1-9][0-9]*$ ]] || { echo "N must be a positive integer, not '$SHARDS'" >&2; exit 2; }
# Job names: lowercase letters, digits and '-', at most 63 characters with their prefix and
# suffix (fluxmem-<slug>-merge-consolidate: 26 + 32).
slug="$(echo "$RUN_ID" | tr 'A-Z_.' 'a-z--' | tr -cd 'a-z0-9-' | cut -c1-32)"
vars='${STAGE} ${SHARDS} ${PARALLELISM} ${RUN_ID} ${JOB_NAME} ${IMAGE} ${PIPELINE} ${STEP_ARGS}'

wait_job() { # NAME: until its Complete condition (0) or Failed condition / timeout (1)
  local deadline=$((SECONDS + timeout_s)) state
  while (( SECONDS < deadline )); do
    state=$(kubectl get job "$1" -o jsonpath='{range .status.conditions[?(@.status=="True")]}{.type}{" "}{end}')
    case " $state " in
      *" Complete "*) return 0 ;;
      *" Failed "*) echo "job $1 failed; see kubectl logs -l job-name=$1" >&2; return 1 ;;
    esac
    sleep 15
  done
  echo "job $1: not complete after ${timeout_s}s" >&2
  return 1
}

step() { # TEMPLATE: render, apply (a Job already complete from an earlier try is left as is), wait
  envsubst "$vars" < "$here/$1" | kubectl apply -f -
  wait_job "$JOB_NAME"
}

for STAGE in ingest embed connect refine consolidate export; do
  case $STAGE in
    refine|export)
      export STAGE JOB_NAME="fluxmem-$slug-$STAGE" STEP_ARGS="--json"
      step step-job.yaml
      continue ;;
    embed|connect|consolidate)
      # Embed and connect list the texts for the model in fixed buckets (connect's: its ground
      # queries); consolidate clusters once and records the clusters with its settings.
      export STAGE JOB_NAME="fluxmem-$slug-plan-$STAGE" STEP_ARGS="--plan"
      step step-job.yaml ;;
  esac
  export STAGE JOB_NAME="fluxmem-$slug-$STAGE"
  step shard-job.yaml
  export JOB_NAME="fluxmem-$slug-merge-$STAGE" STEP_ARGS="--merge $SHARDS"
  step step-job.yaml
done
echo "run $RUN_ID finished"
