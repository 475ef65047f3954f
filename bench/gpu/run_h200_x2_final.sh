#!/usr/bin/env bash
# Issue 7/8 follow-up on two H200s: sleep/wake after the storage-offload fix (grad norm after wake),
# and issue 8's Qwen3-4B code path at TP=2 x DP=1 (256 samples, prompt <= 512, response <= 1024, mbs 8).
set -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/vime_gpu_out}; mkdir -p "$OUT"; LOG="$OUT/log_x2_final.txt"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
CUDA_VISIBLE_DEVICES=0 timeout 60 python3 bench/bench_transport_gpu.py --shapes 0.5b --repeats 2 \
  --out "$OUT/gpu_x2_transport_0.5b_fixed.json" > "$LOG" 2>&1
timeout 300 python3 -m torch.distributed.run --standalone --nproc_per_node 2 bench/bench_trainer_gpu.py --shape 4b --tp 2 \
  --samples 256 --vary --prompt-len 512 --response-len 1024 --variants mbs8 --warmup 1 --repeats 1 --check-steps 0 \
  --out "$OUT/gpu_x2_4b_tp2.json" >> "$LOG" 2>&1
grep -E "Error|Traceback" "$LOG" | grep -v -i warn | head -20
python3 bench/gpu_common.py "$OUT"/gpu_x2_*.json
