"""Per-iteration records of a run: the console line, metrics.jsonl, the reward curve, the summary."""
