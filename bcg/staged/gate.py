"""The gated copy: one CUDA kernel that waits at a :class:`bcg.StagingBuffer`'s gate, copies the
buffer's pinned host value into its device tensor, and closes the gate (see :mod:`bcg.staged.staging`).

A graph launch pays host time for each copy and stream memory operation node it holds, and
nothing measurable for a kernel node: on an H200 (CUDA 13), a gated copy captured as four
nodes (``cuStreamWriteValue32`` for the arrival, ``cuStreamWaitValue32``, the copy,
``cuStreamWriteValue32``) added 6.1 us of host time to each launch and 8.8 us of GPU time, a
plain copy 2.3 and 3.2, and this kernel 0.0 and 5.1 (``benchmarks/gate_cost.py``).

The kernel is compiled with NVRTC (cuda-python) once per process and device, the first time a
buffer is made there. Where it cannot be (no NVRTC library, a GPU older than sm_70, or one whose
kernels have a run-time limit), :func:`kernel`
returns ``None``, logs why once, and :mod:`bcg.staged.staging` captures the stream memory operations
instead.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any

from bcg.core import cudart

log = logging.getLogger("bcg")

NAME = "bcg_gated_copy"

# gate[0]: 1 once the host wrote the value (StagingBuffer._release), set back to 0 here once it is
# read; gate[1]: the arrival, set to 1 when the GPU reaches the gate (Stager.prepare_launched).
# Thread 0 waits (an acquire at system scope: the host's value, written before the flag, is what
# the loads below see); then every thread copies its share with system-scope (volatile) loads, up
# to 4 16-byte loads and one single byte in flight each (16-byte loads only where both addresses
# are 16-byte aligned, as a StagingBuffer's are); after the barrier, every load has returned its
# value, and a release store closes the gate (ordered after the arrival, so an arrival never lands
# after it). With ``close`` 0 it leaves the gate open (see capture()).
SOURCE = r"""
extern "C" __global__ void bcg_gated_copy(unsigned int* gate, const unsigned char* src,
                                          unsigned char* dst, unsigned long long nbytes,
                                          unsigned long long close) {
  if (threadIdx.x == 0) {
    asm volatile("st.relaxed.sys.u32 [%0], %1;" :: "l"(gate + 1), "r"(1u) : "memory");
    for (;;) {
      unsigned int open;
      asm volatile("ld.acquire.sys.u32 %0, [%1];" : "=r"(open) : "l"(gate) : "memory");
      if (open == 1u) break;
      __nanosleep(32);
    }
  }
  __syncthreads();
  const bool aligned =
      ((reinterpret_cast<unsigned long long>(src) | reinterpret_cast<unsigned long long>(dst)) & 15ull) == 0ull;
  const unsigned long long n16 = aligned ? nbytes >> 4 : 0ull;  // 16-byte chunks, then single bytes
  const unsigned long long step = blockDim.x;
  // this thread's first single byte, loaded with its first chunks (one round trip for small values)
  const unsigned long long first_byte = (n16 << 4) + threadIdx.x;
  unsigned int byte = 0;
  if (first_byte < nbytes)
    asm volatile("ld.volatile.u8 %0, [%1];" : "=r"(byte) : "l"(src + first_byte));
  for (unsigned long long i = threadIdx.x; i < n16; i += 4 * step) {
    unsigned int v[4][4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const unsigned long long j = i + k * step;
      if (j < n16)
        asm volatile("ld.volatile.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(v[k][0]), "=r"(v[k][1]), "=r"(v[k][2]), "=r"(v[k][3]) : "l"(src + 16 * j));
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const unsigned long long j = i + k * step;
      if (j < n16)
        asm volatile("st.v4.u32 [%0], {%1, %2, %3, %4};"
                     :: "l"(dst + 16 * j), "r"(v[k][0]), "r"(v[k][1]), "r"(v[k][2]), "r"(v[k][3]) : "memory");
    }
  }
  if (first_byte < nbytes) dst[first_byte] = static_cast<unsigned char>(byte);
  for (unsigned long long i = first_byte + step; i < nbytes; i += step) {  // unaligned values
    asm volatile("ld.volatile.u8 %0, [%1];" : "=r"(byte) : "l"(src + i));
    dst[i] = static_cast<unsigned char>(byte);
  }
  __syncthreads();
  if (close && threadIdx.x == 0) {
    asm volatile("st.release.sys.u32 [%0], %1;" :: "l"(gate), "r"(0u) : "memory");
  }
}
"""


@functools.cache
def kernel(device: int) -> Any | None:
    """The gated-copy kernel loaded on CUDA device ``device``, or ``None`` (logged once) where
    it cannot be compiled or loaded."""
    import torch

    try:
        major, minor = torch.cuda.get_device_capability(device)
        if major < 7:
            raise RuntimeError(f"the GPU is sm_{major}{minor}; the kernel needs sm_70 or newer")
        if cudart.kernel_time_limit(device):
            raise RuntimeError("its kernels have a run-time limit (a display watchdog), which a kernel "
                               "waiting at a gate for a slow prepare could pass")
        start = time.perf_counter()
        image = cudart.compile_cubin(SOURCE, "bcg_gated_copy.cu", f"sm_{major}{minor}", "--maxrregcount=64")
        with torch.cuda.device(device):
            function = cudart.load_function(image, NAME)
        log.debug("bcg: built the gated-copy kernel for sm_%d%d in %.0f ms", major, minor,
                  (time.perf_counter() - start) * 1e3)
        return function
    except Exception as exc:  # no NVRTC library, an architecture it does not know, ...
        log.warning(
            "bcg: the gated-copy kernel cannot be built on cuda:%d (%s): staged copies are captured as "
            "stream memory operations instead, which cost each graph launch about 6 us more host time",
            device, exc,
        )
        return None


#: Values of more bytes are copied by a copy node between two of these kernels (the first waits at
#: the gate, the second closes it): one block moves 64 KiB per PCIe round trip, a copy engine more
#: (on an H200, 1 MiB took the kernel about 4 times as long as ``cudaMemcpyAsync``). The copy node
#: costs each launch about 2 us of host time.
KERNEL_COPY_MAX = 64 * 1024


def threads(nbytes: int) -> int:
    """The block size for a copy of ``nbytes``: a warp per 4 x 16 x 32 bytes, 32 to 1024 threads."""
    return min(1024, 32 * max(1, -(-nbytes // 2048)))


def capture(function: Any, stream: int, gate: int, src: int, src_device: int, dst: int, nbytes: int) -> None:
    """Capture (launch, when not capturing) the gated copy on ``stream``: ``nbytes`` from pinned host
    memory ``src`` (``src_device``: its device address) to device memory ``dst``, behind the two
    flags at device address ``gate``. One kernel up to :data:`KERNEL_COPY_MAX` bytes, else the
    kernel waiting (the gate left open), a copy node, and the kernel closing the gate."""
    if nbytes <= KERNEL_COPY_MAX:
        cudart.launch_kernel(function, threads(nbytes), stream, (gate, src_device, dst, nbytes, 1))
        return
    cudart.launch_kernel(function, 32, stream, (gate, 0, 0, 0, 0))
    cudart.copy_host_to_device(dst, src, nbytes, stream)
    cudart.launch_kernel(function, 32, stream, (gate, 0, 0, 0, 1))  # the gate is still open: it closes it
