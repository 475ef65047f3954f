"""The GPU bench's dense reward (bench/gpu/rewards.py) counts task characters, not fillers."""

import importlib.util
from pathlib import Path
from types import SimpleNamespace

spec = importlib.util.spec_from_file_location(
    "gpu_rewards", Path(__file__).resolve().parents[2] / "bench/gpu/rewards.py"
)
rewards = importlib.util.module_from_spec(spec)
spec.loader.exec_module(rewards)


def test_alphabet_share_counts_task_characters_per_response_token():
    s = SimpleNamespace(response="<|f12|>3<|f7|>+", response_length=4)
    assert rewards.alphabet_share(s) == 0.5
    assert rewards.alphabet_share(SimpleNamespace(response="<|f1|><|f2|>", response_length=2)) == 0.0
    assert rewards.alphabet_share(SimpleNamespace(response="", response_length=0)) == 0.0
