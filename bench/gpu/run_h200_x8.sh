#!/usr/bin/env bash
# Issue 8 (prepared, not run: nvidia-h200-x8 was not lent): Qwen3-4B shape, TP=2 x DP=4 over NCCL
# in 8 processes, 256 samples (prompt <= 512, response <= 1024), micro-batch 8, one optimizer step
# per rollout; then the 4B weight gather + HF conversion + bucket packing + CUDA IPC on one GPU.
# The same code path ran at TP=2 x DP=1 on nvidia-h200-x2 (bench/results/gpu_x2_4b_tp2.json).
set -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/vime_gpu_out}; mkdir -p "$OUT"; LOG="$OUT/log_x8.txt"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
timeout 420 python3 -m torch.distributed.run --standalone --nproc_per_node 8 bench/bench_trainer_gpu.py --shape 4b --tp 2 \
  --samples 256 --vary --prompt-len 512 --response-len 1024 --variants mbs8,mbs8+fused --warmup 1 --repeats 3 \
  --check-steps 0 --out "$OUT/gpu_x8_4b_tp2_dp4.json" > "$LOG" 2>&1
CUDA_VISIBLE_DEVICES=0 timeout 150 python3 bench/bench_transport_gpu.py --shapes 4b --repeats 2 \
  --out "$OUT/gpu_x8_transport_4b.json" >> "$LOG" 2>&1
grep -E "Error|Traceback" "$LOG" | grep -v -i warn | head -20
python3 bench/gpu_common.py "$OUT"/gpu_x8_*.json
