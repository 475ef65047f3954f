"""Device memory seen from outside a process, through `nvidia-smi`, because an actor that opened a CUDA
context to ask would itself hold device memory: `process_bytes` of a process group and its
descendants (None where the container's nvidia-smi lists no pids) and each device's `memory.used`."""

from __future__ import annotations

import shutil
import subprocess
from typing import Any, Optional

from vime_core.utils.processes import group_tree

MIB = 2**20


def _query(args: list[str]) -> list[list[str]]:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        out = subprocess.run([exe, *args, "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return []
    if out.returncode != 0:
        return []
    return [[c.strip() for c in line.split(",")] for line in out.stdout.splitlines() if line.strip()]


def group_device_memory(pgid: int, device_ids: Optional[list[str]] = None) -> dict[str, Any]:
    """{"process_bytes": int | None, "device_used_bytes": {device id: bytes}} (module docstring)."""
    devices = {index: total - free for index, (free, total) in free_and_total(device_ids).items()}
    return {"process_bytes": processes_bytes(set(group_tree(pgid))), "device_used_bytes": devices}


def processes_bytes(pids: set[int]) -> Optional[int]:
    """Device memory nvidia-smi attributes to `pids` (all devices), in bytes; None when it lists
    none of them (no nvidia-smi, no GPU use yet, or a container that hides pids)."""
    apps = _query(["--query-compute-apps=pid,used_memory"])
    own = [int(float(mib)) * MIB for pid, mib in apps if pid.isdigit() and int(pid) in pids]
    return sum(own) if own else None


def free_and_total(device_ids: Optional[list[str]] = None) -> dict[str, tuple[int, int]]:
    """{device index: (free bytes, total bytes)} as nvidia-smi reports them; {} without it."""
    out = {}
    for index, total, used in _query(["--query-gpu=index,memory.total,memory.used"]):
        if device_ids is None or index in device_ids:
            total_b, used_b = int(float(total)) * MIB, int(float(used)) * MIB
            out[index] = (total_b - used_b, total_b)
    return out
