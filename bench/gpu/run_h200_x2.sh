#!/usr/bin/env bash
# Issue 7 on two H200s (device kind nvidia-h200-x2): TP=1 vs TP=2 (and DP=2) step time and
# losses, the cu_seqlens host-offsets fix A/B, issue 8's 4B code path at TP=2 x DP=1, and the
# sleep/wake re-check. Run from the repository root with `.whl` carried; results in $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/vime_gpu_out}; mkdir -p "$OUT"; LOG="$OUT/log_x2.txt"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$LOG"; nvidia-smi topo -m >> "$LOG" 2>&1
T=bench/bench_trainer_gpu.py
RUN2="python3 -m torch.distributed.run --standalone --nproc_per_node 2"
# 0.5B, 8192 tokens/step: one GPU (with the cu_seqlens-on-device A/B), TP=2, DP=2.
CUDA_VISIBLE_DEVICES=0 timeout 80 python3 $T --shape 0.5b --variants mbs16,mbs16+devseq,mbs4,mbs4+devseq \
  --out "$OUT/gpu_x2_tp1_0.5b.json" >> "$LOG" 2>&1
timeout 80 $RUN2 $T --shape 0.5b --tp 2 --variants mbs16,mbs4 --out "$OUT/gpu_x2_tp2_0.5b.json" >> "$LOG" 2>&1
timeout 70 $RUN2 $T --shape 0.5b --tp 1 --variants mbs8 --out "$OUT/gpu_x2_dp2_0.5b.json" >> "$LOG" 2>&1
# Issue 8's shape and code path at TP=2 x DP=1: Qwen3-4B, 256 samples, prompt <= 512, response <= 1024, mbs 8.
timeout 150 $RUN2 $T --shape 4b --tp 2 --samples 256 --vary --prompt-len 512 --response-len 1024 \
  --variants mbs8 --warmup 1 --repeats 2 --check-steps 0 --out "$OUT/gpu_x2_4b_tp2.json" >> "$LOG" 2>&1
# 1.5B: TP=1 vs TP=2.
CUDA_VISIBLE_DEVICES=0 timeout 55 python3 $T --shape 1.5b --variants mbs16 --repeats 4 --out "$OUT/gpu_x2_tp1_1.5b.json" >> "$LOG" 2>&1
timeout 70 $RUN2 $T --shape 1.5b --tp 2 --variants mbs16 --repeats 4 --out "$OUT/gpu_x2_tp2_1.5b.json" >> "$LOG" 2>&1
CUDA_VISIBLE_DEVICES=0 timeout 50 python3 bench/bench_transport_gpu.py --shapes 0.5b --repeats 2 --out "$OUT/gpu_x2_transport_0.5b.json" >> "$LOG" 2>&1
for p in tp2_0.5b dp2_0.5b; do python3 $T --compare "$OUT/gpu_x2_tp1_0.5b.json" "$OUT/gpu_x2_$p.json" 2>&1 | tee -a "$LOG"; done
python3 $T --compare "$OUT/gpu_x2_tp1_1.5b.json" "$OUT/gpu_x2_tp2_1.5b.json" 2>&1 | tee -a "$LOG"
grep -E "Error|Traceback" "$LOG" | grep -v -i warn | head -20
python3 bench/gpu_common.py "$OUT"/gpu_x2_*.json
