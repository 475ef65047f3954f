#!/usr/bin/env bash
# Sets everything up (idempotently) and runs the whole test suite: unit tests and integration
# tests that start the real servers they need (vLLM CPU, vllm-router, Ray, Prefect, SeaweedFS)
# and stop them afterwards. `.ci/run` calls exactly this. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash infra/setup_env.sh
export PREFECT_HOME="${PREFECT_HOME:-$(mktemp -d -t vime-prefect-XXXXXX)}"
export PREFECT_LOGGING_LEVEL="${PREFECT_LOGGING_LEVEL:-WARNING}"
# a loaded 2-core machine can take longer than the default 20 s to start the temporary server
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="${PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS:-120}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
echo "[test] pytest (PREFECT_HOME=$PREFECT_HOME)"
exec .venv/bin/python -m pytest -ra --durations=15 "$@" tests
