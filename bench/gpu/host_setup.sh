#!/usr/bin/env bash
# The GPU host's packages for every bench phase, in one step: the bundle's pinned wheels unpacked
# into /tmp/site-vllm and /tmp/site-trainer (install_bundle.sh skips what is already there), then
# the wheels of bench/gpu/extra_wheels.sh found beside the parts, over the trainer's site, then
# their bytecode, as pip would have written it.
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
# pip writes the bytecode when it installs; the bundle ships none (--no-compile), so without this
# every process's first import on a fresh host also compiles it (bench/gpu/import_time.py: vLLM's
# front end 27.9 s the first time, 22.3 s after)
compiled=/tmp/site-trainer/.vime-bytecode
if [ ! -e "$compiled" ]; then
  python3 -m compileall -q -j 0 /tmp/site-vllm /tmp/site-trainer >/dev/null 2>&1 || true
  touch "$compiled"
fi
exit 0
