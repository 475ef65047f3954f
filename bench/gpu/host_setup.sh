#!/usr/bin/env bash
# The GPU host's packages for every bench phase, in one step: the bundle's pinned wheels unpacked
# into /tmp/site-vllm and /tmp/site-trainer (install_bundle.sh skips what is already there), then
# the wheels of bench/gpu/extra_wheels.sh found beside the parts, over the trainer's site.
#   bash bench/gpu/host_setup.sh          # PARTS: the folder of the parts (default /tmp/parts)
# Then the trainer side runs with PYTHONPATH=/tmp/site-trainer:<repo>.
set -euo pipefail
parts=${PARTS:-/tmp/parts}
bash "$parts/install_bundle.sh" "$parts"
# once per host: every phase and startup variant calls this script
stamp=/tmp/site-trainer/.vime-extra-wheels
if [ ! -e "$stamp" ]; then
  for wheel in "$parts"/*.whl; do
    [ -e "$wheel" ] && python3 -m zipfile -e "$wheel" /tmp/site-trainer/ && basename "$wheel" >> "$stamp"
  done
  touch "$stamp"
fi
exit 0
