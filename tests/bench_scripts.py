"""The benchmarks' scripts as modules, for the tests: bench/ is not a package (its scripts run on the
GPU host as files and put bench/ on sys.path themselves), so each is loaded from its file."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load_bench(relpath: str, name: str) -> ModuleType:
    """bench/<relpath> as the module `name`, registered in sys.modules (a dataclass looks its
    module up there)."""
    spec = importlib.util.spec_from_file_location(name, BENCH / relpath)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
