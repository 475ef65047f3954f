"""Persist cost of a rollout batch, against a raw write of the same bytes to the same store.

BatchStore.write (encode, upload, read back and verify, move, index) and BatchStore.read against one
upload and one download + decode of the same Parquet bytes, plus the encoding alone, on a local
folder and a real S3 server (SeaweedFS on loopback). Prints JSON (medians, ratio = vime / baseline).
Run: bench/run.py persist [--repeats N] [--skip-s3]"""

from __future__ import annotations

import argparse
import io
import itertools
import json
import os
import platform
import shutil
import tempfile
import uuid
from pathlib import Path

import pyarrow.parquet as pq
from bench_math import median_seconds  # interleaved repeats, medians (bench/ is on sys.path)

from vime_core.storage import BatchStore
from vime_core.storage.s3_server import start_s3_server, stop_s3_server
from vime_core.storage.schema import batch_to_table
from vime_core.storage.store import _parquet_bytes
from vime_core.storage.synthetic import synthetic_batch

GROUPS, GROUP_SIZE, PROMPT_LEN, RESPONSE_LEN = 32, 8, 64, 960


def measure(store: BatchStore, batch: dict, repeats: int) -> dict:
    run = f"bench-{uuid.uuid4().hex[:8]}"
    ids = itertools.count()
    data = _parquet_bytes(batch_to_table(batch, {"run": run, "rollout_id": 0}))
    raw_keys = itertools.count()

    def write():
        store.write(batch, {"run": run, "rollout_id": next(ids), "config": {"bench": True}})

    def raw_write():
        store.location.put(f"raw/{run}/{next(raw_keys)}.parquet", data)

    def read():
        store.read(run, 0)

    def raw_read():
        pq.read_table(io.BytesIO(store.location.get(f"raw/{run}/0.parquet"))).to_pydict()

    def encode():
        _parquet_bytes(batch_to_table(batch, {"run": run, "rollout_id": 0}))

    t_write, t_raw_write, t_encode = median_seconds(write, raw_write, encode, repeats=repeats)
    t_read, t_raw_read = median_seconds(read, raw_read, repeats=repeats)
    return {
        "write_s": round(t_write, 4),
        "raw_write_s": round(t_raw_write, 4),
        "write_ratio": round(t_write / t_raw_write, 2),
        "encode_s": round(t_encode, 4),
        "read_s": round(t_read, 4),
        "raw_read_s": round(t_raw_read, 4),
        "read_ratio": round(t_read / t_raw_read, 2),
        "parquet_bytes": len(data),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--skip-s3", action="store_true", help="measure the local folder only")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args()
    batch = synthetic_batch(GROUPS, GROUP_SIZE, PROMPT_LEN, RESPONSE_LEN, min_response_len=RESPONSE_LEN, seed=0)
    result = {
        "bench": "persist",
        "batch": {"samples": GROUPS * GROUP_SIZE, "tokens_per_sample": PROMPT_LEN + RESPONSE_LEN},
        "repeats": args.repeats,
        "statistic": "median seconds; ratio = vime / baseline (raw write/read of the same bytes)",
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "load_average_1m_at_start": round(os.getloadavg()[0], 1),
        },
    }
    work = Path(tempfile.mkdtemp(prefix="vime-bench-"))
    try:
        result["local"] = measure(BatchStore(str(work / "store")), batch, args.repeats)
        if not args.skip_s3:
            # Made-up credentials for the throwaway server this benchmark starts.
            os.environ.setdefault("AWS_ACCESS_KEY_ID", "vimebenchkey")
            os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "vimebenchsecret" + uuid.uuid4().hex)
            server = start_s3_server(work / "s3", bucket="bench")
            try:
                os.environ["AWS_ENDPOINT_URL"] = server.endpoint
                result["s3_seaweedfs_loopback"] = measure(BatchStore(server.storage_uri("p")), batch, args.repeats)
            finally:
                stop_s3_server(work / "s3")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result["machine"]["load_average_1m_at_end"] = round(os.getloadavg()[0], 1)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
