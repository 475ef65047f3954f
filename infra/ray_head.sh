#!/usr/bin/env bash
# A local Ray head on loopback with device slots declared, for one machine.
#
#   infra/ray_head.sh start [--num-gpus N] [--num-cpus N] [--port P] [--temp-dir DIR]   # prints the address
#   infra/ray_head.sh status                                                 # address, or exit 3
#   infra/ray_head.sh stop
#   infra/ray_head.sh join --all-interfaces --temp-dir DIR [--node-ip-address 127.0.0.2] [--num-gpus N] [--resources JSON]
#   infra/ray_head.sh leave --temp-dir DIR   # a worker node on this machine, joined to the head
#
# Idempotent: `start` on a running head prints its address. Every port is a free loopback port
# (including AUTOSCALER_METRIC_PORT / DASHBOARD_METRIC_PORT), RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
# keeps Ray on 127.0.0.1, `--num-gpus` slots work without GPUs, no dashboard, temp dir
# .cache/ray (or $VIME_RAY_TEMP_DIR). `stop` ends only this head's processes, never other Rays on
# the machine. Drivers attach with ray.init(address=<printed address>) and need
# RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 too (vime_core.cluster.connect sets it).
# The work is done by vime_core/cluster/local_head.py.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${VIME_PYTHON:-.venv/bin/python}
[ $# -ge 1 ] || { sed -n '2,9p' "$0"; exit 2; }
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
exec "$PY" -m vime_core.cluster.local_head "$@"
