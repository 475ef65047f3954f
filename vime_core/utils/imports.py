"""Loading user hooks given as paths: `package.module:function` or `path/to/file.py:function`.

Every path-loaded hook (reward functions, filters, rollout/generate functions) goes through
`load_function`, so a wrong path fails once, at start, with a message naming the path and, when
given, the configuration field it came from.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Callable, Optional


class HookLoadError(ValueError):
    """A hook path that does not resolve to a callable; the message names the path."""


def load_function(path: str, field: Optional[str] = None) -> Callable:
    """Import `module:attr` (attr may be dotted, e.g. `mod:Class.method`) and return it.

    `module` may be a dotted module name or a `.py` file path.
    """
    where = f"{field}={path!r}" if field else repr(path)
    if not isinstance(path, str) or path.count(":") != 1:
        raise HookLoadError(f"{where}: expected 'package.module:function' (exactly one ':')")
    module_name, attr_path = (part.strip() for part in path.split(":"))
    if not module_name or not attr_path:
        raise HookLoadError(f"{where}: expected 'package.module:function' (module and function both non-empty)")
    module = _import_module(module_name, where)
    obj: object = module
    for attr in attr_path.split("."):
        try:
            obj = getattr(obj, attr)
        except AttributeError:
            raise HookLoadError(f"{where}: module {module_name!r} has no attribute {attr_path!r}") from None
    if not callable(obj):
        raise HookLoadError(f"{where}: {attr_path!r} in {module_name!r} is a {type(obj).__name__}, not a callable")
    return obj  # type: ignore[return-value]


def _import_module(module_name: str, where: str):
    if module_name.endswith(".py"):
        file = Path(module_name)
        if not file.is_file():
            raise HookLoadError(f"{where}: file {module_name!r} does not exist")
        name = f"vime_hook_{file.stem}_{abs(hash(str(file.resolve())))}"
        if name in sys.modules:
            return sys.modules[name]
        spec = importlib.util.spec_from_file_location(name, file)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            del sys.modules[name]
            raise HookLoadError(f"{where}: importing {module_name!r} failed: {type(exc).__name__}: {exc}") from exc
        return module
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise HookLoadError(f"{where}: module {module_name!r} not found ({exc})") from exc
    except Exception as exc:
        raise HookLoadError(f"{where}: importing {module_name!r} failed: {type(exc).__name__}: {exc}") from exc
