#!/usr/bin/env bash
# The device tool brings back at most 8 files from $OUT: keep its top-level JSON files and pack
# everything else (logs, reports, the learning run's folder) into $OUT/logs.tgz.
set -uo pipefail
cd "${OUT:?}" || exit 1
tar czf /tmp/logs.tgz --exclude='./*.json' . && find . -mindepth 1 -maxdepth 1 ! -name '*.json' -exec rm -rf {} + && mv /tmp/logs.tgz logs.tgz
ls -la
