"""Session-wide fixtures shared by every test folder.

Folder-specific fixtures (servers, clusters) live in the conftest.py of their folder.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("VIME_TEST_CACHE", REPO / ".cache" / "tests"))

# No hub on these machines: make every accidental download fail fast.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Prefect's temporary server can take more than its default 20 s to start on a loaded 2-core box.
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
