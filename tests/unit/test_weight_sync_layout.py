"""Where weight sync's two ends may reach (vime_core/weight_sync/__init__.py).

The receivers (`vime_core/engines/vllm_side/`) run inside vLLM's worker, whose environment has
neither Megatron nor Prefect nor the trainer's other packages: they and the wire formats they
share with the trainer (`vime_core/wire/`) import only the standard library, torch, vllm, each
other and the phase timer (`vime_core/utils/timing.py`, itself standard library only). The format
modules are also read by the configuration (backend names), so they do not load torch when
imported. And weight_sync never reaches back into the Megatron trainer, which calls it.
Read from the source (AST), nothing imported.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RECEIVERS = REPO / "vime_core" / "engines" / "vllm_side"
WIRE = REPO / "vime_core" / "wire"
# packages Python initialises on the way to a receiver or a wire module
ON_THE_WAY = [
    REPO / "vime_core" / "__init__.py",
    REPO / "vime_core" / "engines" / "__init__.py",
    REPO / "vime_core" / "utils" / "__init__.py",
]
# the phase timer the receivers time their buckets with
TIMER = REPO / "vime_core" / "utils" / "timing.py"
ENGINE_SIDE_THIRD_PARTY = {"torch", "vllm", "numpy"}  # numpy: a dependency of both


def _imported(tree: ast.AST) -> set[str]:
    """Every module named by an import anywhere in `tree` (absolute imports only: the project
    uses no relative ones)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def _imported_at_import_time(tree: ast.Module) -> set[str]:
    """The modules a module imports when it is imported: module-level statements (and `try`
    blocks), not function bodies, not `if TYPE_CHECKING:`."""
    names: set[str] = set()
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Try):
            todo += node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body]
        elif isinstance(node, ast.If) and not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
            todo += node.body + node.orelse
    return names


def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def test_the_engine_end_imports_only_stdlib_torch_vllm_and_the_wire_formats():
    allowed_vime = ("vime_core.engines.vllm_side", "vime_core.wire", "vime_core.utils.timing")
    bad = []
    for path in sorted(RECEIVERS.glob("*.py")) + sorted(WIRE.glob("*.py")) + ON_THE_WAY + [TIMER]:
        for name in sorted(_imported(_parse(path))):
            top = name.split(".")[0]
            if top == "vime_core":
                ok = name.startswith(allowed_vime)
            else:
                ok = top in sys.stdlib_module_names or top in ENGINE_SIDE_THIRD_PARTY or top == "__future__"
            if not ok:
                bad.append(f"{path.relative_to(REPO)} imports {name}")
    assert bad == [], "the vLLM worker's environment has none of these:\n" + "\n".join(bad)


def test_the_wire_formats_load_no_torch_when_imported():
    # vime_core/config/derive.py reads the backend names from them while a configuration is made
    formats = [p for p in sorted(WIRE.glob("*.py")) if p.name != "broadcast_group.py"]
    heavy = {
        p.name: sorted(n for n in _imported_at_import_time(_parse(p)) if n.split(".")[0] in ENGINE_SIDE_THIRD_PARTY)
        for p in formats
    }
    assert {k: v for k, v in heavy.items() if v} == {}


def test_weight_sync_does_not_import_the_megatron_trainer():
    bad = [
        f"{p.relative_to(REPO)} imports {n}"
        for p in sorted((REPO / "vime_core" / "weight_sync").rglob("*.py"))
        for n in sorted(_imported(_parse(p)))
        if n == "vime_core.trainer" or n.startswith("vime_core.trainer.")
    ]
    assert bad == []


def test_every_rpc_the_trainer_calls_is_a_method_of_the_worker_extension():
    from vime_core.wire.broadcast_format import GROUP_ID_RPC
    from vime_core.wire.ipc_format import DEVICE_UUID_RPC
    from vime_core.wire.spec_format import SPEC_RPC

    tree = _parse(RECEIVERS / "worker_ext.py")
    (extension,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "VimeWorkerExtension"]
    methods = {n.name for n in extension.body if isinstance(n, ast.FunctionDef)}
    assert {SPEC_RPC, DEVICE_UUID_RPC, GROUP_ID_RPC} <= methods
