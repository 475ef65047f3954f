#!/usr/bin/env bash
# The peer trainer (TRL's GRPOTrainer, bench/gpu/peer_trl.py) on a GPU host, on the model folder
# and prompts file vime's bench uses (bench/gpu/build_model.py builds them when missing), its
# JSON in $OUT/peer_trl_$SHAPE.json. Run it before or after vime's bench in the same device call.
#   bash bench/gpu/run_peer_trl_h200.sh [STEPS] [peer_trl.py flags, e.g. --gradient-checkpointing]
# env:
#   PEER_WHEELS    the wheels of bench/gpu/peer_wheels.sh (default .gpu/peer), unpacked once into
#                  /tmp/site-peer; keep them apart from the bundle's parts (host_setup.sh unpacks
#                  every wheel there into the trainer's site)
#   SHAPE          the model's shape in bench/gpu_common.SHAPES (default 0.5b)
#   CONFIG         vime's configuration to match (default bench/gpu/colocated_$SHAPE.yaml)
#   PROMPT_TOKENS  every prompt exactly N tokens (default 512)
#   PEER_TIMEOUT   seconds before the run is stopped (default 900)
# PYTHONPATH: /tmp/site-peer first (TRL, accelerate, datasets and what only they need; nothing
# there is in the other two sites), then vLLM's site before the trainer's (the order vLLM is
# served with: their fastapi pins differ), then the repository (the config loader, the reward).
set -euo pipefail
cd "$(dirname "$0")/../.."
bash bench/gpu/host_setup.sh
steps=${1:-8}; shift || true
wheels=${PEER_WHEELS:-.gpu/peer}
if [ -z "$(ls -A /tmp/site-peer 2>/dev/null)" ]; then
  compgen -G "$wheels/*.whl" >/dev/null || { echo "PEER_WHEELS=$wheels: no wheels (bench/gpu/peer_wheels.sh DIR)" >&2; exit 2; }
  mkdir -p /tmp/site-peer
  for wheel in "$wheels"/*.whl; do python3 -m zipfile -e "$wheel" /tmp/site-peer/; done
  echo "[peer] site-peer: $(du -sh /tmp/site-peer | cut -f1)"
fi
out=${OUT:-/tmp/vime-out}; work=${VIME_GPU_WORK:-/tmp/vime-gpu}
shape=${SHAPE:-0.5b}; tokens=${PROMPT_TOKENS:-512}
config=${CONFIG:-bench/gpu/colocated_$shape.yaml}
model=$work/model-$shape; prompts=$work/prompts-$tokens.jsonl
mkdir -p "$out" "$work"
[ -f "$model/config.json" ] && [ -f "$prompts" ] || PYTHONPATH=/tmp/site-trainer:$PWD \
  python3 bench/gpu/build_model.py --shape "$shape" --out "$model" --prompts "$prompts" --prompt-tokens "$tokens"
export PYTHONPATH=/tmp/site-peer:/tmp/site-vllm:/tmp/site-trainer:$PWD
export HF_HUB_OFFLINE=1 VLLM_USE_FLASHINFER_SAMPLER=${VLLM_USE_FLASHINFER_SAMPLER:-0}
status=0
timeout -k 30 "${PEER_TIMEOUT:-900}" python3 bench/gpu/peer_trl.py --t0 "$(date +%s.%N)" --model "$model" \
  --prompts "$prompts" --shape-config "$config" --steps "$steps" --out "$out/peer_trl_$shape.json" "$@" \
  2>&1 | tee "$out/peer_trl_$shape.log" | grep -v "it/s\]$" | tail -n 200 || status=$?
echo "[peer] exit $status"
exit "$status"
