"""The replay plan: an explicit list of steps, segment, breakpoint, segment, ...; and
:class:`Recording`, everything one capture hands to the graph that replays it.

Each step exposes ``launch``, a zero-argument callable that performs it on the
current stream. The plan holds strong references to everything a replay
touches (segment graphs, breakpoint arguments, bridges), so no address it
recorded can be handed to anybody else while the graph lives.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Union

import torch
from bcg.core.torch_internals import pytree

from bcg.core import cudart
from bcg.core.torch_internals import stream_readers
from bcg.core.breakpoint import BreakpointSpec
from bcg.core.bridge import BridgeSet
from bcg.core.process import on_release
from bcg.core.trim import trimmed_exec

log = logging.getLogger("bcg")

if TYPE_CHECKING:
    from bcg.core.debug import Guards, Poison
    from bcg.core.pool import PoolHandle, PoolLease
    from bcg.core.storages import HeldStorages


@dataclass(eq=False)
class SegmentStep:
    """One captured CUDA graph segment."""

    index: int
    cuda_graph: torch.cuda.CUDAGraph | None
    nodes: int
    kernel_nodes: int | None
    #: the segment drew random numbers when it ran at capture (torch replays it); False
    #: for a last segment only uploaded (``bcg.capture(compute_outputs=False)``)
    uses_rng: bool = False
    #: nodes recorded inside ``bcg.core.session.node_group(label)`` blocks, per label
    node_groups: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    #: the node groups replays skip now (see :meth:`skip`)
    skipped: frozenset[str] = frozenset()
    #: executables without some node groups: labels -> ``cudaGraphExec_t`` (see :mod:`bcg.core.trim`)
    trimmed: dict[frozenset[str], int] = field(default_factory=dict, repr=False)
    #: why this segment skips groups by disabling their nodes (RNG, a refused trimmed build, or a
    #: breakable form: see ``BreakableGraph.add_form``); None: it trims
    in_place: str | None = None
    #: ``(node, StagingBuffer)``: staging kernels whose parameters carry the buffer's value, set in
    #: the executable before each launch (see :mod:`bcg.staged.kernel`)
    staged: tuple[tuple[Any, Any], ...] = ()
    #: the copies a trimmed executable of a segment with :attr:`staged` was built from (CUDA names
    #: its nodes by them): labels -> ``(cudaGraph_t, the staged nodes in it)``
    trimmed_graphs: dict[frozenset[str], tuple[int, tuple[Any, ...]]] = field(default_factory=dict, repr=False)
    _free: Any = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.uses_rng:
            self.in_place = "it uses RNG: torch replays it"
        if self.cuda_graph is not None:  # freed when released or collected, never during a capture
            self._free = on_release(self, functools.partial(_free_segment, self.cuda_graph, self.trimmed,
                                                            self.trimmed_graphs))

    @property
    def _trims(self) -> bool:
        return bool(self.skipped) and self.in_place is None

    def _staged_now(self) -> list[tuple[Any, Any]]:
        """:attr:`staged` with each node as the executable replays launch now names it."""
        if self._trims and self.staged:
            nodes = self.trimmed_graphs[self.skipped][1]
            return [(node, buffer) for node, (_, buffer) in zip(nodes, self.staged)]
        return list(self.staged)

    @property
    def launch(self) -> Callable[[], None]:
        """The segment's launch on the current stream (its trimmed executable's, when it skips groups),
        its staged values set first."""
        assert self.cuda_graph is not None
        graph_exec, staged = self.exec_handle, self._staged_now()
        run: Callable[[], None] = self.cuda_graph.replay
        if self._trims:
            get_device, get_stream = stream_readers()
            run = lambda: cudart.launch(graph_exec, get_stream(get_device()))  # noqa: E731
        if not staged:
            return run

        def launch() -> None:
            for node, buffer in staged:
                buffer.stage.set_in(graph_exec, node)
            run()

        return launch

    def staged_updates(self) -> list[tuple[int, int, int]]:
        """``(executable, node, parameters address)`` per staged value: what the native replay
        sets before it launches the segment (see :attr:`staged`)."""
        graph_exec = self.exec_handle
        return [(graph_exec, int(node), buffer.stage.params_address) for node, buffer in self._staged_now()]

    def skip(self, labels: frozenset[str], stream: int) -> None:
        """Skip the node groups ``labels`` (those this segment has) in the replays that follow.

        The segment replays an executable without their nodes, built (and
        uploaded on ``stream``) the first time a set of groups is skipped and
        kept until :meth:`release`. A segment torch replays (RNG), one of a
        breakable form (``BreakableGraph.add_form``), or one whose build CUDA
        refused (logged), disables the nodes in its own executable instead
        (``cudaGraphNodeSetEnabled``: empty nodes). Executors read
        :attr:`exec_handle` and :attr:`launch` when built: rebuild them.
        """
        labels = frozenset(label for label in labels if self.node_groups.get(label))
        if labels == self.skipped:
            return
        if self.in_place is None and labels and labels not in self.trimmed:
            drop = list({int(node): node for label in sorted(labels) for node in self.node_groups[label]}.values())
            try:
                graph_exec, copy, kept = trimmed_exec(self.graph_handle, drop, stream,
                                                      keep=[node for node, _ in self.staged])
                self.trimmed[labels] = graph_exec
                if copy:
                    self.trimmed_graphs[labels] = (copy, kept)
            except RuntimeError as exc:  # a CUDA refusal (e.g. a node type cudaGraphClone does not copy)
                log.warning("bcg: segment %d: no executable without %s (%s); its nodes are disabled instead",
                            self.index, sorted(labels), exc)
                self.in_place = f"building its trimmed executable failed: {exc}"
                self._set_nodes(frozenset(), self.skipped)  # the executable runs every node; now switch them
        if self.in_place is not None:
            self._set_nodes(self.skipped, labels)
        self.skipped = labels

    def _set_nodes(self, before: frozenset[str], after: frozenset[str]) -> None:
        """Disable, in the segment's own executable, the nodes of the groups ``after`` skips and
        enable the others that ``before`` skipped (a node in several groups is off while any is);
        on failure, put back the nodes already switched."""
        graph_exec = int(self.cuda_graph.raw_cuda_graph_exec())  # type: ignore[union-attr]
        off = {int(node) for label in after for node in self.node_groups[label]}
        changed = {int(node): node for label in before ^ after for node in self.node_groups[label]}
        done: list[Any] = []
        try:
            for key, node in changed.items():
                cudart.set_node_enabled(graph_exec, node, key not in off)
                done.append(node)
        except BaseException:
            was_off = {int(node) for label in before for node in self.node_groups[label]}
            for node in done:
                cudart.set_node_enabled(graph_exec, node, int(node) not in was_off)
            raise

    @property
    def graph_handle(self) -> int:
        """The segment's ``cudaGraph_t`` (kept for inspection, stitching and trimming)."""
        assert self.cuda_graph is not None
        return int(self.cuda_graph.raw_cuda_graph())

    @property
    def exec_handle(self) -> int:
        """The ``cudaGraphExec_t`` replays launch (the trimmed one, when the segment skips groups)."""
        assert self.cuda_graph is not None
        if self._trims:
            return self.trimmed[self.skipped]
        return int(self.cuda_graph.raw_cuda_graph_exec())

    def release(self) -> None:
        """Free the executables and the graph (now, or once no capture is underway)."""
        if self._free is not None:
            self._free()
        self.trimmed, self.trimmed_graphs, self.skipped = {}, {}, frozenset()
        self.cuda_graph = None


def _free_segment(graph: torch.cuda.CUDAGraph, trimmed: dict[frozenset[str], int],
                  trimmed_graphs: dict[frozenset[str], tuple[int, tuple[Any, ...]]]) -> None:
    """A segment's graph and trimmed executables (an executable still in flight is freed once done)."""
    for graph_exec in trimmed.values():
        cudart.exec_destroy(graph_exec)
    trimmed.clear()
    for copy, _ in trimmed_graphs.values():
        cudart.graph_destroy(copy)
    trimmed_graphs.clear()
    graph.reset()


@dataclass(eq=False)
class BreakpointStep:
    """One eager breakpoint call with its captured arguments and its bridges."""

    spec: BreakpointSpec
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    bridges: BridgeSet | None = None
    index: int = 0
    #: a keyed breakpoint's variants (a :class:`bcg.keyed.variants.StepVariants`): replays
    #: dispatch through its ``run``
    variants: Any = field(default=None, repr=False)
    _run: Callable[[], None] | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def launch(self) -> Callable[[], None]:
        """The step's replay: its variants' dispatch when keyed, else :attr:`eager_launch`."""
        if self.variants is not None:
            return self.variants.run
        return self.eager_launch

    @property
    def eager_launch(self) -> Callable[[], None]:
        """The breakpoint's function on its held arguments, its result copied into the bridges."""
        if self._run is None:
            self._run = _make_runner(self)
        return self._run

    def call(self) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any] | None, Callable[[Any], None] | None, bool]:
        """``(fn, args, kwargs, on_result, always)``: the replay call without a wrapper.

        ``on_result(result)`` refreshes the bridges; it must run when the
        result is not None, or always when the capture returned tensors or
        values (so a ``None`` at replay is reported as a mismatch). A keyed
        step's call is its variants' dispatch.
        """
        if self.variants is not None:
            return self.variants.run, (), None, None, False
        return self.eager_call()

    def eager_call(self) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any] | None, Callable[[Any], None] | None, bool]:
        """:meth:`call` of the breakpoint's function itself (a keyed step's too)."""
        bridges = self.bridges
        on_result = bridges.refresh if bridges is not None else None
        always = bridges is not None and not bridges.empty
        return self.spec.fn, tuple(self.args), dict(self.kwargs) or None, on_result, always

    def release(self) -> None:
        self.args, self.kwargs, self.bridges, self._run, self.variants = (), {}, None, None, None


def _make_runner(step: BreakpointStep) -> Callable[[], None]:
    """The replay call of ``step`` as a closure (the Python executor's and the profiler's)."""
    fn, args, kwargs, on_result, always = step.eager_call()
    kw = kwargs or {}
    if on_result is None:
        return functools.partial(fn, *args, **kw)
    if always:
        return lambda: on_result(fn(*args, **kw))

    def run() -> None:
        result = fn(*args, **kw)
        if result is not None:
            on_result(result)  # raises the mismatch: the capture returned None

    return run


Step = Union[SegmentStep, BreakpointStep]


def breakpoint_tensors(plan: Sequence[Step]) -> list[torch.Tensor]:
    """The tensors the plan's breakpoint steps hold as arguments (what a replay passes them)."""
    return [
        t for step in plan if isinstance(step, BreakpointStep)
        for t in pytree.tree_leaves((step.args, step.kwargs)) if isinstance(t, torch.Tensor)
    ]


@dataclass
class Recording:
    """What one capture (or an eager-mode recording) produced: one form of a graph.

    ``plan``: the steps in stream order. ``lease``: the graph's pool lease on ``pool``
    (released with the graph). ``rerun``: eager mode's replay (re-runs the
    function). ``guards``/``poison``: the debugging aids checked before each
    replay. ``staged_breakpoints``: the staged breakpoints captured inline, which a replay
    asks and prepares before launching (a :class:`bcg.staged.staging.StagedBreakpoints`;
    None or empty: none). ``stage_at``: the plan index where the staged copies begin (a
    replay launches the steps before it, prepares, then launches the rest; None or 0: it
    prepares first, see ``CaptureOptions.split_staged``). ``always_run``: labels of node groups
    that cannot be disabled (their nodes always run). ``held``: the storages
    outside the pool that the segments read (see :mod:`bcg.core.storages`).
    """

    plan: Sequence[Step]
    capture_s: float
    mode: str = "graph"
    pool: PoolHandle | None = None
    device: int | None = None
    lease: PoolLease | None = None
    rerun: Callable[[], None] | None = None
    guards: Guards | None = None
    poison: Poison | None = None
    staged_breakpoints: Any = None
    stage_at: int | None = None
    always_run: frozenset[str] = frozenset()
    held: HeldStorages | None = None

    def release(self) -> None:
        """Stop checking the held storages, release the steps and the pool lease (idempotent)."""
        if self.held is not None:
            self.held.release()
        for step in self.plan:
            step.release()
        if self.lease is not None:
            self.lease.release()


@dataclass(frozen=True)
class GraphSource:
    """The function and static arguments a graph was captured from; calling it runs them eagerly."""

    fn: Callable[..., Any]
    static_args: tuple[Any, ...] = field(default=())

    def __call__(self) -> Any:
        return self.fn(*self.static_args)
