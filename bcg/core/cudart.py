"""Thin, lazily imported wrappers over cuda-python (``cuda.bindings.runtime`` and ``driver``).

Only what the capture machinery needs: capture status, joining forked work,
node counts, uploads, copies, edited copies of graphs, launches and DOT dumps.
Handles are plain ``int`` values (what ``torch.cuda.Stream.cuda_stream`` and
``CUDAGraph.raw_cuda_graph()`` return).
"""

from __future__ import annotations

import functools
from collections import Counter
from types import ModuleType
from typing import Any

from bcg.errors import CaptureError


@functools.cache
def runtime() -> ModuleType:
    """The ``cuda.bindings.runtime`` module; a clear error if cuda-python is missing."""
    try:
        from cuda.bindings import runtime as rt
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise CaptureError(
            "bcg needs cuda-bindings for graph capture: pip install 'cuda-bindings==<CUDA major>.*' "
            "(the major version of torch.version.cuda), or install bcg with its [cuda] extra: "
            "pip install -e '.[cuda]' in a checkout, or pip install 'breakpoint-cuda-graphs[cuda]'"
        ) from exc
    return rt


def check(result: Any) -> Any:
    """Raise on a non-success ``cudaError_t``; return the remaining outputs."""
    rt = runtime()
    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != rt.cudaError_t.cudaSuccess:
        _, name = rt.cudaGetErrorName(err)
        _, text = rt.cudaGetErrorString(err)
        raise RuntimeError(f"{name.decode()}: {text.decode()}")
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else tuple(rest)


def capture_info(stream: int) -> tuple[str, int, int, list[Any]]:
    """``(status, capture id, graph handle, dependency nodes)`` of a stream."""
    rt = runtime()
    out = check(rt.cudaStreamGetCaptureInfo(stream))
    status, cid, graph, deps = out[0], out[1], out[2], out[3]
    name = {
        rt.cudaStreamCaptureStatus.cudaStreamCaptureStatusNone: "none",
        rt.cudaStreamCaptureStatus.cudaStreamCaptureStatusActive: "active",
        rt.cudaStreamCaptureStatus.cudaStreamCaptureStatusInvalidated: "invalidated",
    }[status]
    return name, int(cid), int(graph) if graph is not None else 0, list(deps or [])


def capture_status(stream: int) -> str:
    """``"none"``, ``"active"`` or ``"invalidated"``."""
    rt = runtime()
    status = check(rt.cudaStreamIsCapturing(stream))
    if status == rt.cudaStreamCaptureStatus.cudaStreamCaptureStatusNone:
        return "none"
    if status == rt.cudaStreamCaptureStatus.cudaStreamCaptureStatusActive:
        return "active"
    return "invalidated"


def graph_nodes(graph: int) -> list[Any]:
    rt = runtime()
    _, n = check(rt.cudaGraphGetNodes(graph, 0))
    if n == 0:
        return []
    nodes, _ = check(rt.cudaGraphGetNodes(graph, n))
    return list(nodes)[:n]


def graph_edges(graph: int) -> list[tuple[Any, Any]]:
    """``graph``'s dependency edges as ``(from, to)`` node pairs."""
    rt = runtime()
    n = check(rt.cudaGraphGetEdges(graph, 0))[-1]
    if n == 0:
        return []
    out = check(rt.cudaGraphGetEdges(graph, n))
    return list(zip(list(out[0])[:n], list(out[1])[:n]))


def join_forked_work(stream: int) -> int:
    """Make the capturing ``stream`` depend on every leaf of its capture graph.

    Work forked to side streams and never joined back would make
    ``cudaStreamEndCapture`` fail with ``cudaErrorStreamCaptureUnjoined``; adding
    those leaves to the origin stream's dependency set joins them (and orders
    them before whatever the stream does next). Returns how many were joined.
    """
    rt = runtime()
    status, _, graph, deps = capture_info(stream)
    if status != "active" or not graph:
        return 0
    nodes = graph_nodes(graph)
    if not nodes:
        return 0
    sources = {int(a) for a, _ in graph_edges(graph)}
    current = {int(d) for d in deps}
    missing = [n for n in nodes if int(n) not in sources and int(n) not in current]
    if not missing:
        return 0
    flag = rt.cudaStreamUpdateCaptureDependenciesFlags.cudaStreamAddCaptureDependencies
    try:  # CUDA 13 bindings: (stream, nodes, edge data, count, flags)
        check(rt.cudaStreamUpdateCaptureDependencies(stream, missing, None, len(missing), flag))
    except TypeError:  # CUDA 12 bindings: (stream, nodes, count, flags)
        check(rt.cudaStreamUpdateCaptureDependencies(stream, missing, len(missing), flag))
    return len(missing)


def graph_node_count(graph: int) -> int:
    rt = runtime()
    return int(check(rt.cudaGraphGetNodes(graph, 0))[-1])


def node_dependencies(node: Any) -> list[Any]:
    rt = runtime()
    n = check(rt.cudaGraphNodeGetDependencies(node, 0))[-1]
    if n == 0:
        return []
    return list(check(rt.cudaGraphNodeGetDependencies(node, n))[0])[:n]


class CaptureMark:
    """Where the capture active on a stream stands now, to list the nodes recorded after it.

    :meth:`added` walks back from the stream's current dependencies to the ones
    marked, so its cost follows the nodes added, not the graph's size. It
    returns ``None`` where that walk cannot account for every node added (work
    on another stream not joined back yet, or a join of work recorded before
    the mark): the caller then treats the nodes as unknown.
    """

    def __init__(self, stream: int) -> None:
        self.stream = stream
        status, _, self.graph, deps = capture_info(stream)
        self.active = status == "active" and bool(self.graph)
        self.deps = {int(d) for d in deps}
        self.count = graph_node_count(self.graph) if self.active else 0

    def added(self) -> list[Any] | None:
        if not self.active:
            return []
        status, _, graph, deps = capture_info(self.stream)
        if status != "active" or graph != self.graph:
            return None
        expected = graph_node_count(graph) - self.count
        found: dict[int, Any] = {}
        todo = [d for d in deps if int(d) not in self.deps]
        while todo:
            node = todo.pop()
            key = int(node)
            if key in found:
                continue
            found[key] = node
            if len(found) > expected:
                return None
            parents = node_dependencies(node)
            if not parents and self.deps:
                return None  # a root that is not the mark's: recorded before it
            todo.extend(p for p in parents if int(p) not in self.deps)
        return list(found.values()) if len(found) == expected else None


@functools.cache
def _node_type_names() -> dict[Any, str]:
    rt = runtime()
    return {
        rt.cudaGraphNodeType.cudaGraphNodeTypeKernel: "kernel",
        rt.cudaGraphNodeType.cudaGraphNodeTypeMemcpy: "memcpy",
        rt.cudaGraphNodeType.cudaGraphNodeTypeMemset: "memset",
        rt.cudaGraphNodeType.cudaGraphNodeTypeHost: "host",
        rt.cudaGraphNodeType.cudaGraphNodeTypeGraph: "child_graph",
        rt.cudaGraphNodeType.cudaGraphNodeTypeEmpty: "empty",
        rt.cudaGraphNodeType.cudaGraphNodeTypeWaitEvent: "wait_event",
        rt.cudaGraphNodeType.cudaGraphNodeTypeEventRecord: "event_record",
    }


def node_type(node: Any) -> str:
    """``"kernel"``, ``"memcpy"``, ``"memset"``, ... (``"other"`` for the rest)."""
    rt = runtime()
    err, kind = rt.cudaGraphNodeGetType(node)
    if err == rt.cudaError_t.cudaErrorUnknown:
        # The runtime has no type for some driver nodes (cudaErrorUnknown on CUDA 13 for the
        # stream memory operations of bcg.staged.staging's gates): not a failure, just not named. The
        # error is cleared, or torch's next launch check (cudaGetLastError) would raise it.
        rt.cudaGetLastError()
        return "other"
    check(err)
    return _node_type_names().get(kind, "other")


def node_type_counts(graph: int) -> Counter[str]:
    """How many nodes of each type (``"kernel"``, ``"memcpy"``, ...) ``graph`` holds."""
    return Counter(node_type(node) for node in graph_nodes(graph))


DISABLEABLE_NODE_TYPES = frozenset({"kernel", "memcpy", "memset"})
"""The node types ``cudaGraphNodeSetEnabled`` can disable."""


def set_node_enabled(graph_exec: int, node: Any, enabled: bool) -> None:
    """Enable or disable ``node`` (of the graph ``graph_exec`` was instantiated from) for the
    launches of ``graph_exec`` that follow (``cudaGraphNodeSetEnabled``; launches already
    queued are not affected). A disabled node runs as an empty node."""
    check(runtime().cudaGraphNodeSetEnabled(graph_exec, node, int(enabled)))


def end_capture(stream: int) -> None:
    """End (and discard) whatever capture is still open on ``stream``, if any."""
    rt = runtime()
    if capture_status(stream) == "none":
        return
    err, graph = rt.cudaStreamEndCapture(stream)
    if err == rt.cudaError_t.cudaSuccess and graph is not None and int(graph):
        rt.cudaGraphDestroy(graph)


def begin_capture(stream: int) -> None:
    """Begin a (relaxed-mode) capture on ``stream`` with the runtime API directly."""
    rt = runtime()
    check(rt.cudaStreamBeginCapture(stream, rt.cudaStreamCaptureMode.cudaStreamCaptureModeRelaxed))


def upload(graph_exec: int, stream: int) -> None:
    """Upload an executable graph so its first launch costs what later ones do."""
    check(runtime().cudaGraphUpload(graph_exec, stream))


def dot_print(graph: int, path: str) -> None:
    """Write ``graph`` as a DOT file (``cudaGraphDebugDotPrint``, verbose)."""
    rt = runtime()
    check(rt.cudaGraphDebugDotPrint(graph, path.encode(), rt.cudaGraphDebugDotFlags.cudaGraphDebugDotFlagsVerbose))


@functools.cache
def driver() -> ModuleType:
    """The ``cuda.bindings.driver`` module (installed with ``cuda.bindings.runtime``)."""
    runtime()  # the clear error when cuda-python is missing
    from cuda.bindings import driver as drv

    return drv


def _driver_call(name: str, *args: Any) -> Any:
    """Call driver function ``name``; raise on failure; return its one output (None: it has none).

    A thread whose first CUDA call this is has no current context (driver calls
    do not set one up): the current device's primary context is made current,
    as the runtime would, and the call made again.
    """
    drv = driver()
    fn = getattr(drv, name)
    result = fn(*args)
    err = result[0] if isinstance(result, tuple) else result
    if err == drv.CUresult.CUDA_ERROR_INVALID_CONTEXT:
        make_context_current()
        result = fn(*args)
        err = result[0] if isinstance(result, tuple) else result
    if err != drv.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"{name} failed: {err!r}")
    return result[1] if isinstance(result, tuple) and len(result) > 1 else None


def make_context_current() -> None:
    """Make the current device's primary context current on this thread, as the runtime would
    (a thread whose first CUDA call is a driver call has none)."""
    rt = runtime()
    check(rt.cudaSetDevice(check(rt.cudaGetDevice())))


#: ``CUDA_ERROR_INVALID_CONTEXT``: a driver call on a thread with no current context
INVALID_CONTEXT = 201


def memset_d32(ptr: int, value: int, count: int, stream: int) -> None:
    """``cuMemsetD32Async``: set ``count`` 32-bit words at device address ``ptr`` to ``value``
    on ``stream``. The value travels in the call, so no host buffer can change under a queued copy."""
    _driver_call("cuMemsetD32Async", ptr, value, count, stream)


def copy_device_to_device(dst: int, src: int, nbytes: int, stream: int) -> None:
    """``cudaMemcpyAsync`` of ``nbytes`` between device addresses on ``stream`` (less host time
    than ``Tensor.copy_``, for the runner's per-call input copies)."""
    rt = runtime()
    check(rt.cudaMemcpyAsync(dst, src, nbytes, rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice, stream))


def copy_host_to_device(dst: int, src: int, nbytes: int, stream: int) -> None:
    """``cudaMemcpyAsync`` from pinned host memory ``src`` to device memory ``dst`` on ``stream``.

    Straight to CUDA, not through ``Tensor.copy_``: torch's pinned-memory
    allocator records an event on the stream for each such copy, which a
    capture turns into a captured event the allocator later queries (an error).
    """
    rt = runtime()
    check(rt.cudaMemcpyAsync(dst, src, nbytes, rt.cudaMemcpyKind.cudaMemcpyHostToDevice, stream))


def compile_cubin(source: str, name: str, arch: str, *options: str) -> bytes:
    """Compile CUDA C++ ``source`` with NVRTC (``cuda.bindings.nvrtc``) for ``arch`` (``"sm_90"``);
    raises ``RuntimeError`` with NVRTC's log when it fails."""
    from cuda.bindings import nvrtc

    def ok(result: Any) -> Any:
        err, *rest = result
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError(f"NVRTC: {err!r}")
        return rest[0] if rest else None

    program = ok(nvrtc.nvrtcCreateProgram(source.encode(), name.encode(), 0, [], []))
    try:
        flags = [f"--gpu-architecture={arch}".encode(), *(o.encode() for o in options)]
        err, = nvrtc.nvrtcCompileProgram(program, len(flags), flags)
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            log = b" " * ok(nvrtc.nvrtcGetProgramLogSize(program))
            ok(nvrtc.nvrtcGetProgramLog(program, log))
            raise RuntimeError(f"NVRTC could not compile {name} for {arch}: {log.decode(errors='replace').strip()}")
        image = b" " * ok(nvrtc.nvrtcGetCUBINSize(program))
        ok(nvrtc.nvrtcGetCUBIN(program, image))
        return image
    finally:
        nvrtc.nvrtcDestroyProgram(program)


def nvrtc_version() -> tuple[int, int]:
    """NVRTC's ``(major, minor)`` version (``cuda.bindings.nvrtc``)."""
    from cuda.bindings import nvrtc

    err, major, minor = nvrtc.nvrtcVersion()
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"nvrtcVersion failed: {err!r}")
    return int(major), int(minor)


def driver_version() -> int:
    """The CUDA version the driver supports, as ``cuDriverGetVersion`` reports it (12010: 12.1)."""
    return int(_driver_call("cuDriverGetVersion"))


def load_function(image: bytes, name: str) -> int:
    """Load ``image`` (a cubin) into the current context; return its kernel ``name`` as a
    ``CUfunction`` handle. The module is never unloaded: graphs captured with the kernel
    launch it for as long as they live."""
    module = _driver_call("cuModuleLoadData", image)
    return int(_driver_call("cuModuleGetFunction", module, name.encode()))


def launch_kernel(function: int, threads: int, stream: int, params: int) -> None:
    """``cuLaunchKernel`` of ``function`` as one block of ``threads`` on ``stream`` (captured when
    capturing), with ``params`` the address of its ``void*`` argument array."""
    drv = driver()
    _driver_call("cuLaunchKernel", drv.CUfunction(function), 1, 1, 1, threads, 1, 1, 0, stream, params, 0)


def stream_create() -> int:
    """A new non-blocking stream on the current device (``cudaStreamCreateWithFlags``), never
    destroyed: unlike ``torch.cuda.Stream()``, which hands out one of a small pool of streams
    round-robin, it is nobody else's stream."""
    rt = runtime()
    return int(check(rt.cudaStreamCreateWithFlags(getattr(rt, "cudaStreamNonBlocking", 1))))


# -- building and launching graphs (stitching: bcg.keyed.stitch) ------------------------------------


def graph_create() -> int:
    """A new, empty ``cudaGraph_t``."""
    return int(check(runtime().cudaGraphCreate(0)))


def add_child_graph(graph: int, after: Any | None, child: int) -> Any:
    """Add ``child`` (cloned) to ``graph`` as a child-graph node after node ``after`` (None: a root).

    Returns the new node. CUDA refuses children holding memory-allocation,
    memory-free or conditional nodes.
    """
    rt = runtime()
    deps = [after] if after is not None else []
    return check(rt.cudaGraphAddChildGraphNode(graph, deps, len(deps), child))


def instantiate(graph: int) -> int:
    """``cudaGraphInstantiate`` with per-node priorities (as torch instantiates its graphs: kernels
    captured on a high-priority stream keep their priority): the executable graph's handle."""
    rt = runtime()
    flags = rt.cudaGraphInstantiateFlags.cudaGraphInstantiateFlagUseNodePriority
    return int(check(rt.cudaGraphInstantiate(graph, int(flags))))


def exec_update(graph_exec: int, graph: int) -> bool:
    """Update ``graph_exec`` in place to run ``graph`` (``cudaGraphExecUpdate``).

    True when the driver accepted it (same topology, updatable parameters);
    False when it did not, and ``graph_exec`` still runs what it ran before.
    """
    rt = runtime()
    result = rt.cudaGraphExecUpdate(graph_exec, graph)
    err = result[0] if isinstance(result, tuple) else result
    if err == rt.cudaError_t.cudaErrorGraphExecUpdateFailure:
        return False
    check(err)  # any other error (a sticky one from earlier work) is not a refusal
    return True


def launch(graph_exec: int, stream: int) -> None:
    """``cudaGraphLaunch(graph_exec, stream)``."""
    check(runtime().cudaGraphLaunch(graph_exec, stream))


# -- editing a graph's copy (trimmed executables: bcg.core.trim) -------------------------------------


def graph_clone(graph: int) -> int:
    """``cudaGraphClone``: a copy of ``graph`` (its nodes found with :func:`find_in_clone`)."""
    return int(check(runtime().cudaGraphClone(graph)))


def find_in_clone(node: Any, clone: int) -> Any:
    """The node of ``clone`` that copies ``node`` of the graph it was cloned from."""
    return check(runtime().cudaGraphNodeFindInClone(node, clone))


def add_edges(graph: int, edges: list[tuple[Any, Any]]) -> None:
    """Add dependency edges ``(from, to)`` (default edge data: a full dependency) to ``graph``."""
    if not edges:
        return
    rt = runtime()
    src, dst = [a for a, _ in edges], [b for _, b in edges]
    try:  # CUDA 13 bindings: (graph, from, to, edge data, count)
        check(rt.cudaGraphAddDependencies(graph, src, dst, None, len(edges)))
    except TypeError:  # CUDA 12 bindings: (graph, from, to, count)
        check(rt.cudaGraphAddDependencies(graph, src, dst, len(edges)))


def destroy_node(node: Any) -> None:
    """Remove ``node`` and its edges from its (not instantiated) graph."""
    check(runtime().cudaGraphDestroyNode(node))


def graph_destroy(graph: int) -> None:
    check(runtime().cudaGraphDestroy(graph))


def exec_destroy(graph_exec: int) -> None:
    check(runtime().cudaGraphExecDestroy(graph_exec))
