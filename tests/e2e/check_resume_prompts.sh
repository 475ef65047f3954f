#!/usr/bin/env bash
# A run killed and resumed with new actors trains on the same prompts as an uninterrupted one.
# Run A: 6 iterations, checkpoint every 3. Run B: the same, its driver SIGKILLed once rollout 4 is
# recorded, its actors torn down (a new RolloutManager), then the same command again. Prints JSON:
# per rollout id, whether B's prompt ids equal A's, and "ok". Two real runs on a local Ray head,
# tests/e2e/test_resume_prompts.py runs it (VIME_E2E=1).
#   bash tests/e2e/check_resume_prompts.sh
set -u
cd "$(dirname "$0")/../.." && source infra/env.sh
export PREFECT_HOME=$(mktemp -d)
S=$(mktemp -d -t vime-resume-prompts-XXXX)
.venv/bin/vime cluster up --num-gpus 1 >/dev/null 2>&1
trap '.venv/bin/vime teardown --run-name A >/dev/null 2>&1; .venv/bin/vime teardown --run-name B >/dev/null 2>&1; .venv/bin/vime cluster down >/dev/null 2>&1' EXIT
common=(--num-rollout 6 --save-interval 3 --storage-uri "$S")
timeout 600 .venv/bin/vime train --run-name A "${common[@]}" > "$S/A.log" 2>&1
.venv/bin/vime teardown --run-name A >/dev/null 2>&1
# B's driver leads a session of its own: killing that session stops it and nothing else
setsid timeout 600 .venv/bin/vime train --run-name B "${common[@]}" > "$S/B1.log" 2>&1 &
driver=$!
for _ in $(seq 1 1200); do
  [ "$(grep -c '"rollout_id"' "$S/reports/B/metrics.jsonl" 2>/dev/null || echo 0)" -ge 5 ] && break
  kill -0 "$driver" 2>/dev/null || break
  sleep 0.5
done
kill -9 -- "-$driver" 2>/dev/null; wait "$driver" 2>/dev/null; sleep 2
.venv/bin/vime teardown --run-name B >/dev/null 2>&1
timeout 600 .venv/bin/vime train --run-name B "${common[@]}" > "$S/B2.log" 2>&1
.venv/bin/python - "$S" <<'PY'
import json, sys
from vime_core.storage import BatchStore
store = BatchStore(sys.argv[1])
same = {k: sorted(set(store.read("A", k)[0]["prompt_id"])) == sorted(set(store.read("B", k)[0]["prompt_id"])) for k in range(6)}
print(json.dumps({"check": "resume_prompts", "storage": sys.argv[1], "same_prompts_per_rollout": same, "ok": all(same.values())}))
PY
