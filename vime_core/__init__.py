"""vime core library: configuration, samples and batches, RL math, rollout, trainer, cluster, storage.

Never imports prefect. Heavy imports (torch, ray, megatron, pyarrow) are deferred to the modules
that need them so that `vime --help` and configuration parsing stay instant.
"""

__version__ = "0.1.0"
