"""Summary of a GPU run's iteration records as JSON: versions, T_step and phase medians, the memory table
per phase, the weight check after each publish, the reward, and every stored batch read back.

    python bench/gpu/colocated_report.py --storage-uri /tmp/vime-gpu/runs --run-name R --out r.json"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from vime_core.report.records import read_records, recurring_step_s  # noqa: E402
from vime_core.storage.store import BatchStore  # noqa: E402

GIB = 2**30
PHASES = (
    "t_rollout",
    "t_build",
    "t_persist",
    "t_offload_rollout",
    "t_wake_train",
    "t_train",
    "t_offload_train",
    "t_onload",
    "t_sync",
    "publish_s",
    "t_eval",
    "t_save",
    "t_step",
)


# the engines' log-probs of the sampled tokens against the trainer's (vime_core/trainer/train_step.py)
MISMATCH = ("train_rollout_k3_kl", "train_rollout_logprob_abs_diff")


def _median(values: list[float]) -> float | None:
    values = [v for v in values if isinstance(v, (int, float))]
    return statistics.median(values) if values else None


def memory_row(memory: dict) -> dict:
    """GiB per phase: engines' own processes (nvidia-smi) and the device total; trainer rank 0's
    allocated / reserved / peak allocated since the phase began (trainer/offload.reset_peak)."""
    row = {}
    for phase, value in (memory or {}).items():
        if not value:
            continue
        if phase.startswith("engines"):
            e = value[0] or {}
            row[phase] = {
                "engine_process_gib": (e.get("process_bytes") or 0) / GIB
                if e.get("process_bytes") is not None
                else None,
                "device_used_gib": sum((e.get("device_used_bytes") or {}).values()) / GIB,
            }
        else:
            t = value[0] if isinstance(value, list) else value
            row[phase] = {
                "allocated_gib": t.get("allocated_bytes", 0) / GIB,
                "reserved_gib": t.get("reserved_bytes", 0) / GIB,
                "peak_allocated_gib": t["peak_allocated_bytes"] / GIB if "peak_allocated_bytes" in t else None,
                "process_gib": t["process_bytes"] / GIB if t.get("process_bytes") is not None else None,
            }
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--storage-uri", required=True)
    p.add_argument("--run-name", required=True)
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    records = read_records(a.storage_uri, a.run_name)
    store = BatchStore(a.storage_uri)
    batches = []
    for r in records:
        table = store.read_table(a.run_name, r["rollout_id"])
        batches.append(
            {
                "rollout_id": r["rollout_id"],
                "rows": table.num_rows,
                "mean_response_length": sum(table.column("response_length").to_pylist()) / max(1, table.num_rows),
                "mean_prompt_length": sum(
                    len(t) - r
                    for t, r in zip(table.column("tokens").to_pylist(), table.column("response_length").to_pylist())
                )
                / max(1, table.num_rows),
            }
        )
    steady = records[1:] or records
    out = {
        "iterations": len(records),
        "versions": [[r.get("version_before"), r.get("version_after")] for r in records],
        # t_step_recurring: T_step less the eval and checkpoint of the iterations that ran them
        "phases_median_s": {
            **{k: _median([r.get(k) for r in steady]) for k in PHASES},
            "t_step_recurring": _median([recurring_step_s(r) for r in steady]),
        },
        "publish_phases_median_s": {
            k: _median([(r.get("publish_phases_s") or {}).get(k) for r in steady])
            for k in sorted({k for r in steady for k in (r.get("publish_phases_s") or {})})
        },
        "publish_transport_median_s": {
            k: _median([(r.get("publish_transport_s") or {}).get(k) for r in steady])
            for k in sorted({k for r in steady for k in (r.get("publish_transport_s") or {})})
        },
        "reward_mean": [r.get("reward_mean") for r in records],
        # with get_mismatch_metrics (or a flag that reads the engines' log-probs): engine vs trainer
        "mismatch": [{k: r.get(k) for k in MISMATCH} for r in records],
        "weight_check": [r.get("weight_check") for r in records],
        "memory": [{"rollout_id": r["rollout_id"], **memory_row(r.get("memory") or {})} for r in records],
        "batches": batches,
        "records": records,
    }
    text = json.dumps(out, indent=1, default=str)
    if a.out:
        Path(a.out).write_text(text)
    summary = {
        k: out[k]
        for k in ("iterations", "versions", "phases_median_s", "publish_phases_median_s", "publish_transport_median_s")
    }
    summary["mismatch_median"] = {k: _median([r.get(k) for r in steady]) for k in MISMATCH}
    summary["weight_check_max_abs_diff"] = [w.get("max_abs_diff") if w else None for w in out["weight_check"]]
    summary["memory_first_last"] = [out["memory"][0], out["memory"][-1]] if out["memory"] else []
    print(json.dumps(summary, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
