#!/usr/bin/env bash
# Sets everything up (idempotently) and runs the whole test suite: unit tests and integration
# tests that start the real servers they need (vLLM CPU, vllm-router, Ray, Prefect, SeaweedFS)
# and stop them afterwards. `.ci/run` calls exactly this. Extra arguments go to pytest, e.g. the
# fast tier: `bash infra/test.sh -m unit` (in-process tests only; docs/testing.md has the tiers).
set -euo pipefail
cd "$(dirname "$0")/.."
bash infra/setup_env.sh
export PREFECT_HOME="${PREFECT_HOME:-$(mktemp -d -t vime-prefect-XXXXXX)}"
source infra/env.sh
echo "[test] ruff check, ruff format --check (pyproject.toml)"
.venv/bin/ruff check --quiet . && .venv/bin/ruff format --check --quiet .
# every test's seconds (setup + call + teardown) stay in .cache/tests/last-run.xml for the next look
# at where the time goes; the slowest 15 are printed at the end
echo "[test] pytest (PREFECT_HOME=$PREFECT_HOME)"
exec .venv/bin/python -m pytest -ra --durations=15 --junitxml=.cache/tests/last-run.xml "$@" tests
