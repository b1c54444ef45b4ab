"""The capture machinery: one capture, recorded as segments split at breakpoints.

Each segment is a ``torch.cuda.CUDAGraph`` captured with ``capture_begin`` /
``capture_end`` on one capture stream into one private memory pool, so torch's
caching allocator and RNG bookkeeping stay in charge. Right after a segment is
captured it is instantiated, uploaded and replayed once, so the breakpoint that
follows runs on real data and the capture itself computes a correct forward.
:class:`Capture` records one capture into a :class:`bcg.core.plan.Recording`;
``bcg.capture`` and the runner hand that to a graph.
"""

from __future__ import annotations

import contextlib
import logging
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch
from bcg.core.torch_internals import pytree

from bcg.core import cudart
from bcg.core.args import check_choice
from bcg.core.breakpoint import (
    ACTIVE,
    NOT_INLINE,
    UNSET,
    BreakpointSpec,
    Recorder,
    crossing_tensors,
    reset_live,
    set_live,
    tensor_leaves,
)
from bcg.core.bridge import BridgeSet
from bcg.core.compiled import CompileWatch
from bcg.core.debug import Debug, Guards, Poison
from bcg.core.plan import BreakpointStep, Recording, SegmentStep, Step
from bcg.core.pool import (
    PoolHandle, PoolLease, PoolMembership, SegmentGraph, SegmentMap, begin_capture_into, graph_pool_handle,
    reset_rng_capture_state,
)
from bcg.core.process import capture_lock, capture_stream, capturing, release_when_safe
from bcg.core.rng import GeneratorWatch
from bcg.core.storages import StorageWatch
from bcg.core.torch_internals import clear_cublas_workspaces, end_allocate_to_pool
from bcg.errors import (
    BcgError,
    CaptureError,
    CaptureInvalidatedError,
    HostSyncInCaptureError,
    NestedCaptureError,
    StreamForkError,
    add_note,
    user_frame,
    user_line,
)

log = logging.getLogger("bcg")

CAPTURE_ERROR_MODES = ("global", "thread_local", "relaxed")

# CUDA's texts for the ways a capture is invalidated (cudaGetErrorString), by cause.
_HOST_SYNC_HINTS = (
    "operation not permitted when stream is capturing",
    "operation not permitted on an event last recorded in a capturing stream",
    "cudaErrorStreamCaptureUnsupported",
    "cudaErrorCapturedEvent",
    "stream is capturing",
    "graph capture",
    "error during capture",
    "operation not permitted",
)
_UNCAPTURED_DEPENDENCY = ("dependency created on uncaptured work in another stream", "cudaErrorStreamCaptureIsolation")
_LEGACY_STREAM = ("would make the legacy stream depend on a capturing blocking stream", "cudaErrorStreamCaptureImplicit")
_EARLIER_ERROR = ("operation failed due to a previous error during capture", "cudaErrorStreamCaptureInvalidated")


@contextlib.contextmanager
def node_group(label: str) -> Iterator[None]:
    """Make the CUDA work of the block, where a capture records it, the node group ``label``:
    :meth:`BreakableGraph.set_enabled` turns the group off (and on) for the replays that follow.

    Outside a capture (eager runs, warm-ups) the block simply runs. Use it for
    work that some replays do not need and that no enabled node depends on
    when it is off (the runner's padded-row zeroing, when nothing is padded).

    .. warning::
        Only kernel, memcpy and memset nodes can be disabled. A block that
        records other nodes (events, child graphs) or a staged breakpoint's copy
        (every replay writes it), or in which a segment ends (a breakpoint,
        ``graph_break()``), makes the group ``label`` always run for the whole graph:
        its nodes always run and ``set_enabled`` returns False.
    """
    session = ACTIVE.get()
    if isinstance(session, CaptureSession):
        with session.node_group(label):
            yield
    else:
        yield


@dataclass(frozen=True)
class _Fork:
    """Side-stream work a segment left unjoined, which bcg joined at the segment's end."""

    segment: int
    before: str  # what ended the segment: "breakpoint 'attn'", "bcg.graph_break()"
    nodes: int


class CaptureSession(Recorder):
    """The state of one capture in progress (the active recorder while it runs)."""

    def __init__(
        self,
        pool: PoolHandle,
        stream: torch.cuda.Stream,
        capture_error_mode: str,
        device: int,
        staged_breakpoints: Any,
        after_breakpoint: Callable[[list[torch.Tensor]], None] | None = None,
        owns_pool: bool = True,
        inline: bool = True,
        replay_stream: torch.cuda.Stream | None = None,
        barrier: Callable[[], None] | None = None,
        split_staged: bool = False,
        owner: str = "a bcg graph",
        generators: tuple[torch.Generator, ...] = (),
    ) -> None:
        super().__init__()
        self._barrier = barrier
        self.split_staged = split_staged
        self.inline = inline
        self.replay_stream = replay_stream if replay_stream is not None else stream
        self.staged_breakpoints = staged_breakpoints  # records them inline (a bcg.staged.staging.StagedBreakpoints)
        self.pool = pool
        self.owns_pool = owns_pool
        self.lease = PoolLease(device, pool, stream, owner)
        self._membership = PoolMembership(pool, device)
        self._after_breakpoint = after_breakpoint
        self.stream = stream
        self.stream_handle = int(stream.cuda_stream)
        self.capture_error_mode = capture_error_mode
        self.device = device
        self.plan: list[Step] = []
        self.forks: list[_Fork] = []
        self._current: torch.cuda.CUDAGraph | None = None
        self._segment_index = 0
        self._breakpoint_index = 0
        # registered with each segment's graph (torch registers the default generator itself)
        self._generators = generators
        # the generators segments draw from: a segment that moved one is replayed through torch
        self.rng = GeneratorWatch(device, generators, recording=self.recording_segment)
        self._group_nodes: dict[str, list[Any]] = {}  # the open segment's node groups' nodes, per label
        self._staged_nodes: list[tuple[Any, Any]] = []  # the open segment's (node, StagingBuffer) pairs
        self.always_run: set[str] = set()  # labels with a block that cannot be switched off
        self.stage_at: int | None = None  # the plan index the staged copies start at (see staging_point)
        self.broken: str | None = None  # a breakpoint raised: the capture is abandoned, even if that was caught
        # the storages outside the pool that captured operations read (see bcg.core.storages)
        segment_map = SegmentMap([pool], self.lease)
        self.watch = StorageWatch(segment_map.external, recording=self.recording_segment, writers=segment_map.writers)

    def recording_segment(self) -> bool:
        """Whether a segment is open (its operations are captured; not a breakpoint's eager run)."""
        return self._current is not None

    @property
    def segment_label(self) -> str:  # type: ignore[override]
        return f"graph segment {self._segment_index}"

    # -- segments ---------------------------------------------------------------------------
    def open_segment(self) -> None:
        graph = SegmentGraph(keep_graph=True)
        for generator in self._generators:
            graph.register_generator_state(generator)
        _begin_capture(graph, self.pool, self.capture_error_mode, self.stream, self._generators)
        self.rng.reset()
        self._current = graph
        self._group_nodes = {}
        self._staged_nodes = []

    def close_segment(self, before: str = "the end of the capture", run: bool = True) -> None:
        """End the open segment; keep it (instantiated, uploaded, run once unless ``run`` is
        False) unless empty."""
        graph = self._current
        if graph is None or self.broken is not None:
            raise self._abandoned()
        current = torch.cuda.current_stream(self.device)
        if current != self.stream:  # (torch's capture_end would refuse: it must end where it began)
            raise StreamForkError(
                f"{before} was reached while the current stream is {current}, not the capture stream "
                f"{self.stream}: a segment ends on the stream it began on. Join the side stream "
                "(torch.cuda.current_stream().wait_stream(side) after its `with torch.cuda.stream(side)` "
                "block) and reach the breakpoint on the capture stream"
            )
        joined = cudart.join_forked_work(self.stream_handle)
        if joined:
            self.forks.append(_Fork(self._segment_index, before, joined))
            log.debug("segment %d: joined %d node(s) forked to side streams before %s", self._segment_index, joined, before)
        _end_capture(graph)
        self._current = None
        handle = int(graph.raw_cuda_graph())
        counts = cudart.node_type_counts(handle)
        nodes = sum(counts.values())
        if nodes == 0:
            # Consecutive breakpoints: no launch. Kept (not reset) until the graph is,
            # since resetting drops a count on the pool (see PoolLease).
            self.lease.keep(graph)
            self._vote()
            return
        try:
            graph.instantiate()
            self._vote()
        except BaseException:
            self.lease.keep(graph)  # never launched; freed with the capture's lease
            raise
        offsets = self.rng.offsets()
        if run:
            self._capture_run(graph)
        else:
            cudart.upload(int(graph.raw_cuda_graph_exec()), int(self.replay_stream.cuda_stream))
        step = SegmentStep(
            index=self._segment_index,
            cuda_graph=graph,
            nodes=nodes,
            kernel_nodes=counts["kernel"],
            uses_rng=self.rng.moved(offsets),
            node_groups={label: tuple(group) for label, group in self._group_nodes.items()},
            staged=tuple(self._staged_nodes),
        )
        self._segment_index += 1
        self.plan.append(step)
        log.debug("segment %d: %d nodes (%d kernels)", step.index, nodes, step.kernel_nodes)

    def _vote(self) -> None:
        """The ranks' vote at a segment's end (``barrier``), right before its first launch, which
        may run collectives: once a rank's capture failed, no rank launches anything more.
        Every segment votes, empty ones too, so healthy ranks cast the same votes."""
        if self._barrier is not None:
            self._barrier()

    def _capture_run(self, graph: torch.cuda.CUDAGraph) -> None:
        """The segment's first launch, so that the breakpoint after it reads real data.

        It runs on the stream replays will use (the caller's, when the capture
        began), ordered between the capture stream's work before and after it:
        an executable uploaded or launched on one stream costs more at every
        later launch on another, and its first launch uploads it where it will run.
        """
        if self.replay_stream == self.stream:
            graph.replay()
            return
        self.replay_stream.wait_stream(self.stream)
        with torch.cuda.stream(self.replay_stream):
            graph.replay()
        self.stream.wait_stream(self.replay_stream)

    @contextlib.contextmanager
    def node_group(self, label: str) -> Iterator[None]:
        """Record the nodes the block adds to the open segment as group ``label`` (see :func:`node_group`)."""
        graph = self._current
        mark = cudart.CaptureMark(self.stream_handle) if graph is not None else None
        copies = self.staged_breakpoints.copies
        yield
        if graph is None or self._current is not graph:
            self.always_run.add(label)
            log.debug("bcg: node_group(%r) ran outside one segment: its nodes always run", label)
            return
        if self.staged_breakpoints.copies != copies:
            self.always_run.add(label)
            log.debug("bcg: node_group(%r) holds a staged breakpoint's copy, which every replay's prepare "
                      "writes: its nodes always run", label)
            return
        assert mark is not None
        added = mark.added()
        if added is None:
            self.always_run.add(label)
            log.debug("bcg: node_group(%r) recorded work bcg cannot tell apart from the work before it "
                      "(another stream's, not joined back in the block): its nodes always run", label)
            return
        kinds = {cudart.node_type(n) for n in added}
        if not kinds <= cudart.DISABLEABLE_NODE_TYPES:
            self.always_run.add(label)
            log.debug("bcg: node_group(%r) recorded %s nodes, which CUDA cannot disable: its nodes always run",
                      label, ", ".join(sorted(kinds - cudart.DISABLEABLE_NODE_TYPES)))
            return
        group = self._group_nodes.setdefault(label, [])
        known = {int(n) for n in group}
        group.extend(n for n in added if int(n) not in known)  # a nested block of the same label

    # -- Recorder -----------------------------------------------------------------------------
    def on_breakpoint(self, spec: BreakpointSpec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.close_segment(f"breakpoint {spec.name!r}")
        try:
            with self.watch.paused():  # (nothing of it is captured)
                result = self.run_breakpoint(spec.capture_stub or spec.fn, args, kwargs)
        except BaseException as exc:
            self.broken = f"breakpoint {spec.name!r} raised {type(exc).__name__}"
            add_note(exc, f"bcg: raised by breakpoint {spec.name!r} during capture; the capture was abandoned")
            raise
        with self.lease.allocating():
            bridges = BridgeSet(spec.name, result, args, kwargs)
        caller_result = bridges.caller_result()
        crossing = crossing_tensors(bridges.tensors(), spec, args, kwargs)
        # Pool-resident arguments and bridges held through non-owning aliases (see bcg.core.pool)
        bridges.hold_through(self._membership.release)
        held_args, held_kwargs = self._membership.release((args, dict(kwargs)))
        self.plan.append(
            BreakpointStep(spec=spec, args=held_args, kwargs=held_kwargs, bridges=bridges, index=self._breakpoint_index)
        )
        self._breakpoint_index += 1
        log.debug("breakpoint %r after segment %d", spec.name, self._segment_index - 1)
        self.open_segment()
        if self._after_breakpoint is not None:
            self._after_breakpoint(crossing)  # captured at the start of the next segment
        return caller_result

    def on_staged(self, spec: BreakpointSpec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A staged breakpoint, inline: its ``prepare``'s uploads and its kernels join the segment."""
        if not self.inline:
            return self.on_breakpoint(spec, args, kwargs)
        if self.broken is not None:
            raise self._abandoned()
        try:
            result = self.staged_breakpoints.record(self, spec, args, kwargs)
        except BaseException as exc:
            self.broken = f"staged breakpoint {spec.name!r} raised {type(exc).__name__}"
            add_note(exc, f"bcg: raised by staged breakpoint {spec.name!r}, captured inline; the capture was abandoned")
            raise
        if result is NOT_INLINE:
            return self.on_breakpoint(spec, args, kwargs)
        if self._after_breakpoint is not None:
            self._after_breakpoint(crossing_tensors(tensor_leaves(result), spec, args, kwargs))
        return result

    def staged_node(self, node: Any, buffer: Any) -> None:
        self._staged_nodes.append((node, buffer))

    def _abandoned(self) -> CaptureError:
        """The error for a capture a breakpoint's exception abandoned inside the block."""
        why = self.broken or "a breakpoint raised"
        return CaptureError(
            f"bcg.capture: {why} during capture and the exception was caught inside the capture block. "
            "A breakpoint that raises abandons the capture (the work after it was not captured): let the "
            "exception leave the `with` block, or make the breakpoint not raise at capture"
        )

    def on_graph_break(self) -> None:
        self.close_segment("bcg.graph_break()")
        self.open_segment()

    def staging_point(self) -> None:
        """End the segment before the first staged copy (``split_staged``): a replay launches the
        steps before it, then runs the staged ``prepare`` functions while the GPU works, then
        launches the rest (``Recording.stage_at``)."""
        if not self.split_staged or self.stage_at is not None or self._current is None:
            return
        self.close_segment("the first staged breakpoint's copies")
        self.stage_at = len(self.plan)
        self.open_segment()

    def pool_resident_tensors(self) -> list[torch.Tensor]:
        """The breakpoint arguments and bridges the plan holds that live in the pool, each once."""
        membership = PoolMembership(self.pool, self.device)
        held: dict[int, torch.Tensor] = {}
        for step in self.plan:
            if isinstance(step, BreakpointStep):
                bridges = step.bridges.tensors() if step.bridges is not None else []
                for t in pytree.tree_leaves((step.args, step.kwargs, bridges)):
                    if isinstance(t, torch.Tensor) and membership.contains(t):
                        held.setdefault(id(t), t)
        return list(held.values())

    # -- failure ------------------------------------------------------------------
    def abort(self) -> None:
        """Leave CUDA clean: no stream capturing, pool references dropped, segments freed."""
        graph, self._current = self._current, None
        if graph is not None:
            with contextlib.suppress(Exception):  # side-stream work left unjoined would fail capture_end
                cudart.join_forked_work(self.stream_handle)
            unwind_capture(graph, self.stream, self.device, self.pool, self._generators)
            graph.reset()
        for step in self.plan:
            step.release()
        self.plan.clear()
        if self.owns_pool:
            self.lease.release()
            release_when_safe(torch.cuda.empty_cache)  # an abandoned pool of our own goes back to the driver


@dataclass(frozen=True)
class CaptureOptions:
    """How one capture runs (what ``bcg.capture`` takes, and what only make_graph and the runner set).

    Arguments:
        pool, stream, capture_error_mode: as in ``torch.cuda.graph``; default
            pool: a new one; default stream: bcg's capture stream of the device.
        live: what :func:`bcg.live` returns inside breakpoints during capture.
        debug: :class:`bcg.Debug` aids checked before every replay (default:
            the ``BCG_GUARDS``/``BCG_POISON`` environment).
        inputs: the static inputs (make_graph's), guarded with ``debug.guards``.
        inline: staged breakpoints captured inline (False: the breakable form).
        after_breakpoint: called inside the segment after each breakpoint with
            the tensors crossing it (the runner's padded-row zeroing).
        barrier: called at each segment's end, before its first launch (ranks' votes).
        compute_outputs: run the last segment once at the capture's end
            (False uploads it only: outputs hold their values from the first replay).
        watch: hold the storages outside the pool that the segments read (False:
            another form of the same graph, captured from the same code, holds them).
        generators: CUDA generators (or their ``graphsafe_get_state()``) registered with every
            segment, as ``CUDAGraph.register_generator_state`` registers them.
        split_staged: end the segment before the first staged copy, so a replay
            prepares while the GPU runs the work before it. Only where the graph
            has, or could have, a breakable form (make_graph, the runner), whose
            segments end at every staged breakpoint: the split then asks nothing
            more of the code (no side stream forked before it and joined after
            it, as at any breakpoint).
    """

    pool: PoolHandle | None = None
    stream: torch.cuda.Stream | None = None
    capture_error_mode: str = "global"
    live: Any = UNSET
    debug: Debug | None = None
    inputs: Any = None
    inline: bool = True
    after_breakpoint: Callable[[list[torch.Tensor]], None] | None = None
    barrier: Callable[[], None] | None = None
    compute_outputs: bool = True
    watch: bool = True
    split_staged: bool = False
    generators: tuple[torch.Generator, ...] = ()

    def __post_init__(self) -> None:
        # (the entry points check it first, in their own name: bcg.capture.check_capture_options)
        check_choice("bcg.core.session.CaptureOptions", "capture_error_mode", self.capture_error_mode,
                     CAPTURE_ERROR_MODES)


class Capture:
    """One capture, as a context manager around the code it records: after a clean exit,
    :attr:`recording` holds what it produced (a failure raises, with CUDA state clean).

    Arguments:
        options: see :class:`CaptureOptions`.
        staged_breakpoints: records staged breakpoints inline (a :class:`bcg.staged.staging.StagedBreakpoints`).

    .. warning::
        Process-wide for the capture's duration: captures are serialized (a
        second thread's capture waits), Python's cycle collector is paused,
        Inductor's own CUDA graphs are off (see :mod:`bcg.core.compiled`), and
        bcg's frees of CUDA graph resources wait (see :mod:`bcg.core.process`).
    """

    def __init__(self, options: CaptureOptions, staged_breakpoints: Any) -> None:
        self.options = options
        self._staged_breakpoints = staged_breakpoints
        self.debug = options.debug if options.debug is not None else Debug.from_env()
        self.recording: Recording | None = None
        #: an abandoned capture into a caller's pool leaves its lease here: the graph holds it, so the
        #: pool stays usable for the next capture (torch refuses a pool whose count dropped to zero)
        self.failed_lease: PoolLease | None = None
        self._session: CaptureSession | None = None

    def __enter__(self) -> Capture:
        options = self.options
        if not torch.cuda.is_available():
            raise CaptureError(
                "bcg.capture needs a CUDA GPU and a CUDA build of torch; none is available. "
                "To run the same code with the same breakpoint structure eagerly, use "
                "bcg.make_graph(fn, *args, mode='eager')."
            )
        if ACTIVE.get() is not None or torch.cuda.is_current_stream_capturing():
            raise NestedCaptureError(
                "bcg.capture was entered while another capture is underway; captures cannot "
                "nest: finish (exit) the outer capture first"
            )
        cudart.runtime()  # fail early and clearly if cuda-python is missing
        device = torch.cuda.current_device()
        for g in options.generators:  # (torch would register another device's generator with the graph)
            if g.device.index is not None and g.device.index != device:
                raise CaptureError(
                    f"a generator registered with the graph is on {g.device}, and the capture records "
                    f"cuda:{device}: capture on {g.device} (torch.cuda.set_device), or into a new BreakableGraph "
                    "with the capture device's generators registered"
                )
        stream = options.stream if options.stream is not None else capture_stream(device)
        if stream == torch.cuda.default_stream(device):
            raise CaptureError("bcg.capture cannot capture on the default stream: pass a torch.cuda.Stream()")
        lock = capture_lock()
        if not lock.acquire(blocking=False):
            log.debug("bcg.capture: waiting for another thread's capture to end")
            lock.acquire()
        try:
            self._capturing = capturing()  # frees asked for from now on wait until the capture ends
            self._capturing.__enter__()
        finally:
            lock.release()  # (held on by capturing())
        try:
            torch.cuda.synchronize(device)
            # As torch.cuda.graph does: blocks cached for eager work (the warm-up's) go back to
            # the driver, so the capture's private pool can have that memory.
            torch.cuda.empty_cache()
            pool = options.pool if options.pool is not None else graph_pool_handle()
            self._ambient = torch.cuda.current_stream(device)
            stream.wait_stream(self._ambient)
            self._session = CaptureSession(
                pool, stream, options.capture_error_mode, device, self._staged_breakpoints,
                options.after_breakpoint, owns_pool=options.pool is None, inline=options.inline,
                replay_stream=self._ambient,
                barrier=options.barrier, split_staged=options.split_staged, owner=_owner(),
                generators=options.generators,
            )
        except BaseException:
            self._capturing.__exit__(None, None, None)
            raise
        session = self._session
        self._stream_ctx = torch.cuda.stream(stream)
        self._stream_ctx.__enter__()
        self._active_token = ACTIVE.set(session)
        self._live_token = set_live(options.live)
        self._compile_watch = CompileWatch().__enter__()
        self._watch: StorageWatch | None = session.watch if options.watch else None
        if self._watch is not None:
            self._watch.__enter__()
        self._rng = session.rng
        self._rng.__enter__()
        self._t0 = time.perf_counter()
        try:
            session.open_segment()
        except BaseException as exc:
            self._fail(session, exc)
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        session = self._session
        assert session is not None
        self._session = None
        if exc is None:
            try:
                session.close_segment(run=self.options.compute_outputs)
            except BaseException as close_exc:
                raise self._abandon(session, close_exc) from close_exc
            capture_s = time.perf_counter() - self._t0
            compiled = self._compile_watch.message()
            if compiled is not None:
                log.warning("%s", compiled)
            try:
                self._ambient.wait_stream(session.stream)
                held = session.watch.held("this graph's segments", []) if self._watch is not None else None
                self.recording = Recording(
                    plan=tuple(session.plan),
                    capture_s=capture_s,
                    pool=session.pool,
                    device=session.device,
                    lease=session.lease,
                    guards=self._build_guards(session) if self.debug.guards else None,
                    poison=self._build_poison(session) if self.debug.poison else None,
                    staged_breakpoints=session.staged_breakpoints or None,
                    stage_at=session.stage_at if session.staged_breakpoints else None,
                    always_run=frozenset(session.always_run),
                    held=held,
                )
            finally:
                self._restore()
            log.info(
                "bcg: captured %d segment(s) and %d breakpoint(s) in %.3f s",
                sum(isinstance(s, SegmentStep) for s in session.plan),
                sum(isinstance(s, BreakpointStep) for s in session.plan), capture_s,
            )
            return False
        translated = self._abandon(session, exc)
        if translated is exc:
            return False
        try:
            raise translated from exc
        finally:
            # this frame would hold the error whose traceback holds this frame: a cycle that keeps
            # the failed capture's tensors (its frames' arguments) allocated until a collection
            del translated, session

    def _build_guards(self, session: CaptureSession) -> Guards:
        guards = Guards()
        inputs = self.options.inputs
        if inputs is not None:
            for i, x in enumerate(inputs if isinstance(inputs, (tuple, list)) else (inputs,)):
                guards.add(f"static input {i}", x)
        for step in session.plan:
            if isinstance(step, BreakpointStep):
                for i, a in enumerate(step.args):
                    guards.add(f"argument {i} of breakpoint {step.name!r}", a)
                for k, a in step.kwargs.items():
                    guards.add(f"argument {k!r} of breakpoint {step.name!r}", a)
        return guards

    def _build_poison(self, session: CaptureSession) -> Poison:
        log.warning("bcg: poison mode is on: free pool memory is filled with NaN before every replay (slow)")
        return Poison(session.pool, session.device, session.pool_resident_tensors())

    def _restore(self) -> None:
        """Undo ``__enter__``'s process-wide and context changes; the capture ends last (the
        capture lock is released, and frees deferred meanwhile run)."""
        try:
            self._rng.__exit__(None, None, None)
            if self._watch is not None:
                watch, self._watch = self._watch, None
                watch.__exit__(None, None, None)
            self._compile_watch.__exit__(None, None, None)
            reset_live(self._live_token)
            ACTIVE.reset(self._active_token)
            self._stream_ctx.__exit__(None, None, None)
        finally:
            try:
                clear_cublas_workspaces()  # no cache keeps the workspace the captured kernels use
            finally:
                self._capturing.__exit__(None, None, None)

    def _abandon(self, session: CaptureSession, exc: BaseException) -> BaseException:
        """Abandon the capture after ``exc``; return the exception to raise (maybe translated)."""
        compiled = self._compile_watch.message()
        status = cudart.capture_status(session.stream_handle)
        translated = _diagnose(exc, session, status)
        self._fail(session, exc)
        if compiled is not None:
            add_note(translated, compiled)
        return translated

    def _fail(self, session: CaptureSession, exc: BaseException) -> None:
        try:
            session.abort()
            if not session.owns_pool:
                self.failed_lease = session.lease
            try:
                torch.cuda.synchronize(session.device)
            except RuntimeError:  # a sticky device error: the original exception says more
                log.exception("bcg: device synchronize after an abandoned capture failed")
        finally:
            self._restore()


_CLEAN = "The capture was abandoned; CUDA state is clean."

#: torch's error for a draw, inside a capture, from a generator the graph does not know
_UNREGISTERED_GENERATOR = "Attempt to increase offset for a CUDA generator not in capture mode"


def _diagnose(exc: BaseException, session: CaptureSession, status: str) -> BaseException:
    """The error to raise for ``exc``, which ended a capture: CUDA's cause, told apart and explained."""
    if isinstance(exc, BcgError) or session._current is None:
        return exc  # bcg's own errors, and errors outside a segment (a breakpoint's), speak for themselves
    text = str(exc)
    where = user_line(traceback.extract_tb(exc.__traceback__))
    at = f" at {where}" if where else ""
    segment = f"graph segment {session._segment_index}"
    if _UNREGISTERED_GENERATOR in text:
        return CaptureError(
            f"{segment} drew random numbers{at} from a CUDA generator that is not registered with the "
            f"graph: {exc}\nWith bcg.capture, call graph.register_generator_state(generator) before the "
            "capture, as with torch.cuda.CUDAGraph. bcg.make_graph and bcg.GraphRunner capture with the "
            "default generator only: draw from it there, or from your generator inside a breakpoint. "
            f"{_CLEAN}"
        )
    if any(h in text for h in _UNCAPTURED_DEPENDENCY):
        streams = _streams_in(exc.__traceback__, session.stream_handle)
        named = f" (stream {', '.join(streams)})" if streams else ""
        if session.forks:
            fork = session.forks[-1]
            cause = (
                f"Segment {fork.segment} forked work to a side stream{named} and did not join it back "
                f"before {fork.before}; bcg joined it there (so the side work finished before the "
                "break, and its overlap was lost), and the side stream's later work is outside the "
                "capture. A fork must not cross a breakpoint: join the side stream "
                "(torch.cuda.current_stream().wait_stream(side)) before the breakpoint and fork again "
                "after it, or move the overlapped work into the breakpoint."
            )
        else:
            cause = (
                f"The stream it waited on{named} ran that work outside the capture (before it began, "
                "in an earlier segment, or during a breakpoint). Fork side streams from the capture stream inside the "
                "segment (side.wait_stream(torch.cuda.current_stream())) before using them."
            )
        return StreamForkError(f"{segment} waited{at} on another stream's work from outside the capture: {exc}\n{cause} {_CLEAN}")
    if any(h in text for h in _LEGACY_STREAM):
        return CaptureInvalidatedError(
            f"{segment} issued work{at} that involves the legacy default stream while capturing: {exc}\n"
            "Run segment code on the current (capture) stream; create side streams with "
            f"torch.cuda.Stream(), not the default stream. {_CLEAN}"
        )
    if any(h in text for h in _EARLIER_ERROR) or (status == "invalidated" and not any(h in text for h in _HOST_SYNC_HINTS)):
        return CaptureInvalidatedError(
            f"{segment} failed{at} because the capture had already been invalidated earlier: {exc}\n"
            "The line above is where CUDA reported it, not necessarily the cause. Look for an "
            "operation that needs the host in this segment (.item(), a pageable copy, "
            "synchronize), or, in capture_error_mode='global', for another thread that ran an "
            "unsafe CUDA call (cudaMalloc, a synchronize) during the capture. "
            f"{_CLEAN}"
        )
    if status == "invalidated" or any(h in text for h in _HOST_SYNC_HINTS):
        return HostSyncInCaptureError(
            f"an operation that needs the host ran inside {segment}{at}: {exc}\n"
            "Segments may only enqueue GPU work. Move host-synchronizing code (.item(), "
            ".tolist(), .cpu(), printing a tensor, copies from pageable host memory, "
            "data-dependent control flow) into a @bcg.breakpoint function, or read the "
            "value from bcg.live() inside one. If the segment holds no such code, it ran code for "
            "the first time (lazy kernel loading, library handles): run it once eagerly before "
            f"capturing. {_CLEAN}"
        )
    return exc


def unwind_capture(graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream, device: int, pool: PoolHandle,
                   generators: tuple[torch.Generator, ...] = ()) -> None:
    """End ``graph``'s capture on ``stream`` through torch's own ``capture_end``, whatever state it is in.

    An invalidated capture (a host sync inside a segment) makes torch's
    ``capture_end`` raise before it unwinds its state (allocator routing in
    the device and pinned-host allocators, RNG capture state). So the
    invalidated capture is discarded and an empty one re-armed on the same
    stream: torch's ``capture_end`` then succeeds and unwinds everything, and
    ``reset()`` drops the pool counts as after any capture. ``generators``: those
    registered with ``graph`` (their capture state is closed too).
    """
    handle = int(stream.cuda_stream)
    for attempt in (1, 2):
        try:
            if cudart.capture_status(handle) != "active":
                cudart.end_capture(handle)
                cudart.begin_capture(handle)
            with torch.cuda.stream(stream):
                _end_capture(graph)
            return
        except Exception:
            # torch's capture_end ended an invalidated capture, then raised: the stream is
            # no longer capturing, so the second attempt re-arms it and succeeds.
            if attempt == 1:
                continue
            log.exception("bcg: unwinding an abandoned capture through torch failed; cleaning up directly")
            cudart.end_capture(handle)
            with contextlib.suppress(RuntimeError):
                end_allocate_to_pool(device, pool)
            reset_rng_capture_state(stream, generators)


def _begin_capture(graph: torch.cuda.CUDAGraph, pool: PoolHandle, mode: str, stream: torch.cuda.Stream,
                   generators: tuple[torch.Generator, ...] = ()) -> None:
    """``graph.capture_begin`` on ``stream`` (the current stream), cleaned up if it fails (see
    :func:`bcg.core.pool.begin_capture_into`).

    Torch's cached cuBLAS workspaces are dropped first, so that the segment's
    matmuls allocate theirs inside the capture, in the graph's own pool
    (see :func:`bcg.core.torch_internals.clear_cublas_workspaces`)."""
    clear_cublas_workspaces()
    begin_capture_into(graph, pool, mode, stream, generators)


def _owner() -> str:
    """The graph a capture starting here fills, named for errors by the user's line that started it."""
    frame = user_frame()
    if frame is None:
        return "a bcg graph"
    return f"the bcg graph captured at {frame.f_code.co_filename}:{frame.f_lineno} ({frame.f_code.co_name})"


def _end_capture(graph: torch.cuda.CUDAGraph) -> None:
    """``graph.capture_end``, without torch's warning for an empty graph (consecutive breakpoints)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*CUDA Graph is empty.*")
        graph.capture_end()


def capture_call(fn: Callable[[], Any], pool: PoolHandle, device: int,
                 graph_pool: PoolHandle | None = None) -> tuple[torch.cuda.CUDAGraph, int, StorageWatch, GeneratorWatch]:
    """Capture ``fn()`` alone into a new ``torch.cuda.CUDAGraph(keep_graph=True)`` in ``pool``.

    Returns ``(graph, nodes, watch, rng)``: the graph instantiated when ``nodes`` >
    0, never run (its first launch uploads it on the stream that launches it),
    the :class:`~bcg.core.storages.StorageWatch` of the storages it read outside
    ``pool`` and ``graph_pool``, and the :class:`~bcg.core.rng.GeneratorWatch` that
    tells whether it draws random numbers. Captured in ``"thread_local"`` mode (other
    threads' CUDA calls neither break it nor are refused) on bcg's capture
    stream of ``device``, holding the capture lock. On any failure the capture
    is unwound (no stream left capturing, RNG and allocator state closed), the
    graph freed, and the exception re-raised.
    """
    stream = capture_stream(device)
    with capturing():
        stream.wait_stream(torch.cuda.current_stream(device))
        graph = SegmentGraph(keep_graph=True)
        pools = [pool] if graph_pool is None else [pool, graph_pool]
        segment_map = SegmentMap(pools)
        watch = StorageWatch(segment_map.external, recording=lambda: True, writers=segment_map.writers)
        rng = GeneratorWatch(device)
        try:
            with torch.cuda.stream(stream):
                _begin_capture(graph, pool, "thread_local", stream)
                try:
                    with watch, rng:
                        fn()
                    _end_capture(graph)
                except BaseException:
                    unwind_capture(graph, stream, device, pool)
                    graph.reset()  # never launched, and no capture is underway any more
                    raise
        finally:
            clear_cublas_workspaces()
        nodes = sum(cudart.node_type_counts(int(graph.raw_cuda_graph())).values())
        if nodes:
            graph.instantiate()
    return graph, nodes, watch, rng


def _streams_in(tb: TracebackType | None, capture_handle: int) -> list[str]:
    """The CUDA streams other than the capture stream that the failing frames were handling."""
    found: dict[int, str] = {}
    while tb is not None:
        for value in list(tb.tb_frame.f_locals.values()):
            if isinstance(value, torch.cuda.Stream) and int(value.cuda_stream) != capture_handle:
                found.setdefault(int(value.cuda_stream), f"{int(value.cuda_stream):#x} on {value.device}")
        tb = tb.tb_next
    return list(found.values())
