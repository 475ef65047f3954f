"""Running the check scripts of this folder from the repository root."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_script(args: list[str], env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """A check script from the repository root, with the repository on PYTHONPATH; its output
    is printed (pytest shows it for a failed test)."""
    path = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    proc = subprocess.run(
        args,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": path, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    sys.stdout.write(proc.stdout[-20000:])
    sys.stderr.write(proc.stderr[-20000:])
    return proc
