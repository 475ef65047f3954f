#!/usr/bin/env bash
# The default job (a tiny model learning "a+b=" by GRPO) with the engine and the trainer on a GPU,
# colocated and sleeping (bench/gpu/learning_tiny.yaml), on its own Ray head (it can run beside a
# colocated run), then the reward gain as JSON in $OUT/learning.json (bench/default_job_report.py).
#   bash bench/gpu/run_learning_h200.sh [extra vime train flags...]
#   bench/run.py learning_gpu [flags...]          # the same, recorded as a row
# Needs the bundle unpacked (bench/gpu/run_colocated_h200.sh does it).
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/vime-out}/learning; work=${VIME_GPU_LEARN_WORK:-/tmp/vime-gpu-learn}
mkdir -p "$out" "$work"
export PYTHONPATH=/tmp/site-trainer:$PWD
export RAY_AUTH_MODE=disabled RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 HF_HUB_OFFLINE=1 PREFECT_HOME=$work/prefect
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=120 VIME_RAY_TEMP_DIR=/tmp/vime-ray-learn
run=${RUN_NAME:-gpu-learn-arith}
t0=$(date +%s)
address=$(python3 -m flows.cli cluster up --num-gpus 1 | tail -n 1)
timeout -k 30 "${LEARN_TIMEOUT:-420}" python3 -m flows.cli train --config bench/gpu/learning_tiny.yaml --run-name "$run" \
    --ray-address "$address" --storage-uri "$work/runs" "$@" > "$out/train.log" 2>&1 || echo "[learn] train exit $?"
echo "[learn] $(( $(date +%s) - t0 )) s"
grep -E "^iter " "$out/train.log" | tail -n 80 || true
python3 bench/default_job_report.py --storage "$work/runs" --out "${OUT:-/tmp/vime-out}/learning.json" "$run" >/dev/null || true
cat "${OUT:-/tmp/vime-out}/learning.json" || true
cp -r "$work/runs/reports/$run" "$out/reports" 2>/dev/null || true
python3 -m flows.cli teardown --run-name "$run" --ray-address "$address" >/dev/null 2>&1 || true
python3 -m flows.cli cluster down >/dev/null 2>&1 || true
