"""``bcg.BreakableGraph``: a captured plan of segments and breakpoints, and its replay."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.autograd.profiler as _profiler

from bcg import cudart
from bcg.capture import capture_lock
from bcg.debug import Guards, Poison
from bcg.errors import ReplayError
from bcg.live import _UNSET, reset_live, set_live
from bcg.memory import PoolHandle, PoolAnchor, pool_bytes
from bcg.plan import BreakpointStep, SegmentStep, Step
from bcg.replay import Executor, make_executor, stream_readers

_current_device, _ = stream_readers()

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
    graph's pool.
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


class BreakableGraph:
    """Segments of CUDA graphs with eager breakpoints between them.

    Fill it with ``with bcg.capture(graph): ...`` or build it with
    :func:`bcg.make_graph`, then call :meth:`replay`. Replays run on the current
    stream and must be issued on the device the graph was captured on.
    """

    def __init__(self) -> None:
        self._plan: tuple[Step, ...] = ()
        self._executor: Executor | None = None
        self._mode = "graph"
        self._pool: PoolHandle | None = None
        self._device: int | None = None
        self._capture_s = 0.0
        self._was_reset = False
        self._rerun: Callable[[], None] | None = None
        self._pool_ref: PoolAnchor | None = None
        self._keepalive: list[torch.cuda.CUDAGraph] = []
        self._guards: Guards | None = None
        self._poison: Poison | None = None
        self._fn: Callable[..., Any] | None = None
        self._static_args: tuple[Any, ...] = ()
        self._replaying = 0  # replays in progress (a breakpoint may reset, or another thread)
        self._held_bytes = 0
        self.outputs: Any = None

    # -- filled by capture / make_graph ----------------------------------------------
    def _install(
        self,
        plan: Sequence[Step],
        *,
        pool: PoolHandle | None,
        device: int | None,
        capture_s: float,
        mode: str = "graph",
        rerun: Callable[[], None] | None = None,
        pool_ref: PoolAnchor | None = None,
        keepalive: Sequence[torch.cuda.CUDAGraph] = (),
        guards: Guards | None = None,
        poison: Poison | None = None,
        held_bytes: int = 0,
    ) -> None:
        self._held_bytes = held_bytes
        self._guards = guards if guards else None
        self._poison = poison
        self._plan = tuple(plan)
        if self._pool_ref is not None and self._pool_ref is not pool_ref:
            self._pool_ref.release()  # held since an abandoned capture
        self._pool_ref = pool_ref
        self._keepalive = list(keepalive)
        self._mode = mode
        self._pool = pool
        self._device = device
        self._capture_s = capture_s
        self._rerun = rerun
        self._was_reset = False
        self._executor = make_executor(self._plan) if mode == "graph" else None

    def use_executor(self, name: str | None) -> None:
        """Replay with ``"python"`` or ``"native"`` (``None``: the best available, as by default)."""
        if self._mode != "graph" or self._executor is None:
            raise ReplayError("use_executor applies to a captured graph in graph mode")
        self._executor = make_executor(self._plan, name)

    @property
    def executor(self) -> str:
        """Which executor replays this graph (``"python"`` or ``"native"``)."""
        return self._executor.name if self._executor is not None else "none"

    def _hold_pool(self, anchor: PoolAnchor) -> None:
        """Keep a caller's pool counted after an abandoned capture (released by reset())."""
        if self._pool_ref is not None and self._pool_ref is not anchor:
            self._pool_ref.release()
        self._pool_ref = anchor

    # -- inspection ---------------------------------------------------------------------
    @property
    def is_captured(self) -> bool:
        return self._executor is not None or self._rerun is not None

    @property
    def mode(self) -> str:
        """``"graph"`` (CUDA graph segments) or ``"eager"`` (re-runs the function)."""
        return self._mode

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
        return self._device

    def pool(self) -> PoolHandle:
        """The private memory pool token; pass it as ``pool=`` to share it with another graph."""
        if self._pool is None:
            raise ReplayError("this graph has no memory pool: capture it first")
        return self._pool

    def stats(self) -> GraphStats:
        """Segments, breakpoints, per-segment work, pool and bridge bytes, capture seconds."""
        segments = self.segments
        graph_mode = self._mode == "graph"
        pool = pool_bytes(self._pool, self._device) if graph_mode else 0
        return GraphStats(
            mode=self._mode,
            segments=len(segments),
            breakpoints=self.num_breakpoints,
            kernel_nodes=tuple(s.kernel_nodes or 0 for s in segments) if graph_mode else None,
            aten_ops=None if graph_mode else tuple(s.nodes for s in segments),
            pool_bytes=pool,
            bridge_bytes=sum(b.bridges.nbytes for b in self.breakpoints if b.bridges is not None),
            capture_s=self._capture_s,
            held_bytes=self._held_bytes,
            pool_bytes_floor_estimate=max(pool - self._held_bytes, 0),
        )

    # -- replay -------------------------------------------------------------------------
    def replay(self, live: Any = _UNSET) -> Any:
        """Run segment, breakpoint, segment, ... on the current stream.

        ``live`` is what :func:`bcg.live` returns inside breakpoints during this
        replay. Returns ``outputs`` (set by :func:`bcg.make_graph`; ``None`` for
        the context-manager form, whose outputs are the tensors the captured
        code returned). A breakpoint that raises stops the replay; the graph
        stays replayable.
        """
        if self._executor is None:
            if self._rerun is None:
                raise ReplayError(self._not_captured_message())
        elif (device := _current_device()) != self._device:
            raise ReplayError(
                f"this graph was captured on cuda:{self._device} but the current device is "
                f"cuda:{device}: replay it under torch.cuda.device({self._device})"
            )
        return self._replay_unchecked(live)

    def _replay_unchecked(self, live: Any = _UNSET) -> Any:
        """:meth:`replay` for a caller that has checked capture state and device (GraphRunner)."""
        if self._guards is not None:
            self._guards.check()
        if self._poison is not None:
            self._poison.apply()
        executor = self._executor
        token = set_live(live) if live is not _UNSET else None
        self._replaying += 1
        try:
            if executor is not None:
                if _profiler._is_profiler_enabled:
                    self._run_profiled()
                else:
                    executor.run()
            else:
                assert self._rerun is not None
                self._rerun()
        finally:
            self._replaying -= 1
            if token is not None:
                reset_live(token)
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
        """Free segments, bridges, held arguments and the graph's share of its pool.

        Tensors the captured code returned (``outputs``) stay valid only as long
        as you hold them; their pool memory is returned when you drop them.

        Raises:
            ReplayError: a replay of this graph is in progress (``reset()`` called
                from one of its breakpoints, or from another thread while a
                breakpoint runs); nothing is freed.
        """
        with capture_lock():  # synchronizing and freeing would invalidate another thread's capture
            if self._replaying:
                raise ReplayError(
                    "reset() was called while this graph is replaying (from one of its breakpoints, or "
                    "from another thread during a replay): freeing its segments now would let the "
                    "replay launch destroyed graphs. Reset it after the replay returns; nothing was freed"
                )
            self._release()

    def _release(self) -> None:
        graph_mode = self._mode == "graph" and self._executor is not None
        if graph_mode and torch.cuda.is_available():
            torch.cuda.synchronize(self._device)  # no replay may still be reading what we free
        for step in self._plan:
            step.release()
        self._plan = ()
        self._executor = None
        self._rerun = None
        self._guards = None
        self._poison = None
        self._fn, self._static_args = None, ()
        self._held_bytes = 0
        for empty in self._keepalive:
            empty.reset()
        self._keepalive = []
        if self._pool_ref is not None:
            self._pool_ref.release()
            self._pool_ref = None
        self.outputs = None
        self._was_reset = True
        if graph_mode and torch.cuda.is_available():
            torch.cuda.empty_cache()  # return the pool's now-free blocks to the driver
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
        if self._mode != "graph" or self._executor is None:
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
            f"BreakableGraph({state}, mode={self._mode}, segments={self.num_segments}, "
            f"breakpoints={self.num_breakpoints})"
        )
