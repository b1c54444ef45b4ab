"""The package's layout rules (DESIGN.md): no import loops, no module reaching into another's privates."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "bcg"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _top_level_imports(path: Path) -> list[ast.ImportFrom | ast.Import]:
    """Imports that run when the module is imported (not inside functions or ``if TYPE_CHECKING``)."""
    found: list[ast.ImportFrom | ast.Import] = []

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found.append(node)
            elif isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)

    visit(ast.parse(path.read_text()).body)
    return found


def _bcg_targets(node: ast.ImportFrom | ast.Import) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.startswith("bcg")]
    if node.module is None or not node.module.startswith("bcg"):
        return []
    targets = []
    for alias in node.names:  # ``from bcg import native`` imports the submodule bcg.native
        sub = f"{node.module}.{alias.name}"
        targets.append(sub if sub in MODULES else node.module)
    return targets


def _graph() -> dict[str, set[str]]:
    return {
        name: {t for node in _top_level_imports(path) for t in _bcg_targets(node) if t != name}
        for name, path in MODULES.items()
    }


def test_the_layout_check_sees_the_package() -> None:
    graph = _graph()
    assert {"bcg", "bcg.capture", "bcg.graph", "bcg.runner.graph_runner", "bcg.bench.cli"} <= set(graph)
    assert "bcg.breakpoint" in graph["bcg.capture"]


def test_no_import_loops() -> None:
    graph = _graph()
    # a package imports its own submodules from __init__; a submodule importing its package
    # (bcg -> bcg.x -> bcg) is the loop to catch, so keep those edges
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in graph:
                continue
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt]
                pytest.fail("import loop: " + " -> ".join(cycle))
            if nxt not in state:
                dfs(nxt)
        stack.pop()
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            dfs(name)


def test_no_module_imports_another_modules_private_names() -> None:
    offences = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("bcg"):
                if node.module == name:
                    continue
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__") and alias.name != "_native":
                        offences.append(f"{name}: from {node.module} import {alias.name}")
    assert not offences, offences


def test_no_module_uses_another_modules_private_attributes() -> None:
    """``module._name`` where ``module`` is a bcg module imported by name (``from bcg import native``)."""
    offences = []
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text())
        aliases: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("bcg"):
                for alias in node.names:
                    if f"{node.module}.{alias.name}" in MODULES:
                        aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in MODULES and alias.asname:
                        aliases[alias.asname] = alias.name
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and aliases[node.value.id] != name
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                offences.append(f"{name}:{node.lineno}: {node.value.id}.{node.attr}")
    assert not offences, offences
