"""`vime rescore`: score a run's stored samples again with a new reward function, without generating
anything, store the new rewards beside the old ones (vime_core/storage/rescored.py), and say what
the old rewards reached (the blast radius).

Per stored batch of the run (the chosen rollout ids, else all):

    samples   each row back as a Sample: tokens, lengths, finish reason and metadata as stored;
              prompt and label from the run's prompt data by prompt_id (the run's config.json);
              response = the response tokens decoded with the run's tokenizer, a final EOS left
              out (as the rollout decodes it); a sample whose reward function failed (status
              failed, metadata reward_error) is scored again as completed or truncated
    score     the new function, loaded as the run loads its own (rewards/hub.py RewardHub, with
              the run's group_rm): FAILED where it raises or returns no finite number
    rebuild   build_batch with the run's configuration: shaping, the run's estimator's group
              normalisation (advantage_estimator, grpo_std_normalization), failed samples masked

Blast radius, per rollout id k:
    changed      samples whose raw reward or failed status differs from the stored one
    advantages   every sample of a changed sample's group whose advantage moved (the group's
                 mean and std moved with it): advantage after - before
    checkpoints  the run's checkpoints at rollout ids >= k (each trained on batch k), and the
                 weight versions from v(k + 2) on (v(k + 1) sampled batch k; training on it made v(k + 2))

The function's lineage: its path, and the sha256 of the source file that defines it.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import inspect
import json
from typing import Any, Optional, Sequence

from vime_core.config.loader import read_run_config
from vime_core.data.batch import MASK_BEFORE_FAILURE_KEY, build_batch, mask_of_runs
from vime_core.data.data_source import load_prompt_rows, load_tokenizer
from vime_core.data.sample import Sample, Status
from vime_core.rewards.hub import RewardHub
from vime_core.rollout.generate import decode_response
from vime_core.storage import BatchStore, rescored
from vime_core.storage.schema import code_version
from vime_core.trainer.checkpoint import finished_checkpoints


def source_sha256(fn: Any) -> str:
    """sha256 of the source file that defines `fn` (its function's own source where no file)."""
    try:
        path = inspect.getsourcefile(fn)
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except (TypeError, OSError):
        return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()


def _stored_status(status: str, finish_reason: str, metadata: dict) -> Status:
    """A stored row's status for scoring: a reward failure is scored again as what was generated,
    where the row kept the loss mask it had (MASK_BEFORE_FAILURE_KEY, samples_of restores it);
    a row of a batch stored before that key existed stays FAILED (its trained tokens are unknown)."""
    if status == Status.FAILED.value and "reward_error" in metadata and MASK_BEFORE_FAILURE_KEY in metadata:
        for key in ("reward_error", "reward_error_type"):
            metadata.pop(key, None)
        return Status.TRUNCATED if finish_reason == "length" else Status.COMPLETED
    return Status(status)


def samples_of(batch: dict[str, list], prompts: dict[str, Any], tokenizer: Any, cfg: Any) -> list[Sample]:
    """The batch's rows as Samples to score (module docstring)."""
    samples = []
    for i, prompt_id in enumerate(batch["prompt_id"]):
        row = prompts.get(prompt_id)
        if row is None:
            raise ValueError(
                f"prompt_id {prompt_id!r} of the stored batch is not in prompt_data={cfg.prompt_data!r}: the run's "
                f"prompts changed since; re-scoring needs the labels it was trained with"
            )
        metadata = json.loads(batch["metadata"][i] or "{}")
        s = Sample(
            prompt_id=prompt_id,
            prompt=row.prompt,
            label=row.label,
            tokens=list(batch["tokens"][i]),
            prompt_length=batch["prompt_length"][i],
            response_length=batch["response_length"][i],
            loss_mask=list(batch["loss_mask"][i]),
            rollout_log_probs=list(batch["rollout_log_probs"][i]),
            finish_reason=batch["finish_reason"][i],
            group_index=batch["group_index"][i],
            index=batch["index"][i],
            session_id=batch["session_id"][i],
            metadata=metadata,
        )
        s.status = _stored_status(batch["status"][i], s.finish_reason, metadata)
        if s.status is not Status.FAILED and MASK_BEFORE_FAILURE_KEY in metadata:  # a reward failure scored again
            s.loss_mask = mask_of_runs(metadata.pop(MASK_BEFORE_FAILURE_KEY))
        s.response = decode_response(tokenizer, s, cfg.rollout_skip_special_tokens, tokenizer.eos_token_id)
        samples.append(s)
    return samples


async def _score(hub: RewardHub, samples: Sequence[Sample]) -> None:
    groups: dict[int, list[Sample]] = {}
    for s in samples:
        groups.setdefault(s.group_index, []).append(s)
    scorable = [[s for s in g if s.status in (Status.COMPLETED, Status.TRUNCATED)] for g in groups.values()]
    await asyncio.gather(*(hub.score_group(g) for g in scorable if g))


def side_table_rows(before: dict[str, list], after: dict[str, list], samples: Sequence[Sample]) -> dict[str, list]:
    """rescored.RESCORED_SCHEMA's columns: the stored values (before) beside the new ones (after)."""
    return {
        "group_index": before["group_index"],
        "index": before["index"],
        "raw_reward_before": before["raw_reward"],
        "raw_reward": after["raw_reward"],
        "reward_before": before["reward"],
        "reward": after["reward"],
        "advantage_before": before["advantage"],
        "advantage": after["advantage"],
        "status_before": before["status"],
        "status": after["status"],
        "loss_mask": after["loss_mask"],
        "reward_error_type": [s.metadata.get("reward_error_type") for s in samples],
    }


def blast_radius(rollout_id: int, rows: dict[str, list], checkpoints: Sequence[tuple[int, str]]) -> dict:
    """What the stored rewards of rollout `rollout_id` reached (module docstring)."""
    n = len(rows["index"])
    changed = [
        i
        for i in range(n)
        if rows["raw_reward"][i] != rows["raw_reward_before"][i] or rows["status"][i] != rows["status_before"][i]
    ]
    groups = sorted({rows["group_index"][i] for i in changed})
    moved = [
        {
            "row": i,
            "group_index": rows["group_index"][i],
            "index": rows["index"][i],
            "advantage_delta": (rows["advantage"][i] or 0.0) - (rows["advantage_before"][i] or 0.0),
        }
        for i in range(n)
        if rows["group_index"][i] in groups and rows["advantage"][i] != rows["advantage_before"][i]
    ]
    return {
        "rollout_id": rollout_id,
        "samples": n,
        "changed": [
            {
                "row": i,
                "group_index": rows["group_index"][i],
                "index": rows["index"][i],
                "raw_reward_before": rows["raw_reward_before"][i],
                "raw_reward": rows["raw_reward"][i],
                "status_before": rows["status_before"][i],
                "status": rows["status"][i],
            }
            for i in changed
        ],
        "groups": groups,
        "advantages_moved": moved,
        "max_abs_advantage_delta": max((abs(m["advantage_delta"]) for m in moved), default=0.0),
        "checkpoints": [path for k, path in checkpoints if k >= rollout_id] if changed else [],
        "weight_versions_from": rollout_id + 2 if changed else None,
    }


def rescore_run(
    storage_uri: str, run: str, custom_rm_path: str, rollout_ids: Optional[Sequence[int]] = None, endpoint=None
) -> dict:
    """Score run `run`'s stored batches (`rollout_ids`, else all) again with `custom_rm_path`, store
    the next rescored version and return {version, lineage, iterations: [blast radius per rollout]}."""
    store = BatchStore(storage_uri, endpoint=endpoint)
    cfg = read_run_config(storage_uri, run, endpoint)
    new_cfg = cfg.model_copy(update={"custom_rm_path": custom_rm_path})
    hub = RewardHub(new_cfg)  # loads the function: a bad path stops here, naming the field
    stored = sorted(ref.rollout_id for ref in store.list_batches(run))
    ids = sorted(rollout_ids) if rollout_ids else stored
    missing = sorted(set(ids) - set(stored))
    if missing:
        raise ValueError(f"--rollout-ids {missing}: run {run!r} has no stored batch for them in {storage_uri}")
    tokenizer = load_tokenizer(cfg)
    prompts = {row.prompt_id: row for row in load_prompt_rows(cfg.prompt_data, cfg, tokenizer, cfg.prompt_data_split)}
    checkpoints = finished_checkpoints(cfg)
    version = rescored.next_version(store.location, run)
    iterations = []
    for k in ids:
        before, lineage = store.read(run, k)
        samples = samples_of(before, prompts, tokenizer, cfg)
        asyncio.run(_score(hub, samples))
        after = build_batch(samples, new_cfg)
        rows = side_table_rows(before, after, sorted(samples, key=lambda s: (s.group_index, s.index)))
        rescored.write_table(store.location, run, version, k, rows, lineage["checksum"])
        iterations.append(blast_radius(k, rows, checkpoints))
    lineage = {
        "run": run,
        "reward_function": custom_rm_path,
        "reward_source_sha256": source_sha256(hub.fn),
        "replaces": cfg.custom_rm_path or cfg.rm_type,
        "group_rm": bool(cfg.group_rm),
        "advantage_estimator": cfg.advantage_estimator,
        "rollout_ids": ids,
        "code_version": code_version(),
        "created_at": dt.datetime.now(dt.timezone.utc).isoformat(),
    }
    rescored.publish(store.location, run, version, lineage)
    return {
        "checkpoints": checkpoints,
        "stored_rollout_ids": stored,
        "version": version,
        "where": store.location.url(rescored.version_key(run, version, "")),
        **lineage,
        "iterations": iterations,
    }


def describe(result: dict) -> list[str]:
    """The blast radius in lines for people (no reward values: `--json` has them)."""
    run, version = result["run"], result["version"]
    lines = [
        f"rescore v{version} of run {run}: {result['replaces']} -> {result['reward_function']} "
        f"(source sha256 {result['reward_source_sha256'][:16]}...), stored at {result['where']}"
    ]
    first = None
    for it in result["iterations"]:
        k, changed = it["rollout_id"], it["changed"]
        if not changed:
            lines.append(f"rollout {k}: no reward changed ({it['samples']} samples)")
            continue
        first = k if first is None else first
        rows = ", ".join(str(c["row"]) for c in changed[:12]) + (" ..." if len(changed) > 12 else "")
        ckpts = ", ".join(p.rsplit("/", 1)[-1] for p in it["checkpoints"]) or "none saved"
        lines.append(
            f"rollout {k}: {len(changed)} of {it['samples']} samples changed reward (rows {rows}); "
            f"{len(it['advantages_moved'])} advantages moved in {len(it['groups'])} groups (max |delta| "
            f"{it['max_abs_advantage_delta']:.4g}); trained into checkpoints {ckpts}; "
            f"weights v{it['weight_versions_from']} on"
        )
    if first is not None:
        before = [(k, path) for k, path in result["checkpoints"] if k < first]
        start = before[-1][1] if before else "<a checkpoint of the run's start>"
        replay = [k for k in result["stored_rollout_ids"] if k > (before[-1][0] if before else -1)]
        lines.append(
            f"retrain: vime replay --run-name {run}-rescored-v{version} --source-run {run} --checkpoint {start} "
            f"--rollout-ids {' '.join(map(str, replay))} --rewards v{version}"
        )
    return lines
