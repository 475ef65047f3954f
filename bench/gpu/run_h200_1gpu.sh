#!/usr/bin/env bash
# Issue 7, one H200 (device kind nvidia-h200): trainer step 0.5B/1.5B with options, varied lengths,
# IPC transport + sleep/wake. Run from the repository root with `.whl` carried; results in $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/vime_gpu_out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/nvidia_smi.txt"
T=bench/bench_trainer_gpu.py
# 0.5B and 1.5B at 8192 tokens/step (16 samples x (256 prompt + 256 response)).
timeout 200 python3 $T --shape 0.5b --variants mbs4,mbs1,mbs2,mbs8,mbs16,mbs16+fused,mbs16+recompute,mbs16+compile,mbs16+fused+compile \
  --out "$OUT/gpu_trainer_0.5b.json" > "$OUT/log_trainer.txt" 2>&1
timeout 130 python3 bench/bench_transport_gpu.py --shapes 0.5b,1.5b --out "$OUT/gpu_transport.json" > "$OUT/log_transport.txt" 2>&1
timeout 150 python3 $T --shape 1.5b --variants mbs4,mbs16,mbs16+fused,mbs16+recompute,mbs16+fused+compile \
  --out "$OUT/gpu_trainer_1.5b.json" >> "$OUT/log_trainer.txt" 2>&1
# Varied lengths (prompt, response uniform in [16, 512]): per-sample attention segments, packing.
timeout 90 python3 $T --shape 0.5b --vary --prompt-len 512 --response-len 512 --check-steps 0 \
  --variants mbs4,pack8192,pack8192+fused,pack8192+fused+compile --out "$OUT/gpu_trainer_0.5b_vary.json" >> "$OUT/log_trainer.txt" 2>&1
grep -E "Error|error|Traceback" "$OUT"/log_*.txt | grep -v -i warn | head -30
python3 bench/gpu_common.py "$OUT"/gpu_*.json
