"""Trimmed executables: a segment's graph instantiated without some of its nodes.

``BreakableGraph.set_enabled(label, False)`` replays, in place of a segment's
executable, one built from a copy of its graph with the label's node group
removed. Each removed node's predecessors are joined to its successors, so
every order the capture recorded between the nodes that stay still holds. A
trimmed executable launches no node for the group, where a disabled node
(``cudaGraphNodeSetEnabled``) still runs as an empty one, which costs GPU time
(benchmarks/results/HISTORY.md). Segments that use RNG and the breakable
form's segments disable nodes instead (see ``SegmentStep.skip``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any

from bcg.core import cudart

log = logging.getLogger("bcg")


def bypass_edges(edges: Iterable[tuple[int, int]], gone: Iterable[int]) -> list[tuple[int, int]]:
    """The edges to add so that removing the nodes ``gone`` keeps every order ``edges`` implied.

    Each removed node's predecessors are joined to its successors, one node
    after another, so chains of removed nodes are bridged too. Returns only
    edges between kept nodes that ``edges`` lacks.
    """
    succs: dict[int, set[int]] = {}
    preds: dict[int, set[int]] = {}
    original = set()
    for a, b in edges:
        succs.setdefault(a, set()).add(b)
        preds.setdefault(b, set()).add(a)
        original.add((a, b))
    for z in gone:
        before, after = preds.pop(z, set()), succs.pop(z, set())
        for p in before:
            succs[p].discard(z)
            succs[p] |= after
        for s in after:
            preds[s].discard(z)
            preds[s] |= before
    return [(a, b) for a, bs in succs.items() for b in bs if (a, b) not in original]


def trimmed_exec(graph: int, drop: Sequence[Any], stream: int,
                 keep: Sequence[Any] = ()) -> tuple[int, int, tuple[Any, ...]]:
    """An executable of ``graph`` without the nodes ``drop``, uploaded on ``stream``.

    Arguments:
        graph: the segment's ``cudaGraph_t`` (left unchanged: a copy is edited).
        drop: nodes of ``graph`` (kernel, memcpy or memset nodes).
        stream: the raw stream to upload on (the one replays will use).
        keep: nodes of ``graph`` whose parameters will be set in the executable (staging kernels):
            the copy is then kept, since CUDA names a node of an executable by the graph it was
            instantiated from.

    Returns ``(executable, copy, kept)``: the ``cudaGraphExec_t``, the edited copy's ``cudaGraph_t``
    (0 when ``keep`` is empty: destroyed) and ``keep``'s nodes in it. The caller destroys both
    (``cudart.exec_destroy``, ``cudart.graph_destroy``).
    """
    t0 = time.perf_counter()
    clone = cudart.graph_clone(graph)
    try:
        gone = [cudart.find_in_clone(node, clone) for node in drop]
        kept = tuple(cudart.find_in_clone(node, clone) for node in keep)
        nodes: dict[int, Any] = {}
        edges = []
        for a, b in cudart.graph_edges(clone):
            nodes[int(a)], nodes[int(b)] = a, b
            edges.append((int(a), int(b)))
        joined = bypass_edges(edges, [int(node) for node in gone])
        for node in gone:
            cudart.destroy_node(node)
        cudart.add_edges(clone, [(nodes[a], nodes[b]) for a, b in joined])
        graph_exec = cudart.instantiate(clone)
    except BaseException:
        cudart.graph_destroy(clone)
        raise
    if not keep:
        cudart.graph_destroy(clone)  # the executable does not need it
        clone = 0
    try:
        cudart.upload(graph_exec, stream)
    except BaseException:
        cudart.exec_destroy(graph_exec)
        if clone:
            cudart.graph_destroy(clone)
        raise
    log.debug("bcg: trimmed executable without %d node(s), %d edge(s) joined, %.1f ms",
              len(gone), len(joined), (time.perf_counter() - t0) * 1e3)
    return graph_exec, clone, kept
