"""Summary of a GPU run's iteration records as JSON: versions, T_step and phase medians, the memory table
per phase, the weight check after each publish, the reward, every stored batch read back, and the
trainer's MFU in its optimizer steps (`step_mfu`).

    python bench/gpu/colocated_report.py --storage-uri /tmp/vime-gpu/runs --run-name R --out r.json"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from vime_core.report.records import CONFIG, read_records, recurring_step_s, report_location  # noqa: E402
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


def step_mfu(model: dict, run: dict, lengths: list[int], response_tokens: int, step_s: float) -> dict:
    """The optimizer steps' MFU on one rollout (every sample once; the record's step_time_s, the
    log-prob passes apart): bench/gpu_common.step_flops with attention, the LM head on the response
    tokens, over 989 TFLOP/s. Full fine-tuning counts forward and backward (3 passes); LoRA counts
    forward and the activations' gradients (2: the frozen base has no weight gradients).
    `with_recompute` adds the forward that full recompute runs again (hardware FLOPs, not model's)."""
    import gpu_common  # boundary: torch, on the GPU host's path

    passes = 2 if run.get("lora_rank") else 3

    def mfu(n: int) -> float:
        flops = gpu_common.step_flops(model, lengths, passes=n, head_tokens=response_tokens)
        return gpu_common.mfu(flops["dense"] + flops["attention"], step_s)

    out = {"passes": passes, "mfu": mfu(passes)}
    if run.get("recompute_granularity") == "full":
        out["with_recompute"] = mfu(passes + 1)
    return out


def _read_json(read, what: str) -> dict:
    try:
        return json.loads(read())
    except Exception as exc:  # a report without it (older runs, a missing checkpoint folder): no MFU
        print(f"[report] no {what}: {exc}", file=sys.stderr)
        return {}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--storage-uri", required=True)
    p.add_argument("--run-name", required=True)
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    records = read_records(a.storage_uri, a.run_name)
    store = BatchStore(a.storage_uri)
    run = _read_json(lambda: report_location(a.storage_uri, a.run_name).get(CONFIG), "run configuration")
    checkpoint = Path(run.get("hf_checkpoint") or "/nonexistent")
    model = _read_json(lambda: (checkpoint / "config.json").read_text(), "model configuration")
    if model and not model.get("head_dim"):  # HF's Qwen2 configs leave it to hidden_size / heads
        model["head_dim"] = model["hidden_size"] // model["num_attention_heads"]
    batches, mfus = [], []
    for r in records:
        table = store.read_table(a.run_name, r["rollout_id"])
        lengths = [len(t) for t in table.column("tokens").to_pylist()]
        responses = table.column("response_length").to_pylist()
        if model and r.get("step_time_s"):
            mfu = step_mfu(model, run, lengths, sum(responses), r["step_time_s"])
            mfus.append({"rollout_id": r["rollout_id"], **mfu})
        batches.append(
            {
                "rollout_id": r["rollout_id"],
                "rows": table.num_rows,
                "mean_response_length": sum(responses) / max(1, table.num_rows),
                "mean_prompt_length": (sum(lengths) - sum(responses)) / max(1, table.num_rows),
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
        "step_mfu": mfus,
        "step_mfu_median": _median([m["mfu"] for m in mfus if m["rollout_id"] in {r["rollout_id"] for r in steady}]),
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
    summary["step_mfu_median"] = out["step_mfu_median"]
    summary["memory_first_last"] = [out["memory"][0], out["memory"][-1]] if out["memory"] else []
    print(json.dumps(summary, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
