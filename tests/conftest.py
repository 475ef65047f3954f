"""Session-wide fixtures shared by every test folder, and the test tiers (docs/testing.md): every test
has exactly one of unit, integration, e2e, from its folder unless its module or itself names one; a
test with none or two stops the run. `gpu(gpus=N)` skips, with the reason, where torch sees fewer."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("VIME_TEST_CACHE", REPO / ".cache" / "tests"))

# No hub on these machines: make every accidental download fail fast.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Prefect's temporary server can take more than its default 20 s to start on a loaded machine.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
# Ray reads these when it is imported, and any test may import it first: set them before any
# test module loads, or a driver looks for the loopback head at another address and hangs
# (seen when tests/unit ran before tests/integration/flows).
from vime_core.cluster.connect import LOOPBACK_ENV  # noqa: E402

for _key, _value in LOOPBACK_ENV.items():
    os.environ.setdefault(_key, _value)
# The flow tests run flows in this process, as `vime` does: the same Prefect server defaults.
from flows.settings import apply_env_defaults  # noqa: E402

apply_env_defaults()


TIERS = ("unit", "integration", "e2e")
FOLDER_TIERS = {"unit": "unit", "integration": "integration", "e2e": "e2e"}  # tests/<folder>/...


def _tier_problem(item) -> str | None:
    """Give `item` its folder's tier when nothing closer names one; say what is wrong otherwise."""
    named = sorted({mark.name for mark in item.iter_markers() if mark.name in TIERS})
    if len(named) > 1:
        return f"{item.nodeid}: two tiers ({', '.join(named)}); keep one"
    if named:
        return None
    parts = Path(item.path).resolve().relative_to(REPO / "tests").parts
    tier = FOLDER_TIERS.get(parts[0]) if len(parts) > 1 else None
    if tier is None:
        return (
            f"{item.nodeid}: no tier: tests/{parts[0]}/ gives none; add `pytestmark = pytest.mark.<tier>` "
            f"({' | '.join(TIERS)}) to the module"
        )
    item.add_marker(tier)
    return None


@functools.cache
def cuda_devices() -> tuple[int, str]:
    """(CUDA devices torch sees, why there are none)."""
    try:
        import torch
    except ImportError as exc:
        return 0, f"torch does not import ({exc})"
    if not torch.cuda.is_available():
        return 0, f"torch.cuda.is_available() is False (torch {torch.__version__})"
    return torch.cuda.device_count(), ""


@pytest.hookimpl(tryfirst=True)  # before `-m` selects: the folder's tier must be on the test by then
def pytest_collection_modifyitems(config, items):
    problems = [p for p in map(_tier_problem, items) if p]
    if problems:
        raise pytest.UsageError(
            "every test needs exactly one tier (tests/conftest.py, docs/testing.md):\n  " + "\n  ".join(problems)
        )
    for item in items:
        marker = item.get_closest_marker("gpu")
        if marker is None:
            continue
        need = marker.kwargs.get("gpus", 1)
        have, why = cuda_devices()
        if have < need:
            item.add_marker(
                pytest.mark.skip(reason=f"needs {need} CUDA device(s), found {have}" + (f": {why}" if why else ""))
            )


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def cache_dir() -> Path:
    CACHE.mkdir(parents=True, exist_ok=True)
    return CACHE


@pytest.fixture(scope="session")
def tiny_model_dir(cache_dir) -> Path:
    """The default tiny Qwen3-style checkpoint (built once, reused across sessions)."""
    from vime_core.demo.model import build_tiny_model

    return build_tiny_model(cache_dir / "models" / "tiny-qwen3", family="qwen3", seed=0)


@pytest.fixture(scope="session")
def vllm_python(repo_root) -> str:
    py = repo_root / ".venv-vllm" / "bin" / "python"
    if not py.exists():
        pytest.fail(f"{py} is missing: run infra/setup_env.sh (the README's test command does)")
    return str(py)
