#!/usr/bin/env bash
# The real `vime train` on a GPU host (Prefect flow runs, Ray actors, vLLM CUDA engines and a
# Megatron bf16 actor, colocated and sleeping between phases unless the layout says otherwise) on
# a random Qwen-shaped model (bench/gpu/build_model.py), then its report as JSON under $OUT
# (bench/gpu/colocated_report.py), with the driver's console, engine logs and actor errors.
#   bash bench/gpu/run_colocated_h200.sh [ITERATIONS] [extra vime train flags...]
#   bench/run.py colocated [ITERATIONS] [flags...]          # the same, recorded as a row
# env:
#   LAYOUT         one (default): every GPU the run's config asks for, colocated (1 by default)
#                  tp2: colocated, Megatron TP=2 (DP=1), one engine of 2 GPUs (TP=2)
#                  dp2: colocated, Megatron TP=1 x DP=2, two engines of 1 GPU
#                  nccl: disaggregated, the trainer on one GPU and the engine on the other,
#                  weights by NCCL broadcast
#   SHAPE          the model's shape in bench/gpu_common.SHAPES (default 0.5b)
#   CONFIG         the run's configuration (default bench/gpu/colocated_$SHAPE.yaml where one
#                  exists, else bench/gpu/colocated_0.5b.yaml)
#   PROMPT_TOKENS  every prompt exactly N tokens (default: 16..500 characters of noise)
#   TRAIN_TIMEOUT  seconds before the driver is stopped (default 480)
#   KEEP_ACTORS=1  engines and trainer stay up: the same command with a larger ITERATIONS
#                  attaches to them and goes on (tests/gpu's checks start from such a run)
#   BASELINES_FROM=N  then bench/gpu/colocated_baselines.py against the iterations from N
# Needs the bundle's pieces in $PARTS (default /tmp/parts) and the wheels of bench/gpu/extra_wheels.sh
# beside them: bench/gpu/host_setup.sh unpacks them into /tmp/site-vllm and /tmp/site-trainer.
set -euo pipefail
cd "$(dirname "$0")/../.."
bash bench/gpu/host_setup.sh
iters=${1:-20}; shift || true
out=${OUT:-/tmp/vime-out}; work=${VIME_GPU_WORK:-/tmp/vime-gpu}
mkdir -p "$out" "$work"
export PYTHONPATH=/tmp/site-trainer:$PWD
export RAY_AUTH_MODE=disabled RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 HF_HUB_OFFLINE=1 PREFECT_HOME=$work/prefect
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=120
shape=${SHAPE:-0.5b}
config=${CONFIG:-bench/gpu/colocated_$shape.yaml}
[ -f "$config" ] || config=bench/gpu/colocated_0.5b.yaml
layout=${LAYOUT:-one}
case "$layout" in
  one)  gpus=${GPUS:-1}; layout_flags=() ;;
  tp2)  gpus=2; layout_flags=(--actor-num-gpus-per-node 2 --tensor-model-parallel-size 2 --rollout-num-gpus-per-engine 2) ;;
  dp2)  gpus=2; layout_flags=(--actor-num-gpus-per-node 2 --tensor-model-parallel-size 1 --rollout-num-gpus-per-engine 1) ;;
  nccl) gpus=2; layout_flags=(--actor-num-gpus-per-node 1 --no-colocate --rollout-num-gpus 1 --rollout-num-gpus-per-engine 1
                              --no-offload-rollout --no-offload-train --weight-transport nccl --vllm-gpu-memory-utilization 0.85) ;;
  *) echo "LAYOUT=$layout: one of one, tp2, dp2, nccl" >&2; exit 2 ;;
esac
# no NVLink multicast on the lent hosts (their KINDS.md)
[ "$gpus" -gt 1 ] && export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
run=${RUN_NAME:-gpu-colocated-$shape$([ "$layout" = one ] || echo "-$layout")}
t0=$(date +%s)
# PROMPT_TOKENS=N: every prompt exactly N tokens (prompts-N.jsonl), else 16..500 characters of noise
prompts=$work/prompts-${PROMPT_TOKENS:-long}.jsonl
prompt_shape=$([ -n "${PROMPT_TOKENS:-}" ] && echo "--prompt-tokens $PROMPT_TOKENS" || echo "--prompt-noise 16,500")
[ -f "$work/model-$shape/config.json" ] && [ -f "$prompts" ] || python3 bench/gpu/build_model.py --shape "$shape" --out "$work/model-$shape" --prompts "$prompts" $prompt_shape
# the head's loopback address, passed explicitly: `auto` resolved to the host's other address
address=$(python3 -m flows.cli cluster up --num-gpus "$gpus" | tail -n 1)
echo "[gpu] ray head at $address"
status=0
# the run's records copied as it writes them: a device call stopped at its limit still returns the
# iterations done under $OUT (the report below runs only once the driver has exited)
records=$work/runs/reports/$run/metrics.jsonl
( while sleep 10; do [ -f "$records" ] && cp "$records" "$out/metrics.partial.jsonl"; done ) &
copier=$!
timeout -k 30 "${TRAIN_TIMEOUT:-480}" python3 -m flows.cli train --config "$config" --run-name "$run" --num-rollout "$iters" \
    --ray-address "$address" \
    --storage-uri "$work/runs" --hf-checkpoint "$work/model-$shape" --prompt-data "$prompts" \
    --eval-prompt-data "$prompts" ${layout_flags[@]+"${layout_flags[@]}"} "$@" 2>&1 | tee "$out/train.log" | grep -v "it/s\]$" | tail -n 400 || status=$?
# (pipefail: the driver's status, or 124 when TRAIN_TIMEOUT stopped it)
kill "$copier" 2>/dev/null || true
echo "[gpu] train exit $status after $(( $(date +%s) - t0 )) s"
python3 bench/gpu/colocated_report.py --storage-uri "$work/runs" --run-name "$run" --out "$out/colocated_$shape.json" || true
cp -r "$work/runs/reports/$run" "$out/reports" 2>/dev/null || true
# where each engine's start went (vime_core/engines/startup_log.py), from the whole logs
python3 -m vime_core.engines.startup_log .cache/engine-logs/*.log > "$out/engine_startup.json" 2>/dev/null || true
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
# KEEP_ACTORS=1: the engines and the trainer stay up; the same command with a larger ITERATIONS attaches to them
[ "${KEEP_ACTORS:-0}" = 1 ] || python3 -m flows.cli teardown --run-name "$run" --ray-address "$address" >/dev/null 2>&1 || true
# the driver's status: a run that stopped or timed out fails the bench (its report above is kept)
exit "$status"
