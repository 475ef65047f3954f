#!/usr/bin/env bash
# A colocated run stopped while its engines sleep resumes with the same command. Runs after
# bench/gpu/run_colocated_h200.sh with KEEP_ACTORS=1 (same run, actors up, K iterations done);
# tests/gpu/test_colocated_recovery.py runs it; by hand: bash tests/gpu/check_stopped_asleep.sh K ITERATIONS
# HARM=kill (default): the driver is SIGKILLed while the engines sleep (at the start of
# onload-weights-K: they slept at level 2 and dropped their weights, the trainer trained rollout K),
# then the same command runs again. Bootstrap must wake the engines' weights and publish the
# trainer's weights to them although they report the current version; the re-run iteration K must
# put them to sleep again (little memory after offload_rollout) and the weight check after its
# publish must hold.
# HARM=hog instead: the driver is not killed; while it waits at onload-weights-K another process
# takes all but LEAVE_GIB (0.25) of the GPU's free memory (tests/gpu/hold_device_memory.py), so the
# engine's wake runs out of memory part-way. The iteration must fail with the engine named, the
# driver must stop after its retries, and after the memory is given back the same command must
# restart the engine (a half-woken vLLM cannot wake again), give it the trainer's weights and go on.
# HARM=term instead: the driver, started in a session of its own (with its Prefect server), goes on
# from train-K (PAUSE_AT default) and 0.5 s later its session gets SIGTERM, as a scheduler preempting
# the job: it must exit 143 within the grace period (vime_core/utils/interrupt.py) with the resume
# hint and without retrying the train task; the same command then resumes the run.
# Writes $OUT/stopped_asleep.json (wake_failure.json with HARM=hog, stopped_by_sigterm.json with
# HARM=term) and the matching .log.
set -uo pipefail
cd "$(dirname "$0")/../.."
k=${1:?usage: check_stopped_asleep.sh K ITERATIONS}; iters=${2:?usage: check_stopped_asleep.sh K ITERATIONS}
out=${OUT:-/tmp/vime-out}; work=${VIME_GPU_WORK:-/tmp/vime-gpu}; run=${RUN_NAME:-gpu-colocated-0.5b}
harm=${HARM:-kill}; name=stopped_asleep; [ "$harm" = hog ] && name=wake_failure
at=onload-weights-$k; launcher=""; [ "$harm" = term ] && { name=stopped_by_sigterm; at=train-$k; launcher=setsid; }
at=${PAUSE_AT:-$at}  # another task run name only to try the script where engines do not sleep (CPU)
pause=$work/pause; mkdir -p "$out" "$pause"; rm -f "$pause"/*
export PYTHONPATH=/tmp/site-trainer:$PWD
export RAY_AUTH_MODE=disabled RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 HF_HUB_OFFLINE=1 PREFECT_HOME=$work/prefect
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=120
address=$(python3 -m flows.cli cluster up --num-gpus "${NUM_GPUS:-1}" | tail -n 1)
# TRAIN_FLAGS: the run's own flags (empty: the CPU default job, to try the script without a GPU)
flags=${TRAIN_FLAGS-"--config bench/gpu/colocated_0.5b.yaml --hf-checkpoint $work/model-0.5b --prompt-data $work/prompts-long.jsonl --eval-prompt-data $work/prompts-long.jsonl"}
train() {
  $launcher python3 -m flows.cli train $flags --run-name "$run" --num-rollout "$iters" --ray-address "$address" --storage-uri "$work/runs"
}
t0=$(date +%s)
VIME_FAULT_PAUSE_AT=$at VIME_FAULT_PAUSE_DIR=$pause train > "$work/stopped_1.log" 2>&1 &
driver=$!
while [ ! -s "$pause/$at" ] && kill -0 $driver 2>/dev/null && [ $(( $(date +%s) - t0 )) -lt "${PAUSE_TIMEOUT:-240}" ]; do sleep 1; done
paused=0; [ -s "$pause/$at" ] && paused=1
# what the engines say (asleep or not, or why they do not answer)
engines_asleep() {
  python3 - "$address" "$run" <<'PY' 2>/dev/null || echo unknown
import json, sys, urllib.request
import ray
from vime_core.cluster import names
ray.init(address=sys.argv[1], logging_level="ERROR")
manager = ray.get_actor(names.ROLLOUT_MANAGER, namespace=names.namespace(sys.argv[2]))
def asleep(url):
    try:
        return json.load(urllib.request.urlopen(url + "/is_sleeping", timeout=10))["is_sleeping"]
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
print(json.dumps([asleep(u) for u in ray.get(manager.engine_urls.remote())]))
PY
}
asleep_at_kill=$(engines_asleep)
first_code=killed; harm_info=null; after_failure=null
if [ "$harm" = hog ] && [ "$paused" = 1 ]; then
  rm -f "$work/hog.ready"
  python3 tests/gpu/hold_device_memory.py --leave-gib "${LEAVE_GIB:-0.25}" --ready "$work/hog.ready" > "$work/hog.log" 2>&1 &
  hog=$!
  for _ in $(seq 120); do [ -s "$work/hog.ready" ] || ! kill -0 $hog 2>/dev/null && break; sleep 0.5; done
  harm_info=$(cat "$work/hog.ready" 2>/dev/null || echo null)
  echo "[gpu] memory held: $harm_info"
  rm -f "$pause/$at"  # the driver goes on into the wake
  t1=$(date +%s)
  while kill -0 $driver 2>/dev/null && [ $(( $(date +%s) - t1 )) -lt "${FAIL_TIMEOUT:-300}" ]; do sleep 1; done
  kill -0 $driver 2>/dev/null && { echo "[gpu] the driver did not stop within ${FAIL_TIMEOUT:-300} s"; kill -9 $driver; }
  wait $driver; first_code=$?
  after_failure=$(engines_asleep)
  kill $hog 2>/dev/null; wait $hog 2>/dev/null
  echo "[gpu] driver exit $first_code after $(( $(date +%s) - t1 )) s without the memory; engines: $after_failure"
elif [ "$harm" = term ] && [ "$paused" = 1 ]; then
  leader=$(cat "$pause/$at")  # the driver, leader of its own session (setsid)
  rm -f "$pause/$at"; sleep 0.5  # the train task goes on into its call to the trainer
  t1=$(date +%s%N)
  kill -TERM -- "-$leader"
  while kill -0 "$leader" 2>/dev/null && [ $(( $(date +%s%N) - t1 )) -lt 60000000000 ]; do sleep 0.1; done
  kill -0 "$leader" 2>/dev/null && { echo "[gpu] the driver did not stop within 60 s of SIGTERM"; kill -9 -- "-$leader"; }
  wait $driver; first_code=$?
  harm_info=$(( ($(date +%s%N) - t1) / 1000000 ))e-3  # seconds from SIGTERM to the driver's exit (JSON number)
  kill -9 -- "-$leader" 2>/dev/null  # anything of its session left behind
  echo "[gpu] driver exit $first_code ${harm_info} s after SIGTERM at $at"
else
  # the pause file holds the driver's own pid ($driver is the subshell that runs it)
  [ "$paused" = 1 ] && kill -9 "$(cat "$pause/$at")" 2>/dev/null
  kill -9 $driver 2>/dev/null; wait $driver 2>/dev/null
  echo "[gpu] driver killed at $at (paused=$paused) after $(( $(date +%s) - t0 )) s"
fi
rm -f "$pause"/*
timeout -k 30 "${RERUN_TIMEOUT:-360}" bash -c "$(declare -f train); flags='$flags' address=$address run=$run iters=$iters work=$work; train" > "$work/stopped_2.log" 2>&1
code=$?
echo "[gpu] re-run exit $code after $(( $(date +%s) - t0 )) s"
python3 bench/gpu/colocated_report.py --storage-uri "$work/runs" --run-name "$run" --out "$out/${name}_report.json" > /dev/null || true
{ echo "== first run"; grep -v "it/s\]$" "$work/stopped_1.log" | tail -n 60; echo "== re-run"; grep -v "it/s\]$" "$work/stopped_2.log" | tail -n 80; } > "$out/$name.log"
python3 - "$k" "$iters" "$code" "$paused" "$asleep_at_kill" "$work" "$out" "$at" "$harm" "$first_code" "$harm_info" "$after_failure" "$name" <<'PY'
import json, pathlib, sys
from vime_core.utils.interrupt import GRACE_S
k, iters, code, paused = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
asleep_at_kill, work, out = sys.argv[5], pathlib.Path(sys.argv[6]), pathlib.Path(sys.argv[7])
harm, first_code, harm_info, after_failure, name = sys.argv[9], sys.argv[10], sys.argv[11], sys.argv[12], sys.argv[13]
first = (work / "stopped_1.log").read_text(errors="replace")
rerun = (work / "stopped_2.log").read_text(errors="replace")
# the re-run's bootstrap: engines woken (a driver killed) or an engine restarted (a wake that failed)
marker = "could not wake" if harm == "hog" else "asleep (an iteration stopped"
woke = [l.strip() for l in rerun.splitlines() if marker in l]
wake_errors = [l.strip()[:600] for l in first.splitlines() if "did not wake" in l or "EngineWakeError" in l][:6]
report = json.loads((out / f"{name}_report.json").read_text())
by_id = {r["rollout_id"]: r for r in report["records"]}
rec = by_id.get(k, {})
mem = (rec.get("memory") or {}).get("engines_after_offload_rollout") or [{}]
awake = (rec.get("memory") or {}).get("engines_after_onload_kv") or [{}]
checks = {i: (by_id[i].get("weight_check") or {}).get("max_abs_diff") for i in range(k, iters) if i in by_id}
before = [(r.get("weight_check") or {}).get("max_abs_diff") for i, r in by_id.items() if i < k]
tolerance = 1.5 * max([b for b in before if b is not None] or [float("nan")])  # this run's own bf16 spread
rollout_ids = [r["rollout_id"] for r in report["records"]]
# HARM=term: harm_info is the seconds from SIGTERM to the driver's exit (null: it never paused)
term = {"seconds_from_sigterm_to_exit": json.loads(harm_info), "resume_hint": "to resume" in first,
        "task_retried_after_sigterm": f"{sys.argv[8]} failed" in first}
result = {
    "bench": name, "harm": harm, "at": sys.argv[8], "paused_there": paused,
    "engines_asleep_there": asleep_at_kill, "rerun_exit_code": code, "bootstrap_line": woke[0] if woke else None,
    "first_run_exit_code": first_code, "first_run_wake_errors": wake_errors,
    **(term if harm == "term" else {"memory_held": json.loads(harm_info)}),
    "engines_after_the_failed_run": after_failure, "records_per_rollout_id_all_one": len(rollout_ids) == len(set(rollout_ids)),
    "rerun_iteration_from_store": rec.get("from_store"), "versions": report["versions"],
    "engine_process_gib_after_offload_rollout": (mem[0].get("process_bytes") or 0) / 2**30,
    "engine_process_gib_after_onload_kv": (awake[0].get("process_bytes") or 0) / 2**30,
    "weight_check_max_abs_diff_before": before, "weight_check_max_abs_diff_after": checks,
    "tolerance_1_5x_max_before": tolerance,
    "ok": code == 0 and bool(woke) and all(v == [i + 1, i + 2] for i, v in enumerate(report["versions"]))
          and all(c is not None and c <= tolerance for c in checks.values()) and len(rollout_ids) == len(set(rollout_ids))
          and (harm != "hog" or (first_code not in ("0", "killed") and bool(wake_errors)))
          and (harm != "term" or (first_code == "143" and term["seconds_from_sigterm_to_exit"] is not None
                                  and term["seconds_from_sigterm_to_exit"] < GRACE_S + 5 and term["resume_hint"]
                                  and not term["task_retried_after_sigterm"])),
}
(out / f"{name}.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
print(json.dumps(result, default=str))
PY
