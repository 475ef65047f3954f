#!/usr/bin/env bash
# Sets everything up (idempotently) and runs the main job: the train flow on the embedded
# default (tiny Qwen3-style model learning "a+b=" by GRPO; one vLLM CPU engine and one Megatron
# actor colocated on a local Ray head; Prefect without a server; storage in ./runs).
# Extra arguments are `vime train` flags, e.g. --seed 7 --run-name my-run --num-rollout 40.
# Ctrl-C stops everything this script started; stored batches and checkpoints stay readable, and
# running it again with the same --run-name resumes.
set -euo pipefail
cd "$(dirname "$0")/.."
bash infra/setup_env.sh
export PREFECT_HOME="${PREFECT_HOME:-$PWD/.cache/prefect}"
source infra/env.sh
mkdir -p "$PREFECT_HOME"

run_name=vime-default
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  [ "${args[$i]}" = "--run-name" ] && run_name="${args[$((i + 1))]}"
done

started_head=0
cleanup() {
  trap - INT TERM EXIT
  echo "[main] stopping run $run_name's engines and actors"
  .venv/bin/vime teardown --run-name "$run_name" >/dev/null 2>&1 || true
  if [ "$started_head" = 1 ]; then
    echo "[main] stopping the local Ray head"
    .venv/bin/vime cluster down >/dev/null 2>&1 || true
  fi
}
trap cleanup INT TERM EXIT

if ! .venv/bin/vime cluster status >/dev/null 2>&1; then
  echo "[main] starting a local Ray head on loopback"
  .venv/bin/vime cluster up --num-gpus 1
  started_head=1
fi
.venv/bin/vime train "$@"
echo "[main] Prefect runs are in $PREFECT_HOME (browse them: PREFECT_HOME=$PREFECT_HOME .venv/bin/prefect server start)"
