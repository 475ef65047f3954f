"""Library warnings a vime user cannot act on, kept off the console: Megatron's warnings about absent
Apex / Transformer Engine and arguments it fills in (from Megatron's modules only), and Ray daemons'
lines about the metrics exporter a local head without the dashboard does not run."""

from __future__ import annotations

import re
import warnings
from typing import Callable, Optional

MEGATRON_NOISE = (
    r"(Transformer Engine|Apex)( and Apex)? (is|are) not installed",
    r"full scope is deprecated",
    r"MLP requires ffn_hidden_size",
    r"(Warning: )?tp_group is None",
    r"The following imports from `dynamic_context.py` will be removed",
    r"The 'megatron.core.transformer.custom_layers.transformer_engine'",
)


def quiet_library_warnings() -> None:
    """Install the filters (idempotent: warnings.filterwarnings drops an identical filter)."""
    for message in MEGATRON_NOISE:
        warnings.filterwarnings("ignore", message=message, module=r"megatron(\..*)?$")


# Lines Ray's own daemons log at ERROR and the driver prints, about an optional part that a
# local head started without the dashboard does not run (metrics/event export).
RAY_DAEMON_NOISE = re.compile(r"Failed to establish connection to the (event\+)?metrics exporter agent")
RAY_DAEMONS = ("gcs_server", "raylet")


def drop_ray_daemon_noise(data: dict) -> Optional[dict]:
    """One batch of log lines Ray streams to the driver, without RAY_DAEMON_NOISE lines from
    Ray's daemons; None when nothing is left."""
    if data.get("pid") not in RAY_DAEMONS:  # Ray tags its daemons' lines with their name as pid
        return data
    lines = [line for line in data.get("lines", []) if not RAY_DAEMON_NOISE.search(line)]
    return {**data, "lines": lines} if lines else None


def quiet_ray_daemons() -> bool:
    """Wrap the driver's handler of streamed logs (Ray installs it in ray.init with
    log_to_driver) with `drop_ray_daemon_noise`; False when Ray has no such handler (then
    nothing changes). Idempotent."""
    try:
        # boundary: vime_core.trainer imports this module without Ray; a private module a release may lack
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher
    except ImportError:
        return False
    with dispatcher._lock:
        for i, (name, handler) in enumerate(dispatcher.handlers):
            if name == "ray_print_logs" and not getattr(handler, "vime_quiet", False):

                def quiet(data: dict, _print: Callable = handler) -> None:
                    kept = drop_ray_daemon_noise(data)
                    if kept is not None:
                        _print(kept)

                quiet.vime_quiet = True  # type: ignore[attr-defined]
                dispatcher.handlers[i] = (name, quiet)
        return any(name == "ray_print_logs" for name, _ in dispatcher.handlers)
