#!/usr/bin/env bash
# Issue 18 on two H200s (device kind nvidia-h200-x2): the real `vime train` on a random
# Qwen2-1.5B-shaped model (32 prompts x 8 samples, prompts <= 512, responses <= 1024) in one
# LAYOUT per call (each fits one 10-minute call; KEEP_ACTORS=1 and a larger ITERATIONS resume it):
#   one   colocated on GPU 0 alone (the scaling baseline: same global batch)
#   tp2   colocated, Megatron TP=2 (DP=1), one engine of 2 GPUs (TP=2)
#   dp2   colocated, Megatron TP=1 x DP=2, two engines of 1 GPU
#   nccl  disaggregated: the trainer on one GPU, the engine on the other, weights by NCCL broadcast
#   bandwidth  no run: bench/gpu/check_nccl_group.py broadcasts the model's bf16 bytes GPU 0 -> 1
#              (the limit a publish can reach)
#   bash bench/gpu/run_two_gpus.sh LAYOUT [ITERATIONS] [extra vime train flags...]
# Reports under $OUT/<layout>/ (bench/gpu/colocated_report.py's JSON, logs).
set -euo pipefail
cd "$(dirname "$0")/../.."
layout=${1:?usage: run_two_gpus.sh one|tp2|dp2|nccl|bandwidth [ITERATIONS] [flags...]}; shift
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1  # KINDS.md: no NVLink multicast on these hosts
base=${OUT:-/tmp/vime-out}
if [ "$layout" = bandwidth ]; then
  bytes=$(python3 -c "import sys; sys.path.insert(0, '.'); from bench.gpu_common import hf_config, parameter_counts; print(2 * parameter_counts(hf_config('1.5b'))['total'])")
  mkdir -p "$base/bandwidth"
  PYTHONPATH=$PWD python3 bench/gpu/check_nccl_group.py --bytes "$bytes" --repeats 5 | tee "$base/bandwidth/nccl_broadcast.json"
  exit 0
fi
case "$layout" in
  one)  gpus=1; flags=(--actor-num-gpus-per-node 1) ;;
  tp2)  gpus=2; flags=(--actor-num-gpus-per-node 2 --tensor-model-parallel-size 2 --rollout-num-gpus-per-engine 2) ;;
  dp2)  gpus=2; flags=(--actor-num-gpus-per-node 2 --tensor-model-parallel-size 1 --rollout-num-gpus-per-engine 1) ;;
  nccl) gpus=2; flags=(--actor-num-gpus-per-node 1 --no-colocate --rollout-num-gpus 1 --rollout-num-gpus-per-engine 1
                      --no-offload-rollout --no-offload-train --weight-transport nccl --vllm-gpu-memory-utilization 0.85) ;;
  *) echo "unknown layout $layout" >&2; exit 2 ;;
esac
iters=${1:-5}; shift || true
OUT=$base/$layout SHAPE=1.5b GPUS=$gpus RUN_NAME=${RUN_NAME:-gpu-x2-$layout} \
  bash bench/gpu/run_colocated_h200.sh "$iters" "${flags[@]}" "$@"
