"""What `vime replay` refuses before it starts anything: a replay under the source run's own name
(its checkpoint would replace the one the source run resumes from) and a rollout id named twice
(trained on twice); and the command `vime rescore` prints passes both."""

from __future__ import annotations

import pytest

from vime_core.cluster.replay_trainers import check_replay_request
from vime_core.config import make_config
from vime_core.rescore import describe


def test_a_replay_under_the_source_runs_name_is_refused():
    with pytest.raises(
        ValueError, match=r"--run-name 'vime-default' is the --source-run: .*--run-name vime-default-replay"
    ):
        check_replay_request(make_config({"run_name": "vime-default"}), "vime-default", [3])


def test_a_rollout_id_named_twice_is_refused():
    with pytest.raises(ValueError, match=r"--rollout-ids names \[3\] more than once"):
        check_replay_request(make_config({"run_name": "replay"}), "vime-default", [3, 1, 3])
    check_replay_request(make_config({"run_name": "replay"}), "vime-default", [1, 3])
    check_replay_request(make_config({"run_name": "replay"}), "vime-default", None)  # a lineage query


def test_the_printed_retrain_command_passes_the_checks():
    run, version = "vime-default", 2
    changed = {"row": 17, "before": 0.0, "after": 1.0}
    result = {
        "run": run,
        "version": version,
        "replaces": "math",
        "reward_function": "my_rewards.py:fixed",
        "reward_source_sha256": "1f0c" * 16,
        "where": "runs/rescored/vime-default/v2/",
        "checkpoints": [(2, "runs/checkpoints/vime-default/rollout_000002")],
        "stored_rollout_ids": [3, 4],
        "iterations": [
            {
                "rollout_id": 3,
                "changed": [changed],
                "samples": 256,
                "advantages_moved": [1, 2],
                "groups": [0],
                "max_abs_advantage_delta": 1.5,
                "checkpoints": [],
                "weight_versions_from": 5,
            }
        ],
    }
    (line,) = [line for line in describe(result) if line.startswith("retrain: ")]
    words = line.split()
    flag = lambda name: words[words.index(name) + 1]  # noqa: E731
    ids = [int(w) for w in words[words.index("--rollout-ids") + 1 : words.index("--rewards")]]
    assert flag("--source-run") == run and flag("--rewards") == f"v{version}" and ids == [3, 4]
    check_replay_request(make_config({"run_name": flag("--run-name")}), flag("--source-run"), ids)
