"""``bcg.capture``: record a forward pass as segments split at breakpoints.

Each segment is a ``torch.cuda.CUDAGraph`` captured with ``capture_begin`` /
``capture_end`` on one capture stream into one private memory pool, so torch's
caching allocator and RNG bookkeeping stay in charge. Right after a segment is
captured it is instantiated, uploaded and replayed once, so the breakpoint that
follows runs on real data and the capture itself computes a correct forward.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
import traceback
import warnings
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch
from torch.utils import _pytree as pytree

from bcg import cudart
from bcg.breakpoint_spec import BreakpointSpec
from bcg.bridge import BridgeSet, tensor_storages
from bcg.compiled import CompileWatch
from bcg.debug import Guards, Poison, env_flag
from bcg.errors import BcgError, CaptureError, add_note, HostSyncInCaptureError, NestedCaptureError
from bcg.live import _UNSET, reset_live, set_live
from bcg.memory import PoolAnchor, PoolHandle, graph_pool_handle
from bcg.ownership import OWNERSHIPS, Ownership, PoolMembership
from bcg.plan import BreakpointStep, SegmentStep, Step
from bcg.recorder import ACTIVE

if TYPE_CHECKING:
    from bcg.graph import BreakableGraph

log = logging.getLogger("bcg")

_CAPTURE_MODES = ("global", "thread_local", "relaxed")
_HOST_SYNC_HINTS = (
    "stream is capturing",
    "cudaErrorStreamCapture",
    "graph capture",
    "error during capture",
    "operation not permitted",
)


class CaptureSession:
    """The state of one capture in progress (the active recorder while it runs)."""

    def __init__(
        self,
        pool: PoolHandle,
        stream: torch.cuda.Stream,
        capture_error_mode: str,
        device: int,
        ownership: Ownership = "graph",
        after_breakpoint: Callable[[list[torch.Tensor]], None] | None = None,
        owns_pool: bool = True,
    ) -> None:
        self.pool = pool
        self.owns_pool = owns_pool
        self.pool_ref = PoolAnchor(device, pool, stream)
        self.empty_segments: list[torch.cuda.CUDAGraph] = []
        self._membership = PoolMembership(pool, device) if ownership == "pool" else None
        self._after_breakpoint = after_breakpoint
        self.stream = stream
        self.stream_handle = int(stream.cuda_stream)
        self.capture_error_mode = capture_error_mode
        self.device = device
        self.plan: list[Step] = []
        self._current: torch.cuda.CUDAGraph | None = None
        self._segment_index = 0
        self._breakpoint_index = 0
        self._generator = torch.cuda.default_generators[device]

    # -- segments ---------------------------------------------------------------
    def open_segment(self) -> None:
        graph = torch.cuda.CUDAGraph(keep_graph=True)
        try:
            graph.capture_begin(pool=self.pool, capture_error_mode=self.capture_error_mode)
        except BaseException:
            cudart.end_capture(self.stream_handle)
            _reset_rng_capture_state(self.stream)  # torch opened it before failing
            raise
        self._current = graph

    def close_segment(self) -> None:
        """End the open segment; keep it (instantiated, uploaded, run once) unless empty."""
        graph = self._current
        assert graph is not None
        joined = cudart.join_forked_work(self.stream_handle)
        if joined:
            log.debug("segment %d: joined %d node(s) forked to side streams", self._segment_index, joined)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*CUDA Graph is empty.*")
            graph.capture_end()
        self._current = None
        handle = int(graph.raw_cuda_graph())
        counts = cudart.node_type_counts(handle)
        nodes = sum(counts.values())
        if nodes == 0:
            # Consecutive breakpoints: no launch. Kept (not reset) until the graph is,
            # since resetting drops a count on the pool (see PoolAnchor).
            self.empty_segments.append(graph)
            return
        graph.instantiate()
        cudart.upload(int(graph.raw_cuda_graph_exec()), self.stream_handle)
        offset = self._generator.get_offset()
        graph.replay()  # the capture run: the breakpoint after it reads real data
        step = SegmentStep(
            index=self._segment_index,
            cuda_graph=graph,
            nodes=nodes,
            kernel_nodes=counts["kernel"],
            uses_rng=self._generator.get_offset() != offset,
        )
        self._segment_index += 1
        self.plan.append(step)
        log.debug("segment %d: %d nodes (%d kernels)", step.index, nodes, step.kernel_nodes)

    # -- Recorder -----------------------------------------------------------------
    def call_breakpoint(
        self, spec: BreakpointSpec, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        if not spec.is_enabled():
            return spec.fn(*args, **kwargs)
        self.close_segment()
        fn = spec.capture_stub or spec.fn
        try:
            result = fn(*args, **kwargs)
        except BaseException as exc:
            add_note(exc, f"bcg: raised by breakpoint {spec.name!r} during capture; the capture was abandoned")
            raise
        with self.pool_ref.allocating():
            bridges = BridgeSet(spec.name, result, tensor_storages(args, kwargs))
        caller_result = bridges.caller_result()
        crossing = _unique(bridges.tensors() + spec.mutated_tensors(args, kwargs))
        held_args, held_kwargs = args, dict(kwargs)
        if self._membership is not None:
            bridges.hold_through(self._membership.release)
            held_args, held_kwargs = self._membership.release((held_args, held_kwargs))
        self.plan.append(
            BreakpointStep(spec=spec, args=held_args, kwargs=held_kwargs, bridges=bridges, index=self._breakpoint_index)
        )
        self._breakpoint_index += 1
        log.debug("breakpoint %r after segment %d", spec.name, self._segment_index - 1)
        self.open_segment()
        if self._after_breakpoint is not None:
            self._after_breakpoint(crossing)  # captured at the start of the next segment
        return caller_result

    def graph_break(self) -> None:
        self.close_segment()
        self.open_segment()

    # -- failure ------------------------------------------------------------------
    def _unwind(self, graph: torch.cuda.CUDAGraph) -> None:
        """End ``graph``'s capture through torch's own ``capture_end``, whatever state it is in.

        An invalidated capture (a host sync inside a segment) makes torch's
        ``capture_end`` raise before it unwinds its state (allocator routing in
        the device and pinned-host allocators, RNG capture state). So the
        invalidated capture is discarded and an empty one re-armed on the same
        stream: torch's ``capture_end`` then succeeds and unwinds everything, and
        ``reset()`` drops the pool counts as after any capture.
        """
        for attempt in (1, 2):
            try:
                if cudart.capture_status(self.stream_handle) != "active":
                    cudart.end_capture(self.stream_handle)
                    cudart.begin_capture(self.stream_handle)
                with torch.cuda.stream(self.stream), warnings.catch_warnings():
                    warnings.filterwarnings("ignore", message=".*CUDA Graph is empty.*")
                    graph.capture_end()
                return
            except Exception:
                # torch's capture_end ended an invalidated capture, then raised: the stream is
                # no longer capturing, so the second attempt re-arms it and succeeds.
                if attempt == 1:
                    continue
                log.exception("bcg: unwinding an abandoned capture through torch failed; cleaning up directly")
                cudart.end_capture(self.stream_handle)
                with contextlib.suppress(RuntimeError):
                    torch._C._cuda_endAllocateToPool(self.device, self.pool)
                    torch._C._cuda_releasePool(self.device, self.pool)
                _reset_rng_capture_state(self.stream)

    def abort(self) -> None:
        """Leave CUDA clean: no stream capturing, pool references dropped, segments freed."""
        graph, self._current = self._current, None
        if graph is not None:
            self._unwind(graph)
            graph.reset()
        for step in self.plan:
            step.release()
        self.plan.clear()
        for empty in self.empty_segments:
            empty.reset()
        self.empty_segments.clear()
        if self.owns_pool:
            self.pool_ref.release()
            torch.cuda.empty_cache()  # an abandoned pool of our own goes back to the driver


class capture:  # noqa: N801 - lower-case like torch.cuda.graph; the name is the public contract
    """Capture the CUDA work of a ``with`` block into a :class:`bcg.BreakableGraph`.

    ``pool`` shares a private memory pool with other graphs (``graph.pool()`` or
    :func:`bcg.graph_pool_handle`); ``stream`` and ``capture_error_mode`` work as
    in ``torch.cuda.graph``; ``live`` is what :func:`bcg.live` returns during
    capture. ``ownership`` says who keeps breakpoint arguments and bridges alive
    (see :mod:`bcg.ownership`; ``"pool"`` lets graphs sharing a pool reuse each
    other's memory). ``after_breakpoint(tensors)`` is called inside the segment
    after each breakpoint with the tensors crossing it (bridges and mutated
    arguments); its CUDA work is captured there. ``inputs`` names the static
    inputs for guards; ``guards`` (default: env ``BCG_GUARDS``) checks before each
    replay that they and every breakpoint argument keep their captured address
    and layout; ``poison`` (default: env ``BCG_POISON``) fills the pool's free
    memory with NaN before each replay (see :mod:`bcg.debug`). Constraints: warm the code up eagerly first (lazy init,
    and torch.compile's compiling, must not happen inside a segment); code
    between breakpoints must be capturable (no ``.item()``, no pageable host
    copies, no data-dependent host control flow); do not drop the last
    reference to a CUDA graph inside the capture (Python's cycle collector is
    paused meanwhile, process-wide); graphs sharing a pool must not replay
    concurrently, and a graph's outputs are only valid until another graph in
    the same pool replays. Inductor's own CUDA graphs are off during the
    capture (see :mod:`bcg.compiled`).
    """

    def __init__(
        self,
        graph: BreakableGraph,
        *,
        pool: PoolHandle | None = None,
        stream: torch.cuda.Stream | None = None,
        capture_error_mode: str = "global",
        live: Any = _UNSET,
        ownership: Ownership = "graph",
        after_breakpoint: Callable[[list[torch.Tensor]], None] | None = None,
        inputs: Any = None,
        guards: bool | None = None,
        poison: bool | None = None,
    ) -> None:
        if ownership not in OWNERSHIPS:
            raise ValueError(f"ownership must be one of {OWNERSHIPS}, not {ownership!r}")
        if capture_error_mode not in _CAPTURE_MODES:
            raise ValueError(f"capture_error_mode must be one of {_CAPTURE_MODES}, not {capture_error_mode!r}")
        self.graph = graph
        self._pool = pool
        self._stream = stream
        self._mode = capture_error_mode
        self._live = live
        self._ownership: Ownership = ownership
        self._after_breakpoint = after_breakpoint
        self._inputs = inputs
        self._guards = env_flag("BCG_GUARDS") if guards is None else guards
        self._poison = env_flag("BCG_POISON") if poison is None else poison
        self._session: CaptureSession | None = None

    def __enter__(self) -> BreakableGraph:
        if not torch.cuda.is_available():
            raise CaptureError(
                "bcg.capture needs a CUDA GPU and a CUDA build of torch; none is available. "
                "To run the same code with the same breakpoint structure eagerly, use "
                "bcg.make_graph(fn, *args, mode='eager')"
            )
        if ACTIVE.get() is not None or torch.cuda.is_current_stream_capturing():
            raise NestedCaptureError(
                "bcg.capture was entered while another capture is underway; captures cannot "
                "nest: finish (exit) the outer capture first"
            )
        if self.graph.is_captured:
            raise CaptureError("this BreakableGraph already holds a capture: call graph.reset() first")
        cudart.runtime()  # fail early and clearly if cuda-python is missing
        device = torch.cuda.current_device()
        pool = self._pool if self._pool is not None else graph_pool_handle()
        stream = self._stream if self._stream is not None else torch.cuda.Stream(device)
        if stream == torch.cuda.default_stream(device):
            raise CaptureError("bcg.capture cannot capture on the default stream: pass a torch.cuda.Stream()")
        torch.cuda.synchronize(device)
        self._ambient = torch.cuda.current_stream(device)
        stream.wait_stream(self._ambient)
        self._session = CaptureSession(
            pool, stream, self._mode, device, self._ownership, self._after_breakpoint, owns_pool=self._pool is None
        )
        self._stream_ctx = torch.cuda.stream(stream)
        self._stream_ctx.__enter__()
        self._active_token = ACTIVE.set(self._session)
        self._live_token = set_live(self._live) if self._live is not _UNSET else None
        self._compile_watch = CompileWatch().__enter__()
        # Python's cycle collector must not run inside the capture: collecting garbage that
        # holds a CUDA graph (an abandoned capture's segments kept alive by a traceback, a
        # dropped model's graphs) destroys it, which CUDA forbids while a stream captures,
        # and the capture is invalidated at a point nobody can see. It is paused until the
        # capture ends; the garbage made meanwhile (all still in the youngest generation)
        # is collected right then, not at some later point of the caller's hot path.
        self._gc_was_enabled = gc.isenabled()
        gc.disable()
        self._t0 = time.perf_counter()
        try:
            self._session.open_segment()
        except BaseException as exc:
            self._fail(self._session, exc)
            raise
        return self.graph

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        session = self._session
        assert session is not None
        self._session = None
        if exc is None:
            try:
                session.close_segment()
            except BaseException as close_exc:
                raise self._abandon(session, close_exc) from close_exc
            capture_s = time.perf_counter() - self._t0
            compiled = self._compile_watch.message()
            if compiled is not None:
                log.warning("%s", compiled)
            self._restore()
            self._ambient.wait_stream(session.stream)
            self.graph._install(
                session.plan,
                pool=session.pool,
                device=session.device,
                capture_s=capture_s,
                pool_ref=session.pool_ref,
                keepalive=session.empty_segments,
                guards=self._build_guards(session) if self._guards else None,
                poison=self._build_poison(session) if self._poison else None,
            )
            log.info(
                "bcg: captured %d segment(s) and %d breakpoint(s) in %.3f s",
                self.graph.num_segments, self.graph.num_breakpoints, capture_s,
            )
            return False
        translated = self._abandon(session, exc)
        if translated is exc:
            return False
        raise translated from exc

    def _build_guards(self, session: CaptureSession) -> Guards:
        guards = Guards()
        if self._inputs is not None:
            for i, x in enumerate(self._inputs if isinstance(self._inputs, (tuple, list)) else (self._inputs,)):
                guards.add(f"static input {i}", x)
        for step in session.plan:
            if isinstance(step, BreakpointStep):
                for i, a in enumerate(step.args):
                    guards.add(f"argument {i} of breakpoint {step.name!r}", a)
                for k, a in step.kwargs.items():
                    guards.add(f"argument {k!r} of breakpoint {step.name!r}", a)
        return guards

    def _build_poison(self, session: CaptureSession) -> Poison:
        membership = PoolMembership(session.pool, session.device)
        held: dict[int, torch.Tensor] = {}
        for step in session.plan:
            if isinstance(step, BreakpointStep):
                bridges = step.bridges.tensors() if step.bridges is not None else []
                for t in pytree.tree_leaves((step.args, step.kwargs, bridges)):
                    if isinstance(t, torch.Tensor) and membership.contains(t):
                        held.setdefault(id(t), t)
        log.warning("bcg: poison mode is on: free pool memory is filled with NaN before every replay (slow)")
        return Poison(session.pool, session.device, list(held.values()))

    def _restore(self) -> None:
        if self._gc_was_enabled:
            gc.enable()
            gc.collect(0)
        self._compile_watch.__exit__(None, None, None)
        if self._live_token is not None:
            reset_live(self._live_token)
        ACTIVE.reset(self._active_token)
        self._stream_ctx.__exit__(None, None, None)

    def _abandon(self, session: CaptureSession, exc: BaseException) -> BaseException:
        """Abandon the capture after ``exc``; return the exception to raise (maybe translated)."""
        compiled = self._compile_watch.message()
        self._fail(session, exc)
        translated = self._translate(exc, session)
        if compiled is not None:
            add_note(translated, compiled)
        return translated

    def _fail(self, session: CaptureSession, exc: BaseException) -> None:
        status = cudart.capture_status(session.stream_handle)
        self._host_sync = not isinstance(exc, BcgError) and (
            status == "invalidated"
            or (session._current is not None and any(h in str(exc) for h in _HOST_SYNC_HINTS))
        )
        self._segment = session._segment_index
        try:
            session.abort()
            if not session.owns_pool:
                # A pool the caller gave us stays usable: torch refuses to capture into a pool
                # whose count dropped to zero while tensors still live in it. The graph keeps
                # the count until it is reset or captured again.
                self.graph._hold_pool(session.pool_ref)
        finally:
            self._restore()
            try:
                torch.cuda.synchronize(session.device)
            except RuntimeError:  # a sticky device error: the original exception says more
                log.exception("bcg: device synchronize after an abandoned capture failed")

    def _translate(self, exc: BaseException, session: CaptureSession) -> BaseException:
        if not self._host_sync:
            return exc
        where = _user_frame(exc.__traceback__)
        return HostSyncInCaptureError(
            f"an operation that needs the host ran inside graph segment {self._segment}"
            f"{' at ' + where if where else ''}: {exc}\n"
            "Segments may only enqueue GPU work. Move host-synchronizing code (.item(), "
            ".tolist(), .cpu(), printing a tensor, copies from pageable host memory, "
            "data-dependent control flow) into a @bcg.breakpoint function, or read the "
            "value from bcg.live(). If the segment holds no such code, it ran code for the "
            "first time (lazy kernel loading, library handles): run it once eagerly before "
            "capturing. The capture was abandoned; CUDA state is clean."
        )


def _reset_rng_capture_state(stream: torch.cuda.Stream) -> None:
    """Close the RNG generator's capture state left open by a failed ``capture_end``.

    torch marks the default generator as capturing in ``capture_begin`` and
    unmarks it only in a successful ``capture_end``; after a failed one every
    eager random op would raise. An empty capture runs the prologue/epilogue pair.
    """
    repair = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*CUDA Graph is empty.*")
        repair.capture_begin()
        repair.capture_end()
    repair.reset()


def _unique(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    seen: set[int] = set()
    out = []
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def _user_frame(tb: TracebackType | None) -> str:
    """``file:line: code`` of the innermost frame outside torch and bcg, if any."""
    import os

    import bcg

    skip = (os.path.dirname(torch.__file__), os.path.dirname(bcg.__file__))
    found = ""
    for frame in traceback.extract_tb(tb):
        if not frame.filename.startswith(skip):
            found = f"{frame.filename}:{frame.lineno}: {(frame.line or '').strip()}"
    return found
