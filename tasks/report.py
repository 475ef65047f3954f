"""report-k: the iteration's record in metrics.jsonl, the console line and the compute ledger's
line, the Prefect artifacts (a metrics table, the ledger, the reward curve, a link to the stored
batch), and W&B / TensorBoard when asked for (vime_core/report/tracking.py)."""

from __future__ import annotations

import base64
import sys

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from tasks.common import TASK_DEFAULTS
from vime_core.config import VimeConfig
from vime_core.ledger import ledger_line, ledger_markdown
from vime_core.step_plan import Phase
from vime_core.report.curve import reward_curve_png, write_reward_curve
from vime_core.report.records import METRICS, append_record, console_line, read_records, run_dir, sparkline
from vime_core.report.tracking import track
from vime_core.storage.endpoint import S3Endpoint


def _artifact_key(run_name: str, what: str) -> str:
    # keys: lowercase letters, digits and dashes only
    safe = "".join(c if c.isalnum() else "-" for c in run_name.lower())
    return f"{safe}-{what}"


# The metrics table holds the latest iterations only: Prefect keeps every version of an artifact,
# so a table of the whole history would store O(N^2) rows over a run of N iterations (all of
# them stay in metrics.jsonl, and in the reward curve).
TABLE_ROWS = 20


@task(name=Phase.REPORT, task_run_name="report-{rollout_id}", retries=2, **TASK_DEFAULTS)
def report_iteration(config: VimeConfig, rollout_id: int, record: dict, draw_curve: bool = True) -> str:
    endpoint = S3Endpoint.of(config)
    append_record(config.storage_uri, config.run_name, record, endpoint)
    records = read_records(config.storage_uri, config.run_name, endpoint)
    line = console_line(record)
    ledger = record.get("ledger")
    lines = [line, ledger_line(rollout_id, ledger)] if ledger else [line]
    for each in lines:
        get_run_logger().info(each)
    # the console lines are for the person running the job, whatever Prefect's log level is
    sys.__stdout__.write("".join(each + "\n" for each in lines))
    sys.__stdout__.flush()
    if ledger:
        create_markdown_artifact(
            key=_artifact_key(config.run_name, "ledger"),
            markdown=ledger_markdown(config.run_name, rollout_id, ledger),
            description=f"compute ledger of rollout {rollout_id}: tokens by where they went, device-seconds by phase",
        )
    create_table_artifact(
        key=_artifact_key(config.run_name, "metrics"),
        table=[{k: v for k, v in r.items() if not isinstance(v, (dict, list))} for r in records[-TABLE_ROWS:]],
        description=(
            f"vime run {config.run_name}: one row per iteration, the latest {TABLE_ROWS} (T_* in "
            f"seconds); every iteration is in {run_dir(config.storage_uri, config.run_name)}/{METRICS}"
        ),
    )
    if draw_curve:
        rewards = [r.get("reward_mean") or 0.0 for r in records]
        png = reward_curve_png(records, f"vime run {config.run_name}")
        path = write_reward_curve(config.storage_uri, config.run_name, png, endpoint)
        picture = f"![reward curve](data:image/png;base64,{base64.b64encode(png).decode()})\n\n`{path}`\n\n"
        create_markdown_artifact(
            key=_artifact_key(config.run_name, "reward-curve"),
            markdown=(
                f"### Reward, run `{config.run_name}`\n\n`{sparkline(rewards)}`\n\n"
                f"latest: rollout {rollout_id}, reward {record.get('reward_mean')}\n\n{picture}"
                f"stored batch: `{record.get('batch_key', '')}`"
            ),
            description="reward mean per iteration",
        )
    # after everything that can fail and retry this task, so no step is sent twice; a tracker that
    # fails is turned off with one warning and the run goes on
    for warning in track(config, record, rollout_id, last=rollout_id == config.num_rollout - 1):
        get_run_logger().warning(warning)
    return line
