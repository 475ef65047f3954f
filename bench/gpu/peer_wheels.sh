#!/usr/bin/env bash
# Wheels of the peer trainer (TRL's GRPOTrainer, bench/gpu/peer_trl.py) for the H200 host's Python
# 3.12 on x86_64: TRL and only what it imports there that neither the host's own packages (torch,
# transformers, huggingface-hub, numpy, pyarrow, requests, aiohttp, fsspec, jinja2, python-dateutil:
# what vLLM, prefect and transformers need that the pins leave out) nor the bundle's sites provide
# (/tmp/site-vllm: vLLM, pydantic, dill 0.4.1; /tmp/site-trainer: psutil from extra_wheels.sh).
# Keep them in their own folder (.gpu/peer), not beside the bundle's parts: host_setup.sh unpacks
# every wheel there into the trainer's site. bench/gpu/run_peer_trl_h200.sh unpacks them into
# /tmp/site-peer on the host (about 57 MB from 14 MB of wheels). Any Python with pip runs this.
#   bash bench/gpu/peer_wheels.sh DIR
set -euo pipefail
dir=${1:?usage: peer_wheels.sh DIR}
mkdir -p "$dir"
pins=(
  trl==1.16.0           # the peer measured in issue 43 (GRPOTrainer, vLLM colocate + sleep)
  accelerate==1.15.0    # TRL's Trainer backend (accelerate>=1.10.1); the version vime's trainer lock pins
  # datasets>=4.7.0 for TRL. 5.1+ declare huggingface-hub>=1.31 while the host's transformers 5.17
  # caps the hub below 2.0 at a version not recorded; 5.0.1 takes any hub >= 0.25 and the
  # bundle's dill 0.4.1 (< 0.4.2), the newest release that fits both.
  datasets==5.0.1
  pandas==3.1.1         # datasets imports it at import time (numpy>=2.0.2, python-dateutil: host)
  xxhash==4.1.0         # datasets' fingerprints, imported at import time
  multiprocess==0.70.19 # datasets' map workers, imported at import time (dill>=0.4.1: site-vllm's)
)
python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_28_x86_64 \
  -d "$dir" "${pins[@]}"
ls -l "$dir"/*.whl
du -ch "$dir"/*.whl | tail -n 1
