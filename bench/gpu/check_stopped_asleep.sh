#!/usr/bin/env bash
# Issue 14, failures: the driver of a colocated run is SIGKILLed while the engines sleep (at the
# start of onload-weights-K: they slept at level 2 and dropped their weights, the trainer trained
# rollout K), then the same command runs again. Bootstrap must wake the engines' weights and
# publish the trainer's weights to them although they report the current version; the re-run
# iteration K must put them to sleep again (little memory after offload_rollout) and the weight
# check after its publish must hold. Runs after run_colocated_h200.sh with KEEP_ACTORS=1 (same
# run, actors up, K iterations done).   bash bench/gpu/check_stopped_asleep.sh K ITERATIONS
# Writes $OUT/stopped_asleep.json and stopped_asleep.log.
set -uo pipefail
cd "$(dirname "$0")/../.."
k=${1:?usage: check_stopped_asleep.sh K ITERATIONS}; iters=${2:?usage: check_stopped_asleep.sh K ITERATIONS}
out=${OUT:-/tmp/vime-out}; work=${VIME_GPU_WORK:-/tmp/vime-gpu}; run=${RUN_NAME:-gpu-colocated-0.5b}
at=${PAUSE_AT:-onload-weights-$k}  # another task run name only to try the script where engines do not sleep (CPU)
pause=$work/pause; mkdir -p "$out" "$pause"; rm -f "$pause"/*
export PYTHONPATH=/tmp/site-trainer:$PWD
export RAY_AUTH_MODE=disabled RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 HF_HUB_OFFLINE=1 PREFECT_HOME=$work/prefect
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=120
address=$(python3 -m flows.cli cluster up --num-gpus "${NUM_GPUS:-1}" | tail -n 1)
# TRAIN_FLAGS: the run's own flags (empty: the CPU default job, to try the script without a GPU)
flags=${TRAIN_FLAGS-"--config bench/gpu/colocated_0.5b.yaml --hf-checkpoint $work/model-0.5b --prompt-data $work/prompts-long.jsonl --eval-prompt-data $work/prompts-long.jsonl"}
train() {
  python3 -m flows.cli train $flags --run-name "$run" --num-rollout "$iters" --ray-address "$address" --storage-uri "$work/runs"
}
t0=$(date +%s)
VIME_FAULT_PAUSE_AT=$at VIME_FAULT_PAUSE_DIR=$pause train > "$work/stopped_1.log" 2>&1 &
driver=$!
while [ ! -s "$pause/$at" ] && kill -0 $driver 2>/dev/null && [ $(( $(date +%s) - t0 )) -lt "${PAUSE_TIMEOUT:-240}" ]; do sleep 1; done
paused=0; [ -s "$pause/$at" ] && paused=1
# what the engine says while the driver is paused there (it should be asleep)
asleep_at_kill=$(python3 - "$address" "$run" <<'PY' 2>/dev/null || echo unknown
import json, sys, urllib.request
import ray
from vime_core.cluster import names
ray.init(address=sys.argv[1], logging_level="ERROR")
manager = ray.get_actor(names.ROLLOUT_MANAGER, namespace=names.namespace(sys.argv[2]))
print(all(json.load(urllib.request.urlopen(u + "/is_sleeping"))["is_sleeping"] for u in ray.get(manager.engine_urls.remote())))
PY
)
# the pause file holds the driver's own pid ($driver is the subshell that runs it)
[ "$paused" = 1 ] && kill -9 "$(cat "$pause/$at")" 2>/dev/null
kill -9 $driver 2>/dev/null; wait $driver 2>/dev/null; rm -f "$pause"/*
echo "[gpu] driver killed at $at (paused=$paused) after $(( $(date +%s) - t0 )) s"
timeout -k 30 "${RERUN_TIMEOUT:-360}" bash -c "$(declare -f train); flags='$flags' address=$address run=$run iters=$iters work=$work; train" > "$work/stopped_2.log" 2>&1
code=$?
echo "[gpu] re-run exit $code after $(( $(date +%s) - t0 )) s"
python3 bench/gpu/colocated_report.py --storage-uri "$work/runs" --run-name "$run" --out "$out/stopped_asleep_report.json" > /dev/null || true
{ echo "== killed run"; grep -v "it/s\]$" "$work/stopped_1.log" | tail -n 40; echo "== re-run"; grep -v "it/s\]$" "$work/stopped_2.log" | tail -n 80; } > "$out/stopped_asleep.log"
python3 - "$k" "$iters" "$code" "$paused" "$asleep_at_kill" "$work" "$out" "$at" <<'PY'
import json, pathlib, sys
k, iters, code, paused = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
asleep_at_kill, work, out = sys.argv[5], pathlib.Path(sys.argv[6]), pathlib.Path(sys.argv[7])
rerun = (work / "stopped_2.log").read_text(errors="replace")
woke = [l.strip() for l in rerun.splitlines() if "asleep (an iteration stopped" in l]
report = json.loads((out / "stopped_asleep_report.json").read_text())
by_id = {r["rollout_id"]: r for r in report["records"]}
rec = by_id.get(k, {})
mem = (rec.get("memory") or {}).get("engines_after_offload_rollout") or [{}]
awake = (rec.get("memory") or {}).get("engines_after_onload_kv") or [{}]
checks = {i: (by_id[i].get("weight_check") or {}).get("max_abs_diff") for i in range(k, iters) if i in by_id}
before = [(r.get("weight_check") or {}).get("max_abs_diff") for i, r in by_id.items() if i < k]
tolerance = 1.5 * max([b for b in before if b is not None] or [float("nan")])  # this run's own bf16 spread
result = {
    "bench": "stopped_asleep", "killed_at": sys.argv[8], "paused_before_kill": paused,
    "engine_is_sleeping_at_kill": asleep_at_kill, "rerun_exit_code": code, "bootstrap_woke_line": woke[0] if woke else None,
    "rerun_iteration_from_store": rec.get("from_store"), "versions": report["versions"],
    "engine_process_gib_after_offload_rollout": (mem[0].get("process_bytes") or 0) / 2**30,
    "engine_process_gib_after_onload_kv": (awake[0].get("process_bytes") or 0) / 2**30,
    "weight_check_max_abs_diff_before": before, "weight_check_max_abs_diff_after": checks,
    "tolerance_1_5x_max_before": tolerance,
    "ok": code == 0 and bool(woke) and all(v == [i + 1, i + 2] for i, v in enumerate(report["versions"]))
          and all(c is not None and c <= tolerance for c in checks.values()),
}
(out / "stopped_asleep.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
print(json.dumps(result, default=str))
PY
