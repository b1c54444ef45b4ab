"""The staging kernel: a :class:`bcg.StagingBuffer`'s value carried in a kernel's parameters.

A small buffer (up to :func:`param_bytes`) reaches the device as the by-value
parameter of a one-block kernel that stores it into the buffer's device memory.
Captured, that kernel is a node of the segment; before each launch of the
segment's executable the replay sets the node's parameters to the buffer's host
value (``cuGraphExecKernelNodeSetParams``). CUDA copies the parameters when it
is called, and a launch already queued keeps the ones it was launched with, so
``write`` never waits for the GPU, however many replays are queued. A captured
copy from pinned memory plus its completion event, the route of larger buffers,
costs each launch more host time and the GPU more latency (benchmarks/results/HISTORY.md,
2026-12-04, fourteenth session). Uncaptured (an eager upload), the kernel is
launched with the value at once.

The kernel is compiled with NVRTC (cuda-python) once per process, device and
size. Where it cannot be (no NVRTC library, a GPU older than sm_70, a driver without
``cuGraphExecKernelNodeSetParams``), :func:`stage_kernel` returns ``None``, logs why
once per device, and the buffer takes the captured copy instead.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import time
from typing import Any

from bcg.core import cudart
from bcg.errors import ReplayError

log = logging.getLogger("bcg")

#: The most bytes a value carried in the parameters may have where the driver and NVRTC are
#: CUDA 12.1 or newer (kernel parameters past 4 KiB): 8 KiB less the 8 of the destination
#: pointer. Larger values take the copy, whose host time does not grow with the size, where
#: setting the parameters' does (benchmarks/results/HISTORY.md, 2026-12-04, fifteenth session).
PARAM_BYTES = 8192 - 8

#: The limit with an older driver or NVRTC: the classic 4 KiB of a kernel's parameters, less the pointer.
CLASSIC_PARAM_BYTES = 4096 - 8

_SOURCE = r"""
struct Value { unsigned long long w[{words}]; };
extern "C" __global__ void bcg_stage(unsigned long long* dst, const __grid_constant__ Value value) {
  for (int i = threadIdx.x; i < {words}; i += blockDim.x) dst[i] = value.w[i];
}
"""


class KernelNodeParams(ctypes.Structure):
    """``CUDA_KERNEL_NODE_PARAMS`` (v2) as the driver reads it."""

    _fields_ = [("func", ctypes.c_void_p), ("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint),
                ("gridDimZ", ctypes.c_uint), ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint),
                ("blockDimZ", ctypes.c_uint), ("sharedMemBytes", ctypes.c_uint), ("kernelParams", ctypes.c_void_p),
                ("extra", ctypes.c_void_p), ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


@functools.cache
def _set_params() -> Any:
    """The driver's ``cuGraphExecKernelNodeSetParams`` through ctypes: cuda-python's binding
    marshals a Python struct per call, where the replay sets one prebuilt C struct (whose
    address the native replay passes to the same function)."""
    lib = ctypes.CDLL("libcuda.so.1")
    fn = getattr(lib, "cuGraphExecKernelNodeSetParams_v2", None) or lib.cuGraphExecKernelNodeSetParams
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


@functools.cache
def param_bytes() -> int:
    """The most bytes a value may have to travel in the staging kernel's parameters in this
    process: :data:`PARAM_BYTES` where the driver and NVRTC are CUDA 12.1 or newer, else
    :data:`CLASSIC_PARAM_BYTES` (also where either version cannot be read)."""
    try:
        large = cudart.driver_version() >= 12010 and cudart.nvrtc_version() >= (12, 1)
    except Exception as exc:  # no cuda-python, no driver, ...: the kernel build will say why, if it fails
        log.debug("bcg: CUDA versions not read (%s): staged values up to %d bytes in parameters", exc,
                  CLASSIC_PARAM_BYTES)
        large = False
    return PARAM_BYTES if large else CLASSIC_PARAM_BYTES


def words_of(nbytes: int) -> int:
    """The 8-byte words the kernel stores for a value of ``nbytes`` (host and device buffers hold that many)."""
    return max(1, -(-nbytes // 8))


# Devices where the kernel cannot be built, and why (process-wide, as the kernels cached per size
# are): every size up to the classic limit fails there alike, so it is tried and logged once per
# device. (A larger size that fails is logged, and leaves the smaller ones to be tried.)
_UNBUILDABLE: dict[int, str] = {}


@functools.cache
def stage_kernel(device: int, words: int) -> int | None:
    """The staging kernel for ``words`` 8-byte words on CUDA device ``device`` (a ``CUfunction``
    handle), or None (logged once per device) where it cannot be built."""
    import torch

    if device in _UNBUILDABLE:
        return None
    try:
        major, minor = torch.cuda.get_device_capability(device)
        if major < 7:
            raise RuntimeError(f"the GPU is sm_{major}{minor}; the kernel needs sm_70 or newer")
        _set_params()  # (a driver without it could not set the value at replay)
        start = time.perf_counter()
        source = _SOURCE.replace("{words}", str(words))
        image = cudart.compile_cubin(source, "bcg_stage.cu", f"sm_{major}{minor}")
        with torch.cuda.device(device):
            function = cudart.load_function(image, "bcg_stage")
        log.debug("bcg: built the staging kernel for %d words on sm_%d%d in %.0f ms", words, major, minor,
                  (time.perf_counter() - start) * 1e3)
        return function
    except Exception as exc:  # no NVRTC library, an architecture it does not know, an old driver, ...
        if words * 8 > CLASSIC_PARAM_BYTES:  # (parameters past 4 KiB: smaller values may still build)
            log.warning("bcg: the staging kernel for %d bytes cannot be built on cuda:%d (%s: %s): StagingBuffers "
                        "of that size take the captured copy from pinned memory instead", words * 8, device,
                        type(exc).__name__, exc)
            return None
        _UNBUILDABLE[device] = f"{type(exc).__name__}: {exc}"
        log.warning("bcg: the staging kernel cannot be built on cuda:%d (%s): small StagingBuffers take the "
                    "captured copy from pinned memory instead, which costs each replay more host and GPU time",
                    device, _UNBUILDABLE[device])
        return None


class StageLaunch:
    """One buffer's staging kernel, its arguments and its node parameters (built once).

    Arguments:
        function: :func:`stage_kernel`'s handle.
        dst, src: the device and host addresses of ``words`` 8-byte words each.
    """

    def __init__(self, function: int, words: int, dst: int, src: int) -> None:
        self._dst = ctypes.c_uint64(dst)
        self._args = (ctypes.c_void_p * 2)(ctypes.addressof(self._dst), src)  # the value: read from src
        self.threads = min(1024, max(32, words))
        self.function = function
        self.params = KernelNodeParams(function, 1, 1, 1, self.threads, 1, 1, 0, ctypes.addressof(self._args),
                                       None, None, None)
        #: the address of the node parameters, which the native replay passes to the driver
        self.params_address = ctypes.addressof(self.params)

    def launch(self, stream: int) -> None:
        """Launch the kernel on ``stream`` with the host value now (captured, when ``stream`` captures)."""
        cudart.launch_kernel(self.function, self.threads, stream, ctypes.addressof(self._args))

    @staticmethod
    def captured_node(stream: int) -> Any:
        """The node the last :meth:`launch` added to ``stream``'s capture (its last node)."""
        status, _, _, deps = cudart.capture_info(stream)
        if status != "active" or len(deps) != 1:
            raise RuntimeError(f"the staging kernel's node cannot be found in the capture ({status}, "
                               f"{len(deps)} last nodes)")
        return deps[0]

    def set_in(self, graph_exec: int, node: Any) -> None:
        """Set ``node`` of ``graph_exec`` to launch with the host value now (launches queued before keep theirs)."""
        err = _set_params()(graph_exec, int(node), self.params_address)
        if err == cudart.INVALID_CONTEXT:  # a thread whose first CUDA call this is
            cudart.make_context_current()
            err = _set_params()(graph_exec, int(node), self.params_address)
        if err != 0:
            raise ReplayError(f"cuGraphExecKernelNodeSetParams failed: CUDA error {err} (a staged value was "
                              "not set; the segment was not launched)")
