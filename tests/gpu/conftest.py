"""GPU checks: pass/fail runs on real GPUs, which CI's CPU machines cannot do.

Every test here is marked `gpu` (`@pytest.mark.gpu(gpus=N)`, N = 1 by default) and skips with
the reason where torch sees fewer than N CUDA devices (tests/conftest.py), so on CPU the folder
collects and reports its skips. This folder gives no tier: each module names its own
(`integration` or `e2e`). On a GPU host, with the host's bundle of pinned wheels installed
(`$PARTS/install_bundle.sh`, which bench/gpu/run_colocated_h200.sh runs; see docs/measurements.md):

    python3 -m pytest tests/gpu -q -rs
"""
