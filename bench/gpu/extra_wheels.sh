#!/usr/bin/env bash
# Wheels the trainer side imports that the GPU host's bundle of pinned wheels (built outside this repository)
# does not carry, at the versions of requirements/trainer.lock.txt, for the H200 host's Python
# 3.12 on x86_64. Put them beside the bundle's parts (e.g. .gpu/p4/): run_colocated_h200.sh
# unpacks every *.whl it finds there into /tmp/site-trainer. Any Python with pip runs it.
#   bash bench/gpu/extra_wheels.sh DIR
set -euo pipefail
cd "$(dirname "$0")/../.."
dir=${1:?usage: extra_wheels.sh DIR}
mkdir -p "$dir"
pins=()
for name in tenacity psutil; do
  pin=$(grep -i "^$name==" requirements/trainer.lock.txt) || { echo "$name is not in requirements/trainer.lock.txt" >&2; exit 1; }
  pins+=("$pin")
done
python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  -d "$dir" "${pins[@]}"
ls "$dir"/*.whl
