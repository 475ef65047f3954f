"""Imports sit at the top of the file, so its header shows what it depends on.

An import inside a function is allowed only where an environment boundary needs it: a module that
the vLLM engine process or the Prefect driver imports at start must not pull torch or megatron, the
trainer's environment never imports vllm, and a heavy optional dependency (wandb, duckdb, ...) is
imported only when used. Such an import carries a comment on its line or the line above that names
the boundary (one of BOUNDARY_WORDS).

The test reads the source (the AST), imports nothing. It covers the folders in GUARDED; run it as a
script to print the counts of imports inside functions, overall and in those folders:
`python tests/unit/test_import_placement.py [-v]`.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
INTERNAL = ("vime_core", "tasks", "flows")
SCANNED = (*INTERNAL, "bench")

# Folders (or files) whose in-function imports must each name their boundary.
GUARDED = (
    "vime_core/trainer",
    "vime_core/algo",
    "vime_core/data",
    "vime_core/rewards",
    "vime_core/report",
    "vime_core/storage",
    "vime_core/config",
    "vime_core/models",
    "vime_core/demo",
    "vime_core/utils",
    "vime_core/wire",
    "vime_core/engines/vllm_side",
    "bench",
)
NOT_GUARDED = ("vime_core/trainer/trainer.py",)

# A boundary comment says which process or dependency keeps the import inside the function.
BOUNDARY_WORDS = ("boundary:",)


def _is_guarded(rel: str) -> bool:
    if rel in NOT_GUARDED:
        return False
    return any(rel == g or rel.startswith(g + "/") for g in GUARDED)


def _top_name(node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name.split(".")[0] for alias in node.names]
    if node.level:
        return ["."]  # relative: internal
    return [(node.module or "").split(".")[0]]


def in_function_imports(path: Path) -> list[tuple[int, str, bool, bool]]:
    """(line, text, internal, explained) for every import nested inside a function of the file;
    explained: a boundary comment sits on one of the lines of its run of consecutive imports, or
    on the comment lines just above the run."""
    source = path.read_text()
    tree = ast.parse(source, filename=str(path))
    lines = source.splitlines()
    found: list[tuple[int, str, bool, bool]] = []

    def record(run: list[ast.stmt]) -> None:
        explained = _has_boundary_comment(lines, run[0].lineno, run[-1].end_lineno or run[-1].lineno)
        for node in run:
            internal = all(n == "." or n in INTERNAL for n in _top_name(node))
            found.append((node.lineno, lines[node.lineno - 1].strip(), internal, explained))

    def visit(node: ast.AST, in_function: bool) -> None:
        run: list[ast.stmt] = []
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)) and in_function:
                run.append(child)
                continue
            if run:
                record(run)
                run = []
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            visit(child, nested)
        if run:
            record(run)

    visit(tree, False)
    return sorted(found)


def _has_boundary_comment(lines: list[str], first: int, last: int) -> bool:
    """Lines first..last (1-based) or the comment lines just above them name a boundary."""
    candidates = lines[first - 1 : last]
    i = first - 2
    while i >= 0 and lines[i].strip().startswith("#"):
        candidates.append(lines[i])
        i -= 1
    return any(word in text for text in candidates for word in BOUNDARY_WORDS)


def scan() -> dict[str, list[tuple[int, str, bool]]]:
    """Every scanned file (repository-relative path) with its in-function imports."""
    out = {}
    for pkg in SCANNED:
        for path in sorted((REPO / pkg).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            hits = in_function_imports(path)
            if hits:
                out[rel] = hits
    return out


def unexplained(found: dict[str, list[tuple[int, str, bool, bool]]]) -> list[str]:
    """Imports inside functions of the guarded folders that name no boundary."""
    return [
        f"{rel}:{line}: {text}"
        for rel, hits in found.items()
        if _is_guarded(rel)
        for line, text, _, explained in hits
        if not explained
    ]


def test_scanner_finds_nested_imports(tmp_path):
    path = tmp_path / "m.py"
    path.write_text(
        "import os\n"
        "def f():\n"
        "    import json\n"
        "    x = 1\n"
        "    # boundary: the driver never imports torch\n"
        "    from vime_core.algo import losses\n"
        "    import re\n"
        "    class C:\n"
        "        def g(self):\n"
        "            from . import x\n"
        "class D:\n"
        "    import re\n"
    )
    found = in_function_imports(path)
    assert [(line, internal, explained) for line, _, internal, explained in found] == [
        (3, False, False),
        (6, True, True),
        (7, False, True),  # the same run of imports as line 6, under its comment
        (10, True, False),
    ]


def test_guarded_folders_import_at_the_top():
    bad = unexplained(scan())
    assert bad == [], (
        "imports inside functions without a boundary comment (move them to the top of the file, "
        "or say which boundary keeps them there with a `# boundary: ...` comment):\n" + "\n".join(bad)
    )


def _counts(found):
    def count(pred):
        return sum(1 for rel, hits in found.items() for _, _, internal, _ in hits if pred(rel, internal))

    internal_total = 0
    for pkg in INTERNAL:
        for path in (REPO / pkg).rglob("*.py"):
            tree = ast.parse(path.read_text())
            internal_total += sum(
                1
                for n in ast.walk(tree)
                if isinstance(n, (ast.Import, ast.ImportFrom)) and all(t == "." or t in INTERNAL for t in _top_name(n))
            )
    return {
        "internal imports (vime_core/tasks/flows), all": internal_total,
        "internal imports inside functions, vime_core/tasks/flows": count(
            lambda rel, i: i and rel.split("/")[0] in INTERNAL
        ),
        "internal imports inside functions, vime_core only": count(lambda rel, i: i and rel.startswith("vime_core/")),
        "internal imports inside functions, guarded folders": count(lambda rel, i: i and _is_guarded(rel)),
        "internal imports inside functions, guarded folders less bench/": count(
            lambda rel, i: i and _is_guarded(rel) and not rel.startswith("bench/")
        ),
        "third-party imports inside functions, vime_core/tasks/flows": count(
            lambda rel, i: not i and rel.split("/")[0] in INTERNAL
        ),
        "third-party imports inside functions, guarded folders": count(lambda rel, i: not i and _is_guarded(rel)),
        "third-party imports inside functions, guarded folders less bench/": count(
            lambda rel, i: not i and _is_guarded(rel) and not rel.startswith("bench/")
        ),
        "imports inside functions without a boundary comment, guarded folders": len(unexplained(found)),
    }


if __name__ == "__main__":
    found = scan()
    for name, value in _counts(found).items():
        print(f"{value:5d}  {name}")
    if "-v" in sys.argv:
        for rel, hits in found.items():
            for line, text, internal, explained in hits:
                # G: guarded, no boundary comment (the test fails on it); g: guarded, explained
                mark = (" ", "G", "g")[_is_guarded(rel) * (1 + explained)]
                print(f"{mark} {'int' if internal else 'ext'} {rel}:{line}: {text}")
