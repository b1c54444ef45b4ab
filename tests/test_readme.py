"""README.md stays a document users can follow: every python block in it runs as written (or
fails as it says it does), and it stays short, with no commit ids or issue numbers in it."""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import bcg

README = Path(__file__).resolve().parent.parent / "README.md"
_MARK = "<!-- quick start: runs -->"
# The context-manager block: run in the quick start's namespace; bcg.capture needs CUDA.
_CAPTURE_MARK = "<!-- runs after the quick start, on a GPU; raises bcg.CaptureError without CUDA -->"
_MARKS = (_MARK, _CAPTURE_MARK)
_MAX_LINES = 250


def _block_after(mark: str) -> str:
    text = README.read_text(encoding="utf-8")
    match = re.search(re.escape(mark) + r"\s*```python\n(.*?)```", text, flags=re.S)
    assert match, f"README.md has no python block after {mark!r}"
    return match.group(1)


def _quick_start() -> str:
    return _block_after(_MARK)


def _run_quick_start() -> dict[str, Any]:
    namespace: dict[str, Any] = {"__name__": "readme_quick_start"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # make_graph's fallback to eager mode on the CPU
        exec(compile(_quick_start(), str(README), "exec"), namespace)
    return namespace


def _run_capture_block(namespace: dict[str, Any]) -> dict[str, Any]:
    exec(compile(_block_after(_CAPTURE_MARK), str(README), "exec"), namespace)
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


def test_readme_every_python_block_is_run_by_a_test() -> None:
    """Each python block follows one of the marks this file runs, in that order."""
    text = README.read_text(encoding="utf-8")
    blocks = [m.start() for m in re.finditer(r"^```python\n", text, flags=re.M)]
    marked = [m.end() for mark in _MARKS for m in re.finditer(re.escape(mark) + r"\s*(?=```python\n)", text)]
    assert sorted(marked) == blocks, (
        f"README.md has {len(blocks)} python blocks and {len(marked)} of them marked: put one of "
        f"{_MARKS} right before each (and run it here)"
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available: the cuda test runs the block")
def test_readme_capture_block_raises_capture_error_without_cuda() -> None:
    """What the README says of the context-manager block on a machine without CUDA."""
    ns = _run_quick_start()
    with pytest.raises(bcg.CaptureError, match="needs a CUDA GPU"):
        _run_capture_block(ns)
    assert not ns["graph"].stats().segments  # nothing was captured


@pytest.mark.cuda
def test_readme_capture_block_captures_and_replays_on_the_gpu() -> None:
    ns = _run_capture_block(_run_quick_start())
    graph, y = ns["graph"], ns["y"]
    stats = graph.stats()
    assert graph.mode == "graph" and stats.breakpoints == 1 and stats.segments == 2, stats
    with bcg.live_scope({"lengths": [40, 24]}):
        expected = ns["forward"](ns["static_x"])
    torch.testing.assert_close(y, expected)  # y holds the last replay's result


def test_readme_stays_short_and_links_only_existing_files() -> None:
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 300, "README.md is for users: at most ~300 lines (topics go in docs/)"
    assert len(text.splitlines()) <= _MAX_LINES, (
        f"README.md has {len(text.splitlines())} lines, more than {_MAX_LINES}: it is for users "
        "(topics go in docs/, runs in benchmarks/results/HISTORY.md)"
    )
    root = README.parent
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):
        assert (root / target).exists(), f"README.md links to {target}, which does not exist"


def test_readme_names_no_commit_or_issue() -> None:
    """Commit ids and issue numbers belong in benchmarks/results/HISTORY.md and the issues, not the README."""
    text = README.read_text(encoding="utf-8")
    commits = [w for w in re.findall(r"\b[0-9a-f]{7,40}\b", text) if re.search(r"\d", w) and re.search(r"[a-f]", w)]
    assert not commits, f"README.md names commit ids: {', '.join(sorted(set(commits)))}"
    issues = re.findall(r"(?:issue\s*)?#\d+\b", text, flags=re.I)
    assert not issues, f"README.md names issues: {', '.join(issues)}"
