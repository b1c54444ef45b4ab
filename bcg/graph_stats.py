"""What a :class:`bcg.BreakableGraph` reports: ``stats()`` (:class:`GraphStats`), ``describe()``'s
table of its plan, and ``dump_dot()``'s DOT files of its segments."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from bcg.core import cudart
from bcg.core.plan import BreakpointStep, SegmentStep, Step
from bcg.core.pool import pool_bytes
from bcg.form import Form


@dataclass(frozen=True)
class StagedStats:
    """A staged graph's replays: ``breakpoints`` (the staged ones captured inline), ``replays``
    (per staged form, in the order a replay tries them: tiers, then the inline form) and
    ``breakable_replays`` (replays of the breakable form, by reason)."""

    breakpoints: tuple[str, ...]
    replays: tuple[int, ...]
    breakable_replays: dict[str, int]

    @property
    def inline_replays(self) -> int:
        return sum(self.replays)


@dataclass(frozen=True)
class GraphStats:
    """What a capture produced.

    ``nodes``: per segment of the graph (its first form), the kernel nodes of
    each CUDA graph, or in eager mode the ATen operations. ``pool_bytes``: what
    the private pool holds (a shared pool: the whole pool). ``bridge_bytes``:
    the bridges (copies of returned tensors). ``capture_s``: every form's
    capture. ``held_storages``: the storages outside the pool that the segments
    read, which the graph keeps alive (see :mod:`bcg.core.storages`).
    ``staged``: see :class:`StagedStats` (None without staged breakpoints);
    ``keyed``: the keyed breakpoints' variants, per form (see
    :meth:`bcg.keyed.variants.VariantCache.stats`; None without keyed breakpoints).
    """

    mode: str
    segments: int
    breakpoints: int
    nodes: tuple[int, ...]
    pool_bytes: int
    bridge_bytes: int
    capture_s: float
    held_storages: int = 0
    staged: StagedStats | None = None
    keyed: dict[str, Any] | None = None


def graph_stats(first: Form | None, forms: Sequence[Form], breakable_replays: dict[str, int]) -> GraphStats:
    """The stats of a graph whose first capture is ``first`` (None: none yet), whose forms are
    ``forms`` (in the order a replay tries them) and whose breakable form replayed
    ``breakable_replays`` times, by reason."""
    if first is None:
        return GraphStats("graph", 0, 0, (), 0, 0, 0.0)
    rec = first.recording
    graph_mode = rec.mode == "graph"
    segments = first.segments
    breakpoints = [s for s in first.plan if isinstance(s, BreakpointStep)]
    staged = None
    if first.staged_breakpoints is not None:
        staged_forms = [f for f in forms if f.staged_breakpoints is not None]
        staged = StagedStats(tuple(first.staged_breakpoints.names), tuple(f.replays for f in staged_forms),
                             dict(breakable_replays))
    keyed = {f.name: f.variants.stats() for f in forms if f.variants is not None} or None
    return GraphStats(
        mode=rec.mode,
        segments=len(segments),
        breakpoints=len(breakpoints),
        nodes=tuple((s.kernel_nodes or 0) if graph_mode else s.nodes for s in segments),
        pool_bytes=pool_bytes(rec.pool, rec.device) if graph_mode else 0,
        bridge_bytes=sum(b.bridges.nbytes for b in breakpoints if b.bridges is not None),
        capture_s=sum(f.recording.capture_s for f in forms),
        held_storages=len(rec.held) if rec.held is not None else 0,
        staged=staged,
        keyed=keyed,
    )


def describe(plan: Sequence[Step], stats: GraphStats, form_names: Sequence[str]) -> str:
    """A readable table of ``plan`` (a first form's): step, kind, name, nodes, bridge bytes; then
    ``stats``' totals and, with more than one, the forms in the order a replay tries them."""
    rows = [("step", "kind", "name", "kernel nodes", "nodes", "bridge bytes")]
    for i, step in enumerate(plan):
        if isinstance(step, SegmentStep):
            kernels = "-" if step.kernel_nodes is None else str(step.kernel_nodes)
            rows.append((str(i), "segment", f"segment[{step.index}]" + (" (rng)" if step.uses_rng else ""),
                         kernels, str(step.nodes), ""))
        else:
            nbytes = step.bridges.nbytes if step.bridges is not None else 0
            rows.append((str(i), "breakpoint", step.name, "", "", str(nbytes)))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append(
        f"{stats.segments} segments, {stats.breakpoints} breakpoints, pool {stats.pool_bytes / 2**20:.2f} MiB, "
        f"bridges {stats.bridge_bytes / 2**20:.2f} MiB, captured in {stats.capture_s:.3f} s ({stats.mode} mode)"
    )
    if len(form_names) > 1:
        lines.append("forms, in the order a replay tries them: " + ", ".join(form_names))
    return "\n".join(lines)


def dump_dot(segments: Sequence[SegmentStep], directory: str | os.PathLike[str]) -> list[str]:
    """Write one DOT file per segment of ``segments`` (graph mode: ``cudaGraphDebugDotPrint``) into
    ``directory``, made if missing; return their paths."""
    os.makedirs(directory, exist_ok=True)
    paths = []
    for seg in segments:
        path = os.path.join(os.fspath(directory), f"segment_{seg.index:03d}.dot")
        cudart.dot_print(seg.graph_handle, path)
        paths.append(path)
    return paths
