"""Configuration: the fields (schema.py, a leaf), `VimeConfig` (loader.py: the fields resolved,
derived and checked whenever one is made), the derivations (derive.py, optimizer.py), and loading
from CLI / files."""

from vime_core.config.derive import (
    dp_size,
    engine_server_args,
    needs_rollout_logprobs,
    num_engines,
    rollout_concurrency,
    rollout_logprob_readers,
    weight_transport,
)
from vime_core.config.loader import ConfigError, VimeConfig, config_hash, load_config, make_config, parse_args

__all__ = [
    "VimeConfig",
    "ConfigError",
    "load_config",
    "make_config",
    "parse_args",
    "config_hash",
    "dp_size",
    "num_engines",
    "rollout_concurrency",
    "engine_server_args",
    "weight_transport",
    "needs_rollout_logprobs",
    "rollout_logprob_readers",
]
