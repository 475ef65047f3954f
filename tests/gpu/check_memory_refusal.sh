#!/usr/bin/env bash
# Bad input: a second run whose engine asks for more GPU memory than is free (a first run's engine
# awake beside it) must fail at start with an error naming the setting and the free memory seen,
# and store nothing. Own Ray head (the first run's placement group holds the GPU). Writes
# $OUT/memory_refusal.json. Needs the bundle unpacked and the first run's model and prompts in
# $VIME_GPU_WORK (default /tmp/vime-gpu): bench/gpu/run_colocated_h200.sh does both.
# tests/gpu/test_colocated_recovery.py runs it; by hand: bash tests/gpu/check_memory_refusal.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/vime-out}; work=/tmp/vime-gpu-refuse; run=gpu-refused; gpu=${VIME_GPU_WORK:-/tmp/vime-gpu}
mkdir -p "$out" "$work"
export PYTHONPATH=/tmp/site-trainer:$PWD
export RAY_AUTH_MODE=disabled RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 HF_HUB_OFFLINE=1 PREFECT_HOME=$work/prefect
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=120 VIME_RAY_TEMP_DIR=/tmp/vime-ray-refuse
nvidia-smi --query-gpu=memory.used,memory.total --format=csv > "$out/memory_refusal_nvidia_smi.txt" 2>&1
address=$(python3 -m flows.cli cluster up --num-gpus 1 | tail -n 1)
t0=$(date +%s)
timeout -k 15 "${REFUSAL_TIMEOUT:-180}" python3 -m flows.cli train --config bench/gpu/colocated_0.5b.yaml --run-name "$run" \
    --num-rollout 1 --ray-address "$address" --storage-uri "$work/runs" --hf-checkpoint "${MODEL:-$gpu/model-0.5b}" \
    --prompt-data "$gpu/prompts-long.jsonl" --eval-prompt-data "$gpu/prompts-long.jsonl" \
    --vllm-gpu-memory-utilization 0.9 > "$work/train.log" 2>&1
code=$?
python3 -m flows.cli teardown --run-name "$run" --ray-address "$address" >/dev/null 2>&1 || true
python3 -m flows.cli cluster down >/dev/null 2>&1 || true
grep -v "it/s\]$" "$work/train.log" | tail -n 60 > "$out/memory_refusal.log"
python3 - "$code" "$(( $(date +%s) - t0 ))" "$work" "$out" <<'PY'
import json, pathlib, re, sys
code, seconds, work, out = int(sys.argv[1]), int(sys.argv[2]), pathlib.Path(sys.argv[3]), pathlib.Path(sys.argv[4])
log = (work / "train.log").read_text(errors="replace")
hits = [l.strip() for l in log.splitlines() if "vllm_gpu_memory_utilization=" in l and "free of" in l]
batches = list((work / "runs" / "batches").rglob("*.parquet")) if (work / "runs" / "batches").exists() else []
result = {"bench": "memory_refusal", "exit_code": code, "seconds": seconds, "error_line": hits[0] if hits else None,
          "names_setting_and_free_memory": bool(hits), "batches_stored": len(batches),
          "refused_cleanly": code not in (0, 124, 137) and bool(hits) and not batches}
(out / "memory_refusal.json").write_text(json.dumps(result, indent=1) + "\n")
print(json.dumps(result))
PY
