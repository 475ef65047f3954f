"""The GPU bench's dense reward (bench/gpu/rewards.py) counts task characters, not fillers."""

from types import SimpleNamespace

from tests.bench_scripts import load_bench

rewards = load_bench("gpu/rewards.py", "gpu_rewards")


def test_alphabet_share_counts_task_characters_per_response_token():
    s = SimpleNamespace(response="<|f12|>3<|f7|>+", response_length=4)
    assert rewards.alphabet_share(s) == 0.5
    assert rewards.alphabet_share(SimpleNamespace(response="<|f1|><|f2|>", response_length=2)) == 0.0
    assert rewards.alphabet_share(SimpleNamespace(response="", response_length=0)) == 0.0
