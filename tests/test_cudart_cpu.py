"""``bcg.core.cudart.captured_chain`` on made-up capture graphs (the runtime calls replaced): what
decides whether a capture may end its segment at the first staged copy."""

from __future__ import annotations

import pytest

from bcg.core import cudart


def _graph(monkeypatch: pytest.MonkeyPatch, nodes: list[int], edges: list[tuple[int, int]],
           status: str = "active") -> None:
    monkeypatch.setattr(cudart, "capture_info", lambda stream: (status, 1, 7, []))
    monkeypatch.setattr(cudart, "graph_nodes", lambda graph: list(nodes))
    monkeypatch.setattr(cudart, "graph_edges", lambda graph: list(edges))


@pytest.mark.parametrize(
    ("nodes", "edges", "chain"),
    [
        ([], [], True),  # nothing captured yet
        ([1], [], True),
        ([1, 2, 3], [(1, 2), (2, 3)], True),  # one stream: each node after the last
        ([1, 2, 3, 4], [(1, 2), (1, 3), (2, 4), (3, 4)], False),  # forked and joined back
        ([1, 2, 3], [(1, 2), (1, 3)], False),  # forked, not joined
        ([1, 2], [], False),  # two streams' first nodes, nothing between them
        ([1, 2, 3, 4], [(1, 3), (2, 3), (3, 4)], False),  # a side stream's work joined in
    ],
)
def test_captured_chain_is_true_only_for_one_chain_of_nodes(monkeypatch: pytest.MonkeyPatch, nodes: list[int],
                                                             edges: list[tuple[int, int]], chain: bool) -> None:
    _graph(monkeypatch, nodes, edges)
    assert cudart.captured_chain(0) is chain


def test_captured_chain_outside_a_capture_is_true(monkeypatch: pytest.MonkeyPatch) -> None:
    _graph(monkeypatch, [1, 2], [], status="none")
    assert cudart.captured_chain(0) is True
