"""The rollout loop: per-sample generation, the async rollout function, eval, the RolloutManager."""
