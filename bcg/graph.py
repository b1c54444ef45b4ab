"""``bcg.BreakableGraph``: a captured plan of segments and breakpoints, and its replay."""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch
# _profiler._is_profiler_enabled: whether a torch profiler runs, the flag torch's own
# record_function reads; torch has no public query for it, and replays read it cheaply.
import torch.autograd.profiler as _profiler
from torch.utils import _pytree as pytree

from bcg.core import cudart
from bcg.core.process import release_when_safe
from bcg.errors import ReplayError
from bcg.core.breakpoint import UNSET, reset_live, set_live
from bcg.core.pool import PoolHandle, PoolLease, pool_bytes
from bcg.core.plan import BreakpointStep, GraphParts, GraphSource, SegmentStep, Step, breakpoint_tensors
from bcg.core.cudart import stream_readers
from bcg.core.replay import Executor, make_executor
from bcg.core.storages import check_alarm
from bcg.keyed.variants import VariantCache, VariantPolicy

_current_device, _current_stream = stream_readers()

log = logging.getLogger("bcg")


@dataclass(frozen=True)
class GraphStats:
    """What a capture produced.

    ``kernel_nodes`` counts kernel nodes per segment read from each CUDA graph
    (graph mode); ``aten_ops`` counts ATen operations per segment (eager mode).
    ``pool_bytes`` is what the private pool holds (shared pools: the whole pool).
    ``bridge_bytes``: the bridges (copies of returned tensors). ``held_bytes``:
    pool memory the graph itself keeps alive (breakpoint arguments and bridges
    under ``ownership="graph"``; 0 under ``"pool"``), which one
    ``torch.cuda.graph`` of the same work would reuse;
    ``pool_bytes_floor_estimate`` (``pool_bytes - held_bytes``) estimates that
    graph's pool. ``staged``: the staged breakpoints captured inline;
    ``inline_replays``: replays that ran inline; ``fallback_replays``: replays
    that ran the breakable form instead, by reason. ``variants``: the keyed
    breakpoints' keys, hits, variants and stitched executables (see
    :meth:`bcg.keyed.variants.VariantCache.stats`; None without keyed breakpoints).
    ``disabled``: the node groups replays skip now (:meth:`BreakableGraph.set_enabled`);
    ``trimmed_executables``: the executables built without skipped groups, over all segments.
    ``launched_first``: inline replays that launched before ``prepare``
    (``prepare_after_launch``); ``late_launches``: those whose launch returned
    with the GPU already waiting at a gate (see :mod:`bcg.staged.staging`).
    ``held_storages``, ``held_storage_bytes``: the storages outside the pool
    that the segments read, which the graph keeps alive (see :mod:`bcg.core.storages`).
    """

    mode: str
    segments: int
    breakpoints: int
    kernel_nodes: tuple[int, ...] | None
    aten_ops: tuple[int, ...] | None
    pool_bytes: int
    bridge_bytes: int
    capture_s: float
    held_bytes: int = 0
    pool_bytes_floor_estimate: int = 0
    staged: tuple[str, ...] = ()
    inline_replays: int = 0
    fallback_replays: dict[str, int] = field(default_factory=dict)
    disabled: tuple[str, ...] = ()
    trimmed_executables: int = 0
    variants: dict[str, Any] | None = None
    launched_first: int = 0
    late_launches: int = 0
    held_storages: int = 0
    held_storage_bytes: int = 0


class BreakableGraph:
    """Segments of CUDA graphs with eager breakpoints between them.

    Fill it with ``with bcg.capture(graph): ...`` or build it with
    :func:`bcg.make_graph`, then call :meth:`replay`. Replays run on the current
    stream and must be issued on the device the graph was captured on.
    """

    def __init__(self) -> None:
        self._parts = GraphParts(plan=(), capture_s=0.0)
        self._plan: tuple[Step, ...] = ()
        self._executor: Executor | None = None
        self._lease: PoolLease | None = None  # held since an abandoned capture, or by the capture
        self._was_reset = False
        self._replaying = 0  # replays in progress (a breakpoint may reset, or another thread)
        self.source: GraphSource | None = None
        self.outputs: Any = None
        self.fallback: BreakableGraph | None = None
        self.variants: VariantCache | None = None  # keyed breakpoints' variants (see bcg.keyed.variants)
        self._inline_replays = 0
        self._fallback_replays: dict[str, int] = {}
        self._disabled: frozenset[str] = frozenset()  # switchable node groups turned off
        self._executors: dict[frozenset[str], Executor] = {}  # one per set of groups turned off
        self._launches_first = False  # replays launch before the staged prepare (see install)
        # storages read by the segments (or variants) that nothing but the graph may hold any more
        self._alarm: list[Any] = []

    # -- filled by capture / make_graph ----------------------------------------------
    def install(self, parts: GraphParts) -> None:
        """Make this graph replay ``parts`` (``bcg.capture`` and ``bcg.make_graph`` call it).

        Raises:
            ReplayError: the graph already holds a capture (``reset()`` it first).
        """
        if self.is_captured:
            raise ReplayError("this BreakableGraph already holds a capture: call graph.reset() before installing another")
        self.hold(parts.lease)
        self._inline_replays, self._fallback_replays = 0, {}
        self._disabled, self._executors = frozenset(), {}
        self._parts = parts
        self._plan = tuple(parts.plan)
        self._was_reset = False
        graph_mode = parts.mode == "graph"
        if parts.held is not None:
            self._alarm = parts.held.alarm
            parts.held.set_bcg_tensors(functools.partial(breakpoint_tensors, self._plan))
        if any(isinstance(s, BreakpointStep) and s.spec.key is not None for s in self._plan):
            # attaches itself to the keyed steps (graph mode) before the executor reads them
            self.variants = VariantCache(self._plan, parts.device if graph_mode else None,
                                         parts.variant_policy or VariantPolicy(), self._rebuild_executor,
                                         self._alarm, parts.pool)
        self._executor = make_executor(self._plan) if graph_mode else None
        if self._executor is not None:
            self._executors[self._disabled] = self._executor
        # Launch, then prepare: only a plan of segments (no breakpoint in between that could wait
        # on the GPU) whose staged copies all wait at their gates.
        self._launches_first = (graph_mode and parts.stager is not None and parts.stager.launches_first
                                and all(isinstance(s, SegmentStep) for s in self._plan))

    def _rebuild_executor(self) -> None:
        """Rebuild the executor from the plan (keyed steps retired to plain calls), same kind;
        the executors built for other sets of skipped groups are dropped."""
        if self._executor is not None:
            self._set_executor(make_executor(self._plan, self._executor.name))

    def _set_executor(self, executor: Executor) -> None:
        """Replay with ``executor`` (built for the groups skipped now); the executors cached
        for other sets of skipped groups are dropped (they may read steps that changed)."""
        self._executor = executor
        self._executors = {self._disabled: executor}

    def set_fallback(self, graph: BreakableGraph) -> None:
        """Replay ``graph`` (the breakable form of the same code) when staged metadata does not fit.

        ``graph`` must be captured from the same code and static inputs with
        ``inline=False``, into this graph's pool. Both graphs' ``outputs`` must
        be set (the tensors the captured code returned): after ``graph``
        replays, its outputs are copied into this graph's, so callers keep
        reading the same tensors. ``reset()`` resets it too. The groups that
        :meth:`set_enabled` skips are skipped in ``graph`` too, switched right
        before it replays, by disabling their nodes in its own executables (see
        :meth:`bcg.core.plan.SegmentStep.skip`; segments already skipping groups
        keep their trimmed executables): it replays only for metadata that does
        not fit, where its breakpoints cost more than the empty nodes, and a
        trimmed executable per segment would cost milliseconds to build.
        """
        if self.outputs is None or graph.outputs is None:
            raise ReplayError(
                "set_fallback needs the outputs of both graphs: set graph.outputs (and fallback.outputs) to "
                "the tensors each capture returned, so that a fallback replay can update this graph's outputs"
            )
        marked = False
        for step in graph.segments:
            if step.in_place is None and not step.skipped:
                step.in_place = "it is a breakable form (a fallback): its nodes are disabled in place"
                marked = True
        if marked and graph._executor is not None:  # executors built with trimmed executables: not reused
            graph._set_executor(graph._executor)
        self.fallback = graph

    def staged_replays(self) -> tuple[int, dict[str, int]]:
        """``(inline replays, {reason: replays of the fallback})`` so far (cheap: no allocator snapshot)."""
        return self._inline_replays, dict(self._fallback_replays)

    def launch_order(self) -> tuple[int, int]:
        """``(launched_first, late_launches)`` so far (see :class:`GraphStats`; cheap)."""
        stager = self._parts.stager
        return (stager.launched_first, stager.late_launches) if stager is not None else (0, 0)

    @property
    def staged(self) -> tuple[str, ...]:
        """The staged breakpoints captured inline (their names)."""
        stager = self._parts.stager
        return tuple(stager.names) if stager is not None else ()

    def hold(self, lease: PoolLease | None) -> None:
        """Keep ``lease`` (a share of the pool) until ``reset()``, releasing any other one held.

        An abandoned capture into a caller's pool leaves its lease here, so that
        the pool stays usable for the next capture.
        """
        if self._lease is not None and self._lease is not lease:
            self._lease.release()
        self._lease = lease

    def use_executor(self, name: str | None) -> None:
        """Replay with ``"python"`` or ``"native"`` (``None``: the best available, as by default)."""
        if self._executor is None:
            raise ReplayError("use_executor applies to a captured graph in graph mode")
        self._set_executor(make_executor(self._plan, name))

    @property
    def executor(self) -> str:
        """Which executor replays this graph (``"python"`` or ``"native"``)."""
        return self._executor.name if self._executor is not None else "none"

    # -- inspection ---------------------------------------------------------------------
    @property
    def is_captured(self) -> bool:
        return self._executor is not None or self._parts.rerun is not None

    @property
    def mode(self) -> str:
        """``"graph"`` (CUDA graph segments) or ``"eager"`` (re-runs the function)."""
        return self._parts.mode

    @property
    def plan(self) -> tuple[Step, ...]:
        """The replay plan: segment and breakpoint steps in stream order."""
        return self._plan

    @property
    def segments(self) -> list[SegmentStep]:
        return [s for s in self._plan if isinstance(s, SegmentStep)]

    @property
    def breakpoints(self) -> list[BreakpointStep]:
        return [s for s in self._plan if isinstance(s, BreakpointStep)]

    @property
    def num_segments(self) -> int:
        return len(self.segments)

    @property
    def num_breakpoints(self) -> int:
        return len(self.breakpoints)

    @property
    def device(self) -> int | None:
        return self._parts.device

    def pool(self) -> PoolHandle:
        """The private memory pool token; pass it as ``pool=`` to share it with another graph."""
        if self._parts.pool is None:
            raise ReplayError("this graph has no memory pool: capture it first")
        return self._parts.pool

    def stats(self) -> GraphStats:
        """Segments, breakpoints, per-segment work, pool and bridge bytes, capture seconds."""
        segments = self.segments
        parts = self._parts
        graph_mode = parts.mode == "graph"
        pool = pool_bytes(parts.pool, parts.device) if graph_mode else 0
        launched_first, late_launches = self.launch_order()
        return GraphStats(
            mode=parts.mode,
            segments=len(segments),
            breakpoints=self.num_breakpoints,
            kernel_nodes=tuple(s.kernel_nodes or 0 for s in segments) if graph_mode else None,
            aten_ops=None if graph_mode else tuple(s.nodes for s in segments),
            pool_bytes=pool,
            bridge_bytes=sum(b.bridges.nbytes for b in self.breakpoints if b.bridges is not None),
            capture_s=parts.capture_s,
            held_bytes=parts.held_bytes,
            pool_bytes_floor_estimate=max(pool - parts.held_bytes, 0),
            staged=self.staged,
            inline_replays=self._inline_replays,
            fallback_replays=dict(self._fallback_replays),
            variants=self.variants.stats() if self.variants is not None else None,
            disabled=tuple(sorted(self._disabled)),
            trimmed_executables=sum(len(s.trimmed) for s in segments),
            launched_first=launched_first,
            late_launches=late_launches,
            held_storages=len(parts.held) if parts.held is not None else 0,
            held_storage_bytes=parts.held.nbytes if parts.held is not None else 0,
        )

    # -- replay -------------------------------------------------------------------------
    def check_held(self) -> None:
        """Raise :class:`bcg.StaleTensorError` if a tensor the captured kernels read was replaced
        (nothing but the graph holds its storage any more): what every replay asks first.

        Cheap: a replay pays one list check unless a tensor the graph reads was
        collected (see :mod:`bcg.core.storages`).
        """
        if self._alarm:
            check_alarm(self._alarm)

    def replay(self, live: Any = UNSET, *, breakable: bool = False, stitch: bool = True,
               fits_checked: bool = False, launch_first: bool | None = None) -> Any:
        """Run segment, breakpoint, segment, ... on the current stream.

        ``live`` is what :func:`bcg.live` returns inside breakpoints during this
        replay. Returns ``outputs`` (set by :func:`bcg.make_graph`; ``None`` for
        the context-manager form, whose outputs are the tensors the captured
        code returned). A breakpoint that raises stops the replay; the graph
        stays replayable.

        A graph with staged breakpoints first asks their ``fits(live)``: when
        all fit, it runs their ``prepare(live)`` and launches; otherwise it
        replays its ``fallback`` (the breakable form) and copies its outputs
        into ``outputs``, or raises :class:`bcg.ReplayError` when it has none.
        A graph with keyed breakpoints computes their keys: when every
        breakpoint has a variant for its key, it launches one stitched graph
        (see :mod:`bcg.keyed.variants`).

        Arguments:
            live: what :func:`bcg.live` returns inside breakpoints.
            breakable: replay the breakable form even when the staged metadata
                fits (ranks that must agree: another rank's does not fit).
            stitch: allow one stitched launch (``False``: piecewise).
            fits_checked: the caller found ``would_fall_back(live)`` None just
                before, with this ``live``: ``fits`` is not asked again.
            launch_first: for a graph that :attr:`prepares_after_launch`:
                ``None`` lets it choose (it runs ``prepare`` first for a while
                after launches that returned with the GPU already at a gate;
                see :mod:`bcg.staged.staging`), ``True`` launches before ``prepare``,
                ``False`` runs ``prepare`` first; neither of these two counts
                toward that choice. Ignored by other graphs.

        Raises:
            VerificationError: an audit replay (``VariantPolicy.audit_every``)
                found a variant that differs from its eager call.
        """
        executor = self._executor
        parts = self._parts
        if executor is None:
            if parts.rerun is None:
                raise ReplayError(self._not_captured_message())
        elif (device := _current_device()) != parts.device:
            raise ReplayError(
                f"this graph was captured on cuda:{parts.device} but the current device is "
                f"cuda:{device}: replay it under torch.cuda.device({parts.device})"
            )
        if self._alarm:  # a storage the graph reads may have been replaced (see bcg.core.storages)
            check_alarm(self._alarm)
        stager = parts.stager if executor is not None else None  # eager mode: its rerun decides
        may_launch_first = False
        if stager is not None:
            reason = None if fits_checked else stager.misfit(live)
            if reason is None and breakable:
                reason = "another rank's metadata does not fit"
            if reason is not None:
                return self._replay_fallback(reason, live, stitch)
            may_launch_first = self._launches_first
            self._inline_replays += 1
        token = set_live(live)
        self._replaying += 1
        failed = True
        launched_first = False
        profiled = _profiler._is_profiler_enabled
        try:
            if parts.guards is not None:
                parts.guards.check()
            if parts.poison is not None:
                parts.poison.apply()
            if stager is not None:
                if may_launch_first and (stager.launch_first_now() if launch_first is None else launch_first):
                    launched_first = True
                    stager.before_launch()  # the previous replay's copies took their values
                else:
                    stager.prepare(live)  # host writes; the graph copies them in
            if executor is None:
                parts.rerun()  # type: ignore[misc]
            elif profiled:
                if self.variants is not None:
                    self.variants.begin_replay(live, stitch=False)
                self._run_profiled()
            elif self.variants is not None and (stitched := self.variants.begin_replay(live, stitch)) is not None:
                cudart.launch(stitched, _current_stream(device))  # every keyed step hit: one launch
            else:
                executor.run()
            failed = False
        finally:
            self._replaying -= 1
            reset_live(token)
            if stager is not None:
                if failed:
                    stager.settle()  # no gate left open, and no launched copy left waiting at one
                elif launched_first:  # the graph waits at its gates for these writes
                    # (a forced order, or the profiler's slower launches, does not count toward the choice)
                    stager.prepare_launched(live, choosing=launch_first is None and not profiled)
        return self.outputs

    def set_enabled(self, label: str, enabled: bool) -> bool:
        """Run (``True``) or skip (``False``) the node group ``label`` in the replays that follow.

        The group is the work captured inside :func:`bcg.switchable`
        blocks with that label, in every segment (and in the breakable form's,
        switched when it next replays: see :meth:`set_fallback`).
        A segment that skips groups replays an executable built without their
        nodes (see :mod:`bcg.core.trim`): the first time a set of groups is skipped,
        it is instantiated and uploaded (milliseconds), then kept until
        ``reset()``; later switches cost a few us. A segment that uses RNG
        (torch replays it), and a fallback's (see :meth:`set_fallback`),
        disables the nodes instead, about 1 us of host time per node, and each
        then runs as an empty node. Replays already queued
        are not affected.

        Returns whether every node of the group is now in the asked state:
        False when ``label`` is unswitchable (see ``switchable``), whose nodes
        always run, or when asked to skip on a graph without CUDA graphs (eager
        mode, not captured). Stitched launches (keyed breakpoints) always run
        the group.

        Raises:
            ReplayError: called while this graph replays (from a breakpoint).
        """
        if self._replaying:
            raise ReplayError("set_enabled was called during a replay of this graph: call it between replays")
        if self._executor is None:
            return enabled  # no captured CUDA graph (eager mode, not captured): the work runs
        done = self._switch(label, enabled)
        fallback = self.fallback
        if done and not enabled and fallback is not None and not fallback._can_skip(label):
            return False  # the breakable form always runs it
        return done

    def _can_skip(self, label: str) -> bool:
        return self._executor is not None and label not in self._parts.unswitchable

    def _follow(self, disabled: frozenset[str]) -> None:
        """Skip the groups ``disabled`` (those this graph can), run the others: a fallback
        brought to its inline form's state before it replays."""
        for label in sorted(self._disabled | disabled):
            self._switch(label, label not in disabled)

    def _switch(self, label: str, enabled: bool) -> bool:
        """:meth:`set_enabled` for this graph's own segments (all or none of them switched)."""
        if (label not in self._disabled) == enabled:
            return True
        if label in self._parts.unswitchable:
            return False
        disabled = self._disabled - {label} if enabled else self._disabled | {label}
        device = self._parts.device
        assert device is not None and self._executor is not None
        with torch.cuda.device(device):
            stream = _current_stream(device)
            try:
                for step in self.segments:
                    step.skip(disabled, stream)
                executor = self._executors.get(disabled)
                if executor is None:
                    executor = self._executors[disabled] = make_executor(self._plan, self._executor.name)
            except BaseException:
                for step in self.segments:  # back to the groups skipped before (built, or nodes)
                    step.skip(self._disabled, stream)
                raise
        self._executor, self._disabled = executor, disabled
        return True

    @property
    def prepares_after_launch(self) -> bool:
        """Whether inline replays may launch before running ``prepare`` (every staged breakpoint says
        ``prepare_after_launch=True`` and the plan is segments only). Whether one does is chosen
        per replay (see ``launch_first`` of :meth:`replay` and :mod:`bcg.staged.staging`)."""
        return self._launches_first

    def would_fall_back(self, live: Any) -> str | None:
        """Why a replay with ``live`` would run the breakable form (staged metadata that does not fit); else None."""
        stager = self._parts.stager
        return stager.misfit(live) if stager is not None else None

    def prepare_staged(self, live: Any) -> None:
        """Run the staged breakpoints' ``prepare`` for ``live`` and open their gates (what :meth:`replay`
        does before launching, or right after with ``prepare_after_launch``)."""
        if self._parts.stager is not None:
            self._parts.stager.prepare(live)

    def settle_staged(self) -> None:
        """After a step-by-step replay that raised (:mod:`bcg.verify`): close any gate left open
        with no queued copy to read it. Waits for the current stream."""
        if self._parts.stager is not None:
            self._parts.stager.settle()

    def would_stitch(self, live: Any, breakable: bool | None = None) -> bool:
        """Whether a replay with ``live`` would be one stitched launch (keyed breakpoints all hit;
        no side effect). ``breakable``: of the breakable form (True), of this graph (False), or
        of whichever the staged metadata picks (None)."""
        if breakable is None:
            breakable = self.would_fall_back(live) is not None
        graph = self.fallback if breakable else self
        return graph is not None and graph.variants is not None and graph.variants.would_stitch(live)

    def _replay_fallback(self, reason: str, live: Any, stitch: bool = True) -> Any:
        """The breakable form's replay, for metadata outside the staged bounds; outputs copied back."""
        if self.fallback is None:
            raise ReplayError(
                f"this replay's live metadata does not fit the graph's staged breakpoints ({reason}) and "
                "the graph has no breakable form: capture one (bcg.capture(..., inline=False) into "
                "graph.pool()) and attach it with graph.set_fallback(), or use bcg.make_graph / GraphRunner"
            )
        self._fallback_replays[reason] = self._fallback_replays.get(reason, 0) + 1
        fallback = self.fallback
        if fallback._disabled != self._disabled:
            fallback._follow(self._disabled)  # the groups set_enabled switched since it last replayed
        self._replaying += 1  # reset() must refuse while the fallback replays
        try:
            copy_outputs_into(self.outputs, fallback.replay(live, stitch=stitch), "the breakable form")
        finally:
            self._replaying -= 1
        return self.outputs

    def _run_profiled(self) -> None:
        """Replay with a ``record_function`` range per step (only while a profiler runs)."""
        for step in self._plan:
            label = f"bcg.segment[{step.index}]" if isinstance(step, SegmentStep) else f"bcg.breakpoint:{step.name}"
            with torch.profiler.record_function(label):
                step.launch()

    def _not_captured_message(self) -> str:
        if self._was_reset:
            return "this graph was reset: capture it again before replaying"
        return "this graph holds no capture yet: fill it with bcg.capture(graph) or bcg.make_graph()"

    # -- release -------------------------------------------------------------------------
    def reset(self) -> None:
        """Free segments, bridges, held arguments and storages, and the graph's share of its pool.

        Tensors the captured code returned (``outputs``) stay valid only as long
        as you hold them; their pool memory is returned when you drop them.
        The graph is reset at once; while a bcg capture is underway (on any
        thread) the freeing itself waits until it ends, since CUDA forbids
        destroying graphs during a capture. Dropping the last reference to a
        graph frees it the same way.

        Raises:
            ReplayError: a replay of this graph is in progress (``reset()`` called
                from one of its breakpoints, or from another thread while a
                breakpoint runs); nothing is freed.
        """
        if self._replaying:
            raise ReplayError(
                "reset() was called while this graph is replaying (from one of its breakpoints, or "
                "from another thread during a replay): freeing its segments now would let the "
                "replay launch destroyed graphs. Reset it after the replay returns; nothing was freed"
            )
        self._release()

    def _release(self) -> None:
        parts = self._parts
        device = parts.device if parts.mode == "graph" and self._executor is not None else None
        plan, variants, lease = self._plan, self.variants, self._lease
        if parts.held is not None:
            parts.held.release()
        self.variants = None
        self._lease = None
        self._alarm = []
        self._plan = ()
        self._executor = None
        self._launches_first = False
        self._parts = GraphParts(plan=(), capture_s=0.0)
        self.source = None
        fallback, self.fallback = self.fallback, None
        if fallback is not None:
            fallback.reset()
        self._inline_replays, self._fallback_replays = 0, {}
        self._disabled, self._executors = frozenset(), {}
        self.outputs = None
        self._was_reset = True

        def free() -> None:
            if device is not None:
                torch.cuda.synchronize(device)  # no queued replay may still read what is freed
            if variants is not None:
                variants.release()
            for step in plan:
                step.release()
            if lease is not None:
                lease.release()
            if device is not None:
                torch.cuda.empty_cache()  # the pool's now-free blocks go back to the driver

        release_when_safe(free)
        log.debug("bcg: graph reset")

    def describe(self) -> str:
        """A readable table of the plan: step, kind, name, nodes, bridge bytes; pool bytes last."""
        rows = [("step", "kind", "name", "kernel nodes", "nodes", "bridge bytes")]
        for i, step in enumerate(self._plan):
            if isinstance(step, SegmentStep):
                kernels = "-" if step.kernel_nodes is None else str(step.kernel_nodes)
                rows.append((str(i), "segment", f"segment[{step.index}]" + (" (rng)" if step.uses_rng else ""), kernels, str(step.nodes), ""))
            else:
                nbytes = step.bridges.nbytes if step.bridges is not None else 0
                rows.append((str(i), "breakpoint", step.name, "", "", str(nbytes)))
        widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        st = self.stats()
        lines.append(
            f"{st.segments} segments, {st.breakpoints} breakpoints, pool {st.pool_bytes / 2**20:.2f} MiB, "
            f"bridges {st.bridge_bytes / 2**20:.2f} MiB, captured in {st.capture_s:.3f} s ({st.mode} mode)"
        )
        return "\n".join(lines)

    def dump_dot(self, directory: str | os.PathLike[str]) -> list[str]:
        """Write one DOT file per segment (``cudaGraphDebugDotPrint``); return their paths."""
        if self._executor is None:
            raise ReplayError("dump_dot needs a graph captured in graph mode")
        os.makedirs(directory, exist_ok=True)
        paths = []
        for seg in self.segments:
            path = os.path.join(os.fspath(directory), f"segment_{seg.index:03d}.dot")
            cudart.dot_print(seg.graph_handle, path)
            paths.append(path)
        return paths

    def __repr__(self) -> str:
        state = "captured" if self.is_captured else ("reset" if self._was_reset else "empty")
        return (
            f"BreakableGraph({state}, mode={self.mode}, segments={self.num_segments}, "
            f"breakpoints={self.num_breakpoints})"
        )


def copy_outputs_into(dst: Any, src: Any, source: str) -> None:
    """Copy the result ``src`` (of ``source``: "an eager replay", ...) into the tensors of ``dst``.

    Raises :class:`bcg.ReplayError` when the structure, a shape or a dtype differs.
    """
    dst_leaves, dst_spec = pytree.tree_flatten(dst)
    src_leaves, src_spec = pytree.tree_flatten(src)
    if dst_spec != src_spec:
        raise ReplayError(
            f"{source} returned {src_spec}, but the capture returned {dst_spec}; graph mode "
            "returns the captured outputs, so the function must return the same structure every time"
        )
    for i, (d, s) in enumerate(zip(dst_leaves, src_leaves)):
        if isinstance(d, torch.Tensor):
            if not isinstance(s, torch.Tensor) or s.shape != d.shape or s.dtype != d.dtype:
                what = f"{tuple(s.shape)} {s.dtype}" if isinstance(s, torch.Tensor) else type(s).__name__
                raise ReplayError(
                    f"{source}: output {i} is {what} but was {tuple(d.shape)} {d.dtype} at capture; "
                    "graph mode's outputs have the captured shapes and dtypes"
                )
            d.copy_(s)
