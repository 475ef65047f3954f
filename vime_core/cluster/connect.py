"""Connecting a driver (a flow run, the CLI, a test) to the Ray cluster of a run."""

from __future__ import annotations

import logging
import os

from vime_core.utils.quiet import quiet_ray_daemons

log = logging.getLogger(__name__)

# Ray picks a non-loopback address unless this is set in the head and in every driver
# (--node-ip-address=127.0.0.1 alone is replaced by another address).
LOOPBACK_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    # Ray 2.60 turns token auth on for `ray start` and drivers as soon as ~/.ray/auth_token exists
    # (any bare `ray.init()` on the machine writes one); a head and a driver that disagree then
    # refuse each other ("InvalidAuthToken"). The local head binds only 127.0.0.1: auth off,
    # unless the user set RAY_AUTH_MODE.
    "RAY_AUTH_MODE": "disabled",
}
DRIVER_NAMESPACE = "vime"


def actor_env() -> dict[str, str]:
    """Environment every vime actor runs with: offline hub, quiet tokenizers, and the
    repository on the path so `vime_core` imports even where the package is not installed."""
    from pathlib import Path

    repo = str(Path(__file__).resolve().parents[2])
    env = {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": os.pathsep.join(p for p in [repo, os.environ.get("PYTHONPATH", "")] if p),
        # as the driver has them (ensure_ray: setdefault), so a user's RAY_AUTH_MODE reaches actors too
        **{k: os.environ.get(k, v) for k, v in LOOPBACK_ENV.items()},
    }
    return env


def ensure_ray(address: str = "auto"):
    """Attach to the cluster at `address` (idempotent). `auto` means the running local head."""
    for k, v in LOOPBACK_ENV.items():
        os.environ.setdefault(k, v)
    import ray

    if ray.is_initialized():
        return ray
    try:
        ray.init(
            address=address,
            # named placement groups live in the driver's namespace: one fixed namespace lets
            # every flow run find a run's group (actors carry their run's own namespace)
            namespace=DRIVER_NAMESPACE,
            log_to_driver=True,
            logging_level=logging.WARNING,
            runtime_env={"env_vars": actor_env()},
        )
    except ConnectionError as exc:
        raise RuntimeError(
            f"no Ray cluster at address {address!r}: start one with `vime cluster up` "
            f"(or infra/ray_head.sh start) or pass --ray-address ({exc})"
        ) from None
    quiet_ray_daemons()
    return ray
