"""How many iterations a call of `seconds` can run: prints min(total, done + (seconds - setup) // T_step),
T_step being the run's median so far (bench/gpu/run_colocated_h200.sh splits a long run over calls).

    python bench/gpu/next_target.py --storage-uri S --run-name R --seconds 480 --setup 60 --total 20
"""

import argparse
import json
import statistics
from pathlib import Path

p = argparse.ArgumentParser(description=__doc__)
p.add_argument("--storage-uri", required=True)
p.add_argument("--run-name", required=True)
p.add_argument("--seconds", type=float, required=True)
p.add_argument("--setup", type=float, default=60.0)
p.add_argument("--total", type=int, required=True)
a = p.parse_args()
path = Path(a.storage_uri, "reports", a.run_name, "metrics.jsonl")
records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
if not records:
    raise SystemExit("no iteration recorded yet")
done = max(r["rollout_id"] for r in records) + 1
t_step = statistics.median(r["t_step"] for r in records[1:] or records)
print(min(a.total, done + max(0, int((a.seconds - a.setup) // t_step))))
