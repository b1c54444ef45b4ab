"""docs/api.md's tables must match the code, so that they cannot drift.

Every first-cell code span of a table row in docs/api.md that is a
call (``bcg.capture(graph, *, ...)``, ``graph.replay(live=<unset>)``,
``runner(*inputs, live=<unset>)``) must be the real signature as ``inspect.signature``
renders it: every parameter in order, ``/`` and ``*`` markers, defaults by ``repr``,
annotations and ``self`` dropped. ``graph.`` is a :class:`bcg.BreakableGraph`,
``runner.`` a :class:`bcg.GraphRunner` (``runner(...)`` is its ``__call__``).
"""

from __future__ import annotations

import copy
import inspect
import re
from pathlib import Path
from typing import Any

import pytest

import bcg
from bcg.core.breakpoint import UNSET as _UNSET

API_DOC = Path(__file__).resolve().parent.parent / "docs" / "api.md"

# The first-cell prefix of a call, and what it names.
_RECEIVERS: dict[str, Any] = {"bcg": bcg, "graph": bcg.BreakableGraph, "runner": bcg.GraphRunner}
_CALL = re.compile(r"^@?(?P<target>(?:bcg|graph|runner)(?:\.\w+)*)(?P<sig>\(.*\))$")
_SPAN = re.compile(r"`([^`]+)`")

# Rows the table must have (the calls users make).
_REQUIRED = {
    "bcg.capture",
    "bcg.make_graph",
    "bcg.GraphRunner",
    "bcg.verify",
    "bcg.live",
    "bcg.live_scope",
    "bcg.breakpoint",
    "bcg.graph_break",
    "bcg.graph_pool_handle",
    "bcg.BreakableGraph",
    "bcg.StagingBuffer",
    "bcg.StagedTiers",
    "bcg.VariantPolicy",
    "bcg.Debug",
    "bcg.runner.default_buckets",
    "bcg.runner.pick_bucket",
    "bcg.distributed.RankAgreement",
    "graph.replay",
    "graph.choose",
    "graph.replay_form",
    "graph.check_held",
    "graph.reset",
    "graph.stats",
    "graph.pool",
    "graph.describe",
    "graph.dump_dot",
    "graph.use_executor",
    "runner.capture",
    "runner",
    "runner.stats",
    "runner.reset",
    "runner.locked",
    "runner.measure_largest_alone",
    "runner.bucket_for",
}


def _api_section() -> str:
    return API_DOC.read_text(encoding="utf-8")


def _table_rows(section: str) -> list[list[str]]:
    rows = []
    for line in section.splitlines():
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if all(set(c) <= set("-: ") for c in cells):  # the separator row
            continue
        rows.append(cells)
    return rows


def _documented_calls() -> list[tuple[str, str]]:
    """(target, code span) of every call in a first cell of the API tables."""
    calls = []
    for cells in _table_rows(_api_section()):
        for span in _SPAN.findall(cells[0]):
            match = _CALL.match(span)
            if match:
                calls.append((match.group("target"), span.lstrip("@")))
    return calls


def _resolve(target: str) -> tuple[Any, bool]:
    """The object ``target`` names, and whether its first parameter is ``self``."""
    head, *attrs = target.split(".")
    obj = _RECEIVERS[head]
    if head == "bcg":
        for attr in attrs:
            obj = getattr(obj, attr)
        return obj, False
    if not attrs:  # runner(...) / graph(...): the instance called
        attrs = ["__call__"]
    for attr in attrs:
        obj = inspect.getattr_static(obj, attr)
    return obj, True


def _rendered(obj: Any, drop_self: bool) -> str:
    sig = inspect.signature(obj)
    params = list(sig.parameters.values())
    if drop_self:
        assert params and params[0].name == "self", f"{obj!r}: expected a method taking self"
        params = params[1:]
    params = [p.replace(annotation=inspect.Parameter.empty) for p in params]
    return str(sig.replace(parameters=params, return_annotation=inspect.Signature.empty))


def test_unset_reads_as_unset_and_keeps_its_identity() -> None:
    assert repr(_UNSET) == "<unset>"
    assert copy.copy(_UNSET) is _UNSET and copy.deepcopy(_UNSET) is _UNSET
    assert inspect.signature(bcg.live).parameters["default"].default is _UNSET


def test_api_table_has_the_required_rows() -> None:
    documented = {target for target, _ in _documented_calls()}
    missing = sorted(_REQUIRED - documented)
    assert not missing, f"docs/api.md's tables has no call row for: {', '.join(missing)}"


_CALLS = _documented_calls()


@pytest.mark.parametrize("target,span", _CALLS, ids=[target for target, _ in _CALLS])
def test_api_table_signature_matches_code(target: str, span: str) -> None:
    obj, drop_self = _resolve(target)
    expected = target + _rendered(obj, drop_self)
    assert span == expected, (
        f"docs/api.md's tables shows a signature that is not the code's:\n"
        f"  docs:   {span}\n"
        f"  code:   {expected}"
    )


def test_api_tables_mention_every_public_name() -> None:
    tables = "\n".join("|".join(cells) for cells in _table_rows(_api_section()))
    missing = [name for name in bcg.__all__ if not re.search(rf"\bbcg\.{re.escape(name)}\b", tables)]
    assert not missing, f"docs/api.md's tabless do not mention: {', '.join('bcg.' + n for n in missing)}"


@pytest.mark.parametrize("prefix,cls", [("graph", bcg.BreakableGraph), ("runner", bcg.GraphRunner)])
def test_api_tables_mention_every_public_member(prefix: str, cls: type) -> None:
    tables = "\n".join("|".join(cells) for cells in _table_rows(_api_section()))
    members = [name for name in vars(cls) if not name.startswith("_")]
    missing = [name for name in members if not re.search(rf"\b{prefix}\.{name}\b", tables)]
    assert not missing, f"docs/api.md's tabless do not mention: {', '.join(prefix + '.' + n for n in missing)}"
