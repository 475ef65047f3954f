"""The import contract: `flows -> tasks -> vime_core`, and no import cycles inside `vime_core`,
between its modules or between its packages.

docs/architecture.md ("Layers") states the rules; this test is what enforces them. The import
graph is read from the source (the AST), not by importing anything, so it runs in milliseconds
and sees every import: module level, inside functions (a lazy import is still a dependency, and
is how several cycles used to hide), in `try` blocks and under `if TYPE_CHECKING:` (a type-only
import still couples the two modules; import-linter counts them too).

A module's edge goes to the module it names: `from vime_core.storage import layout` is an edge
to `vime_core.storage.layout` (a submodule), `from vime_core.storage import BatchStore` one to
`vime_core.storage` (the package's `__init__`). Parent packages that Python initialises on the
way are not counted as edges, as in import-linter.

Run it as a script to print the graph's cycles: `python tests/unit/test_import_contract.py`.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("flows", "tasks", "vime_core")

# --- reading the graph --------------------------------------------------------------------------


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(tree: ast.AST):
    """Every Import/ImportFrom node, at any depth."""
    return (node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom)))


def _resolve(name: str, modules: set[str]) -> str | None:
    """The longest known module that `name` is or lies inside (None for third-party names)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph(packages=PACKAGES) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(edges between the project's modules, third-party top-level names each module imports)."""
    files = {_module_name(p): p for pkg in packages for p in (REPO / pkg).rglob("*.py")}
    modules = set(files)
    edges: dict[str, set[str]] = {m: set() for m in modules}
    external: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in files.items():
        is_pkg = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in _imports(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:  # relative: from the module's package, `level` steps up
                    pkg = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    pkg = pkg[: len(pkg) - node.level + 1]
                    base = ".".join(pkg + ([base] if base else []))
                # `from pkg import name` names a submodule when one exists, else the package
                targets = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names
                ]
            for target in targets:
                found = _resolve(target, modules)
                if found is None:
                    external[mod].add(target.split(".")[0])
                elif found != mod:
                    edges[mod].add(found)
    return edges, external


def cycles(edges: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[frozenset[str]] = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(frozenset(component))
    return sorted(found, key=sorted)


def _layer(module: str) -> str:
    return module.split(".")[0]


# --- the contract -------------------------------------------------------------------------------

EDGES, EXTERNAL = import_graph()


def _violations(source_layer: str, forbidden: set[str]) -> list[str]:
    bad = []
    for mod in sorted(m for m in EDGES if _layer(m) == source_layer):
        bad += [f"{mod} -> {t}" for t in sorted(EDGES[mod]) if _layer(t) in forbidden]
        bad += [f"{mod} -> {t}" for t in sorted(EXTERNAL[mod]) if t in forbidden]
    return bad


def test_graph_is_read():
    # guards the reader itself: a few edges known to exist
    assert "vime_core.algo.registry" in EDGES["vime_core.algo.advantages"]
    assert "vime_core.config.schema" in EDGES["vime_core.config.loader"]
    assert any(_layer(t) == "tasks" for t in EDGES["flows.iteration"])
    assert "prefect" in EXTERNAL["tasks.train"]


def test_vime_core_imports_neither_flows_tasks_nor_prefect():
    assert _violations("vime_core", {"flows", "tasks", "prefect"}) == []


def test_tasks_import_no_flows():
    assert _violations("tasks", {"flows"}) == []


# "Pure math stays free of Ray, HTTP and Prefect" (docs/architecture.md, the import contract): these modules, and every
# module they import, directly or not, stay inside algo/ and data/ and import none of LIBRARIES.
MATH = ("vime_core.algo", "vime_core.data.batch", "vime_core.data.schedule")
ACTOR_AND_NETWORK_LIBRARIES = {"ray", "prefect", "httpx", "aiohttp", "requests", "urllib3", "fastapi", "uvicorn"}


def _reachable(module: str) -> set[str]:
    seen, todo = {module}, [module]
    while todo:
        for target in EDGES[todo.pop()]:
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def test_math_knows_nothing_of_actors_http_or_prefect():
    roots = [m for m in EDGES if any(m == r or m.startswith(r + ".") for r in MATH)]
    assert "vime_core.algo.losses" in roots and "vime_core.data.schedule" in roots
    bad = []
    for root in sorted(roots):
        for mod in sorted(_reachable(root)):
            if not mod.startswith(("vime_core.algo", "vime_core.data.")):
                bad.append(f"{root} reaches {mod}")
            bad += [
                f"{root} reaches {mod}, which imports {lib}"
                for lib in sorted(EXTERNAL[mod] & ACTOR_AND_NETWORK_LIBRARIES)
            ]
    assert bad == []


def test_no_import_cycles():
    found = [sorted(c) for c in cycles(EDGES)]
    assert found == [], "import cycles (break them; see docs/architecture.md):\n" + "\n".join(map(str, found))


# --- package-level cycles inside vime_core ------------------------------------------------------
# A node is one package directly under vime_core (config, cluster, engines, ...), or a module
# directly under it (faults, run_assets, step_plan). Package A depends on B when any module of
# A imports any module of B, at any depth (the same edges as above), so two packages that each
# use a little of the other are a cycle even when no two modules are.


def package_of(module: str) -> str | None:
    """The node of a vime_core module in the package graph (None outside vime_core or for
    vime_core's own __init__)."""
    parts = module.split(".")
    return parts[1] if parts[0] == "vime_core" and len(parts) > 1 else None


def package_graph(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for mod, targets in edges.items():
        source = package_of(mod)
        if source is None:
            continue
        graph.setdefault(source, set())
        for target in targets:
            node = package_of(target)
            if node is not None and node != source:
                graph[source].add(node)
                graph.setdefault(node, set())
    return graph


def test_package_graph_is_read():
    graph = package_graph(EDGES)
    assert {"config", "engines", "weight_sync", "faults", "step_plan", "utils"} <= set(graph)
    assert "config" in graph["cluster"] and "utils" in graph["faults"]


def test_no_package_level_cycles_in_vime_core():
    found = [sorted(c) for c in cycles(package_graph(EDGES))]
    assert found == [], (
        "package-level import cycles in vime_core (move what both need to the package it "
        "belongs to or a leaf; see docs/architecture.md):\n" + "\n".join(map(str, found))
    )


def test_package_cycles_are_found_through_lazy_imports():
    edges = {
        "vime_core.a.x": {"vime_core.b.y"},
        "vime_core.b.y": set(),
        "vime_core.b.z": {"vime_core.a"},
        "vime_core.a": set(),
        "vime_core.faults": {"vime_core.a.x"},
    }
    assert package_graph(edges) == {"a": {"b"}, "b": {"a"}, "faults": {"a"}}
    assert cycles(package_graph(edges)) == [frozenset({"a", "b"})]


def test_cycle_finder_sees_lazy_imports(tmp_path, monkeypatch):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import f\n")
    (pkg / "b.py").write_text("def f():\n    from pkg import a\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n")
    (pkg / "d.py").write_text("from . import c\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    edges, _ = import_graph(("pkg",))
    assert edges["pkg.c"] == {"pkg.a"}  # type-only imports count
    assert edges["pkg.d"] == {"pkg.c"}
    assert cycles(edges) == [frozenset({"pkg.a", "pkg.b"})]


if __name__ == "__main__":
    for component in cycles(EDGES):
        print(" ".join(sorted(component)))
    for component in cycles(package_graph(EDGES)):
        print("packages:", " ".join(sorted(component)))
