"""The package's layout rules (DESIGN.md): no import loops (``TYPE_CHECKING`` imports counted), no
module reaching into another's privates, and private torch names in ``bcg.core.torch_internals`` only."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "bcg"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _top_level_imports(path: Path) -> list[ast.ImportFrom | ast.Import]:
    """Imports at module level, those under ``if TYPE_CHECKING`` included (not inside functions)."""
    found: list[ast.ImportFrom | ast.Import] = []

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found.append(node)
            elif isinstance(node, ast.If):
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
    for alias in node.names:  # ``from bcg import native`` imports the submodule bcg.core.native
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
    assert {"bcg", "bcg.capture", "bcg.graph", "bcg.core.session", "bcg.runner.graph_runner", "bcg.bench.cli"} <= set(graph)
    assert "bcg.core.breakpoint" in graph["bcg.core.session"]


def _find_loop(graph: dict[str, set[str]]) -> list[str] | None:
    """One import loop of ``graph`` (module -> modules it imports at import time), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in graph:
                continue
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = dfs(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for name in sorted(graph):
        if name not in state:
            found = dfs(name)
            if found:
                return found
    return None


def test_the_loop_check_finds_a_loop() -> None:
    assert _find_loop({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _find_loop({"a": {"b"}, "b": set()}) is None


def test_no_import_loops() -> None:
    loop = _find_loop(_graph())
    assert loop is None, "import loop: " + " -> ".join(loop or [])


def _private_imports(name: str, source: str) -> list[str]:
    """``from bcg.x import _y`` in module ``name`` (its own module excepted)."""
    offences = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("bcg") and node.module != name:
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__") and alias.name != "_native":
                    offences.append(f"{name}: from {node.module} import {alias.name}")
    return offences


def _private_attributes(name: str, source: str) -> list[str]:
    """``module._y`` in module ``name``, where ``module`` is another bcg module imported by name."""
    tree = ast.parse(source)
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
    return [
        f"{name}:{node.lineno}: {node.value.id}.{node.attr}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and aliases.get(node.value.id, name) != name
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
    ]


def test_the_private_checks_catch_what_they_look_for() -> None:
    source = "from bcg.core.pool import _x\nfrom bcg.bench import modes\nmodes._bcg_graph(1)\nmodes.register_mode\n"
    assert _private_imports("bcg.bench.cli", source) == ["bcg.bench.cli: from bcg.core.pool import _x"]
    assert _private_attributes("bcg.bench.cli", source) == ["bcg.bench.cli:3: modes._bcg_graph"]
    assert _private_attributes("bcg.bench.modes", "from bcg.bench import modes\nmodes._own\n") == []


def test_no_module_imports_another_modules_private_names() -> None:
    offences = [o for name, path in MODULES.items() for o in _private_imports(name, path.read_text())]
    assert not offences, offences


def test_no_module_uses_another_modules_private_attributes() -> None:
    offences = [o for name, path in MODULES.items() for o in _private_attributes(name, path.read_text())]
    assert not offences, offences


_TORCH_INTERNALS = "bcg.core.torch_internals"


def _private_torch(name: str, source: str) -> list[str]:
    """Private torch names used in module ``name`` (one entry per line): ``torch._x`` attributes
    (any depth; ATen operator names under ``torch.ops`` are public) and imports from a private torch
    module or of a private name."""
    offences: dict[int, str] = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            chain, cur = [node.attr], node.value
            while isinstance(cur, ast.Attribute):
                chain.append(cur.attr)
                cur = cur.value
            chain.reverse()
            if isinstance(cur, ast.Name) and cur.id == "torch" and chain[0] != "ops" and any(
                    part.startswith("_") and not part.startswith("__") for part in chain):
                offences.setdefault(node.lineno, f"{name}:{node.lineno}: torch.{'.'.join(chain)}")
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch":
            parts = node.module.split(".") + [a.name for a in node.names]
            if any(p.startswith("_") and not p.startswith("__") for p in parts):
                offences.setdefault(node.lineno, f"{name}:{node.lineno}: from {node.module} import ...")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch" and any(
                        p.startswith("_") for p in alias.name.split(".")):
                    offences.setdefault(node.lineno, f"{name}:{node.lineno}: import {alias.name}")
    return [offences[line] for line in sorted(offences)]


def test_the_private_torch_check_catches_what_it_looks_for() -> None:
    source = ("import torch\ntorch._C._x()\nfrom torch.utils._pytree import tree_map\nimport torch._dynamo\n"
              "torch.cuda.graph\ntorch.ops.aten._to_copy.default\n")
    assert [o.split(":")[1] for o in _private_torch("m", source)] == ["2", "3", "4"]


def test_private_torch_names_live_in_one_module() -> None:
    offences = [o for name, path in MODULES.items() if name != _TORCH_INTERNALS
                for o in _private_torch(name, path.read_text())]
    assert not offences, offences


# The modules docs/api.md documents: what an example may import from bcg.
_PUBLIC_MODULES = {"bcg", "bcg.errors", "bcg.distributed", "bcg.runner", "bcg.integrations.transformers"}


def test_examples_use_only_the_public_api() -> None:
    """examples/ shows users what they can write: it imports no internal bcg module."""
    examples = sorted((ROOT.parent / "examples").glob("*.py"))
    assert examples, "no examples found"
    bad = []
    for path in examples:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            else:
                continue
            bad += [f"{path.name}:{node.lineno}: {n}" for n in names
                    if n.split(".")[0] == "bcg" and n not in _PUBLIC_MODULES]
    assert not bad, "examples import internal bcg modules:\n" + "\n".join(bad)


def test_no_class_holds_two_jobs() -> None:
    """A class over 500 lines holds two jobs (the developers' guide): none in the package does."""
    long = []
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None \
                    and node.end_lineno - node.lineno + 1 > 500:
                long.append(f"{path.relative_to(ROOT.parent)}: {node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert not long, long
