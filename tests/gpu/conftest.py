"""GPU checks: pass/fail runs on real GPUs, which CI's CPU machines cannot do. Every test is marked
`gpu(gpus=N)` and skips where torch sees fewer devices, and names its own tier. On a GPU host with
its wheel bundle installed (docs/measurements.md): `python3 -m pytest tests/gpu -q -rs`."""
