"""README.md stays a document users can follow: its quick start runs as written, and it stays short."""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

README = Path(__file__).resolve().parent.parent / "README.md"
_MARK = "<!-- quick start: runs -->"


def _quick_start() -> str:
    text = README.read_text(encoding="utf-8")
    match = re.search(re.escape(_MARK) + r"\s*```python\n(.*?)```", text, flags=re.S)
    assert match, f"README.md has no python block after {_MARK!r}"
    return match.group(1)


def _run_quick_start() -> dict[str, Any]:
    namespace: dict[str, Any] = {"__name__": "readme_quick_start"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # make_graph's fallback to eager mode on the CPU
        exec(compile(_quick_start(), str(README), "exec"), namespace)
    return namespace


def test_readme_quick_start_runs() -> None:
    ns = _run_quick_start()
    graph = ns["graph"]
    assert graph.mode == ("graph" if torch.cuda.is_available() else "eager")
    stats = graph.stats()
    assert stats.breakpoints == 1 and stats.segments == 2, stats


@pytest.mark.cuda
def test_readme_quick_start_captures_a_graph_on_the_gpu() -> None:
    ns = _run_quick_start()
    assert ns["graph"].mode == "graph" and ns["y"].is_cuda


def test_readme_stays_short_and_links_only_existing_files() -> None:
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 300, "README.md is for users: at most ~300 lines (topics go in docs/)"
    root = README.parent
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):
        assert (root / target).exists(), f"README.md links to {target}, which does not exist"
