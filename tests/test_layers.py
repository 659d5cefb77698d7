"""Data flows one way: flows -> tasks -> infra, and inside infra the format sits below everything."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _imports(path: Path) -> set[str]:
    """Every module a file imports (absolute names; relative imports are not used in this tree)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return found


def _unit(module: str) -> str:
    """The unit a module belongs to: ``infra.<sub>`` for infra, else its top-level package
    (``rewind.`` dropped: every module of Rewind's is named under it)."""
    parts = module.removeprefix("rewind.").split(".")
    return ".".join(parts[:2]) if parts[0] == "infra" and len(parts) > 1 else parts[0]


def _graph() -> dict[str, set[str]]:
    """Unit -> the Rewind units it imports."""
    graph: dict[str, set[str]] = defaultdict(set)
    for top in ("infra", "tasks", "flows"):
        for path in (REPO / top).rglob("*.py"):
            mod = ".".join(path.relative_to(REPO).with_suffix("").parts)
            for imp in _imports(path):
                top = imp.split(".")[0]
                assert top not in ("infra", "tasks", "flows", "examples"), (
                    f"{path}: import {imp} (not rewind.*)"
                )
                if top == "prefect" or (top == "rewind" and imp.count(".") >= 1 and imp != "rewind.infra"):
                    graph[_unit(mod)].add(_unit(imp))
    return graph


def test_lower_layers_never_import_higher_ones():
    graph = _graph()
    for unit, deps in graph.items():
        if unit.startswith("infra"):
            assert not deps & {"prefect", "tasks", "flows"}, (
                f"{unit} imports {deps & {'prefect', 'tasks', 'flows'}}"
            )
        if unit == "tasks":
            assert "flows" not in deps


def test_the_format_sits_below_every_engine():
    graph = _graph()
    allowed = {
        "infra.format": {
            "infra.format",
            "infra.errors",
            "infra.faults",
            "infra.progress",
            "infra.throttle",
            "infra.cpus",
            "infra.parallel",
        },
        "infra.tiers": {
            "infra.tiers",
            "infra.format",
            "infra.errors",
            "infra.faults",
            "infra.progress",
            "infra.redact",
        },
        "infra.throttle": {"infra.throttle", "infra.sizes", "infra.errors"},  # paces every file write
        "infra.catalog": {"infra.catalog", "infra.format", "infra.errors", "infra.config", "infra.sizes"},
        "infra.progress": {"infra.progress"},  # a leaf: the byte paths report, nothing below them
        "infra.redact": {"infra.redact"},  # a leaf: hides secrets in what is printed or recorded
        "infra.cpus": {"infra.cpus"},  # a leaf: the CPUs and cores this process may use
        "infra.parallel": {"infra.parallel"},  # a leaf: calls a few at a time on daemon threads
    }
    for unit, ok in allowed.items():
        assert graph[unit] <= ok, f"{unit} imports {graph[unit] - ok}"


def test_no_cycles_between_infra_packages():
    graph = {u: {d for d in deps if d.startswith("infra") and d != u} for u, deps in _graph().items()}
    seen: dict[str, int] = {}

    def visit(unit: str, path: list[str]) -> None:
        seen[unit] = 1
        for dep in sorted(graph.get(unit, ())):
            assert seen.get(dep) != 1, "cycle: " + " -> ".join([*path, unit, dep])
            if dep not in seen:
                visit(dep, [*path, unit])
        seen[unit] = 2

    for unit in sorted(graph):
        if unit not in seen:
            visit(unit, [])
