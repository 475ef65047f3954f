#!/usr/bin/env bash
# Where the fixed per-micro-batch time goes: torch.profiler tables of one old-log-prob pass + one
# training step of the 0.5B model with 4 micro-batches and with 1 (nvidia-h200). Results in $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/vime_gpu_out}; mkdir -p "$OUT"; LOG="$OUT/log_profile.txt"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
for v in mbs4 mbs16; do
  timeout 100 python3 bench/bench_trainer_gpu.py --shape 0.5b --variants $v --repeats 3 --check-steps 0 \
    --out "$OUT/gpu_profile_0.5b_$v.json" --profile "$OUT/gpu_profile_0.5b_$v.txt" >> "$LOG" 2>&1
done
grep -E "Error|Traceback" "$LOG" | grep -v -i warn | head
python3 bench/gpu_common.py "$OUT"/gpu_profile_*.json
head -c 5000 "$OUT/gpu_profile_0.5b_mbs4.txt"
