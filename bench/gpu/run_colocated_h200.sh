#!/usr/bin/env bash
# Issue 14 on one H200 (device tool): the real `vime train` (Prefect flow runs, Ray actors, a
# vLLM 0.26 CUDA engine and a Megatron bf16 actor colocated on the one GPU, both sleeping between
# phases) on a random Qwen2-0.5B-shaped model, then its report as JSON under $OUT.
#   bash bench/gpu/run_colocated_h200.sh [ITERATIONS] [extra vime train flags...]
#   (env: PROMPT_TOKENS, TRAIN_TIMEOUT, KEEP_ACTORS=1, BASELINES_FROM=N, MEMORY_REFUSAL=1: see below;
#    SHAPE: the model's shape in bench/gpu_common.SHAPES, default 0.5b; GPUS: device slots of the
#    Ray head, default 1 — bench/gpu/run_two_gpus.sh passes 2 with its layouts' flags)
# Needs the bundle's pieces in $PARTS (default /tmp/parts; ../shared/gpu-host/build_bundle.sh)
# and the wheels of bench/gpu/extra_wheels.sh: unpacked into /tmp/site-vllm and /tmp/site-trainer.
set -euo pipefail
cd "$(dirname "$0")/../.."
bash "${PARTS:-/tmp/parts}/install_bundle.sh" "${PARTS:-/tmp/parts}"
# wheels beyond the bundle (bench/gpu/extra_wheels.sh), unpacked over the trainer's site
for wheel in "${PARTS:-/tmp/parts}"/*.whl; do
  [ -e "$wheel" ] && python3 -m zipfile -e "$wheel" /tmp/site-trainer/
done
iters=${1:-20}; shift || true
out=${OUT:-/tmp/vime-out}; work=${VIME_GPU_WORK:-/tmp/vime-gpu}
mkdir -p "$out" "$work"
export PYTHONPATH=/tmp/site-trainer:$PWD
export RAY_AUTH_MODE=disabled RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 HF_HUB_OFFLINE=1 PREFECT_HOME=$work/prefect
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=120
shape=${SHAPE:-0.5b}
run=${RUN_NAME:-gpu-colocated-$shape}
t0=$(date +%s)
# PROMPT_TOKENS=N: every prompt exactly N tokens (prompts-N.jsonl), else 16..500 characters of noise
prompts=$work/prompts-${PROMPT_TOKENS:-long}.jsonl
prompt_shape=$([ -n "${PROMPT_TOKENS:-}" ] && echo "--prompt-tokens $PROMPT_TOKENS" || echo "--prompt-noise 16,500")
[ -f "$work/model-$shape/config.json" ] && [ -f "$prompts" ] || python3 bench/gpu/build_model.py --shape "$shape" --out "$work/model-$shape" --prompts "$prompts" $prompt_shape
# the head's loopback address, passed explicitly: `auto` resolved to the host's other address
address=$(python3 -m flows.cli cluster up --num-gpus "${GPUS:-1}" | tail -n 1)
echo "[gpu] ray head at $address"
status=0
timeout -k 30 "${TRAIN_TIMEOUT:-480}" python3 -m flows.cli train --config bench/gpu/colocated_0.5b.yaml --run-name "$run" --num-rollout "$iters" \
    --ray-address "$address" \
    --storage-uri "$work/runs" --hf-checkpoint "$work/model-$shape" --prompt-data "$prompts" \
    --eval-prompt-data "$prompts" "$@" 2>&1 | tee "$out/train.log" | grep -v "it/s\]$" | tail -n 400 || status=$?
# (pipefail: the driver's status, or 124 when TRAIN_TIMEOUT stopped it)
echo "[gpu] train exit $status after $(( $(date +%s) - t0 )) s"
python3 bench/gpu/colocated_report.py --storage-uri "$work/runs" --run-name "$run" --out "$out/colocated_$shape.json" || true
cp -r "$work/runs/reports/$run" "$out/reports" 2>/dev/null || true
mkdir -p "$out/engine-logs" && for f in .cache/engine-logs/*.log; do grep -v "it/s]" "$f" | tail -n 300 > "$out/engine-logs/$(basename $f)"; done 2>/dev/null || true
nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || true
# the actors' own errors (a trainer or engine actor that died says why only in its worker log)
mkdir -p "$out/ray-logs" && for f in $(ls -d /tmp/vime-ray-*/session_latest/logs .cache/ray/session_latest/logs 2>/dev/null); do
  grep -l -E "Traceback|Error" "$f"/*.err "$f"/*.out 2>/dev/null | head -n 20 | while read -r g; do grep -v "it/s]" "$g" | tail -n 150 > "$out/ray-logs/$(basename "$g")"; done
done || true
# BASELINES_FROM=N: what the framework adds, against the iterations from rollout N (the run's engine still up)
if [ -n "${BASELINES_FROM:-}" ]; then
  timeout -k 15 "${BASELINES_TIMEOUT:-200}" python3 bench/gpu/colocated_baselines.py --ray-address "$address" --storage-uri "$work/runs" \
      --run-name "$run" --from-rollout "$BASELINES_FROM" --out "$out/baselines.json" 2>&1 | grep -v "it/s\]$" | tail -n 40 || true
fi
# MEMORY_REFUSAL=1: a second run asking for more GPU memory than the awake engine leaves (bad input)
[ -z "${MEMORY_REFUSAL:-}" ] || bash bench/gpu/check_memory_refusal.sh || true
# KEEP_ACTORS=1: the engines and the trainer stay up; the same command with a larger ITERATIONS attaches to them
[ "${KEEP_ACTORS:-0}" = 1 ] || python3 -m flows.cli teardown --run-name "$run" --ray-address "$address" >/dev/null 2>&1 || true
