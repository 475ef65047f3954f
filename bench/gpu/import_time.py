"""Where an engine's or trainer's imports spend their seconds on this host: each module set imported
in a fresh interpreter with `python -X importtime`, --repeats times in a row (the first on a fresh
host also writes the bytecode caches, the bundle ships none), then one JSON of the wall seconds per
try and the slowest top-level packages by cumulative import time.

    python3 bench/gpu/import_time.py --out $OUT/import_time.json
    python3 bench/gpu/import_time.py --sets engine_core --repeats 3 --out /tmp/it.json

Sets (the interpreter and PYTHONPATH each process of a colocated run has, infra/gpu-host/vllm_python.sh):
    api_server   what `vllm serve`'s front end imports before it starts the engine core
    engine_core  what the engine core's spawned process imports before it logs `Initializing`
    trainer      vime's trainer actor (Megatron, torch) on the trainer's site"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = REPO / "infra" / "gpu-host" / "vllm_python.sh"
SETS = {
    "api_server": (["bash", str(VLLM_PYTHON)], "vllm.entrypoints.openai.api_server"),
    "engine_core": (["bash", str(VLLM_PYTHON)], "vllm.v1.engine.core"),
    "trainer": ([sys.executable], "vime_core.trainer.trainer"),
}
LINE = re.compile(r"^import time:\s+(\d+)\s+\|\s+(\d+)\s+\|(\s*)(\S+)")


def parse_importtime(stderr: str) -> list[tuple[int, str, float, float]]:
    """(depth, module, self s, cumulative s) per `-X importtime` line
    (`import time: self_us | cumulative_us | <two spaces a level>module`)."""
    rows = []
    for line in stderr.splitlines():
        m = LINE.match(line)
        if m:
            depth = (len(m.group(3)) - 1) // 2
            rows.append((depth, m.group(4), int(m.group(1)) / 1e6, int(m.group(2)) / 1e6))
    return rows


def slowest(rows: list[tuple[int, str, float, float]], n: int = 15) -> dict:
    """The heaviest modules: by cumulative seconds among the first three levels (what pulls the time
    in), and by their own seconds at any level (where it is spent)."""
    shallow = sorted((r for r in rows if r[0] <= 3), key=lambda r: -r[3])[:n]
    own = sorted(rows, key=lambda r: -r[2])[:n]
    return {
        "cumulative": {f"{'.' * d}{name}": round(cum, 2) for d, name, _, cum in shallow},
        "self": {name: round(own_s, 2) for _, name, own_s, _ in own},
        "total_s": round(sum(r[3] for r in rows if r[0] == 0), 2),
    }


def time_import(command: list[str], module: str, env: dict) -> dict:
    t0 = time.monotonic()
    proc = subprocess.run(
        [*command, "-X", "importtime", "-c", f"import {module}"], env=env, capture_output=True, text=True
    )
    wall = time.monotonic() - t0
    tail = [line for line in proc.stderr.splitlines() if not line.startswith("import time:")][-5:]
    return {
        "exit": proc.returncode,
        "wall_s": round(wall, 2),
        "imports": slowest(parse_importtime(proc.stderr)),
        **({"error_tail": tail} if proc.returncode else {}),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sets", default=",".join(SETS))
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    env = dict(os.environ)
    env.setdefault("PYTHONPATH", f"/tmp/site-trainer:{REPO}")
    result: dict = {"sets": {}}
    for name in a.sets.split(","):
        command, module = SETS[name]
        tries = [time_import(command, module, env) for _ in range(a.repeats)]
        result["sets"][name] = {"module": module, "tries": tries, "wall_s": [t["wall_s"] for t in tries]}
        print(f"[import_time] {name}: {[t['wall_s'] for t in tries]} s", flush=True)
    Path(a.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v["wall_s"] for k, v in result["sets"].items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
