#!/usr/bin/env bash
# A real `vime train` of the embedded demo with on-policy distillation: the teacher is the demo
# model with its final norm's weight times 4 (tests/integration/trainer/test_distillation_learning.py
# explains the choice), loaded by the Ray trainer actor from --opd-teacher-load. 4 iterations on an
# own local Ray head (its own temp dir: other heads on the machine are left alone). Prints JSON:
# opd_reverse_kl per iteration from metrics.jsonl, and "ok" (present, finite, the last below the
# first). tests/e2e/test_distillation_run.py runs it (VIME_E2E=1).
#   bash tests/e2e/check_distillation_run.sh
set -u
cd "$(dirname "$0")/../.." && source infra/env.sh
export PYTHONPATH=$PWD PREFECT_HOME=$(mktemp -d) VIME_RAY_TEMP_DIR=$(mktemp -d -t vime-ray-opd-XXXX)
S=$(mktemp -d -t vime-opd-run-XXXX)
.venv/bin/python - "$S" <<'PY'
import shutil, sys, torch
from transformers import AutoModelForCausalLM
from vime_core.demo.model import build_tiny_model
student = build_tiny_model(f"{sys.argv[1]}/student", family="qwen3", seed=0)  # the demo's model
shutil.copytree(student, f"{sys.argv[1]}/teacher")
model = AutoModelForCausalLM.from_pretrained(str(student), dtype=torch.float32)
with torch.no_grad():
    model.model.norm.weight.mul_(4.0)
model.save_pretrained(f"{sys.argv[1]}/teacher", safe_serialization=True)
PY
address=$(.venv/bin/vime cluster up --num-gpus 1 2>/dev/null | tail -n 1)
trap '.venv/bin/vime teardown --run-name opd --ray-address "$address" >/dev/null 2>&1; .venv/bin/vime cluster down >/dev/null 2>&1' EXIT
timeout 600 .venv/bin/vime train --run-name opd --ray-address "$address" --storage-uri "$S" --num-rollout 4 \
    --rollout-batch-size 16 --n-samples-per-prompt 8 --entropy-coef 0 \
    --use-opd --opd-type megatron --opd-teacher-load "$S/teacher" > "$S/train.log" 2>&1
code=$?
.venv/bin/python - "$S" "$code" <<'PY'
import json, math, sys
from pathlib import Path
s, code = Path(sys.argv[1]), int(sys.argv[2])
path = s / "reports" / "opd" / "metrics.jsonl"
records = [json.loads(l) for l in path.read_text().splitlines() if l.strip()] if path.exists() else []
kl = [r.get("opd_reverse_kl") for r in records if "rollout_id" in r]
ok = code == 0 and len(kl) == 4 and all(isinstance(v, float) and math.isfinite(v) for v in kl) and kl[-1] < kl[0]
tail = "" if ok else "".join((s / "train.log").read_text(errors="replace").splitlines(True)[-40:])
print(json.dumps({"check": "distillation_run", "storage": str(s), "exit_code": code, "opd_reverse_kl": kl, "ok": ok, "log_tail": tail}))
PY
