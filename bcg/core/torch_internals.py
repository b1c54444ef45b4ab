"""Every private torch name bcg uses, each with the reason no public route exists.

Keeping them here means one file to read when torch changes, and one place that
says which torch internals bcg depends on. Nothing else in bcg touches a
private torch name (``tests/test_layout.py`` checks it).
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

# torch's pytree (flatten/unflatten nested containers of tensors): torch has no public pytree
# module; torch.utils._pytree is the one its own libraries (and most of the ecosystem) use.
from torch.utils import _pytree as pytree

# The base class of dispatch modes: torch documents it in torch.utils._python_dispatch and
# exports it nowhere else.
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "TorchDispatchMode",
    "begin_allocate_to_pool",
    "clear_cublas_workspaces",
    "dynamo_graphs",
    "end_allocate_to_pool",
    "fresh_inductor_cache",
    "has_triton",
    "has_internal_overlap",
    "inductor_config",
    "maybe_mark_dynamic",
    "PROFILER_FLAG",
    "profiler_enabled",
    "pytree",
    "storage_at",
    "storage_use_count",
    "stream_readers",
    "view_base",
    "without_mode",
]


def clear_cublas_workspaces() -> None:
    """Drop torch's cached cuBLAS/cuBLASLt workspaces, one per (handle, stream).

    bcg calls it right before each segment's capture begins and after each
    capture ends, so that the workspace a captured matmul uses is allocated
    inside the capture, into the graph's own pool, and no cache keeps it
    afterwards: no other graph, stream or eager call then shares it, and no
    later clear (Inductor's CUDA graphs clear around every recording) can
    hand it back to the driver while the graph lives. Private: torch has no
    public way to clear or route these workspaces; Inductor's CUDA graph
    trees call the same function around each recording. A no-op without it.
    """
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


def storage_use_count(storage: torch.UntypedStorage) -> int:
    """How many strong references the storage's ``StorageImpl`` has (tensors, storages, C++).

    Private: torch has no public reference count for storages; its CUDA graph
    trees read the same counter to tell whether an output is still alive.
    """
    return int(torch._C._storage_Use_Count(storage._cdata))


def begin_allocate_to_pool(device: int, pool: tuple[int, int]) -> None:
    """Route this thread's CUDA allocations to the private pool ``pool`` (outside a capture).

    Private: the public route, ``torch.cuda.use_mem_pool``, takes a
    ``torch.cuda.MemPool``, not a graph pool id (``graph_pool_handle()``,
    ``CUDAGraph.pool()``); and a ``MemPool`` empties the allocator's cache when
    collected, which aborts the process if any capture is underway.
    """
    torch._C._cuda_beginAllocateCurrentThreadToPool(device, pool)


def end_allocate_to_pool(device: int, pool: tuple[int, int]) -> None:
    """End :func:`begin_allocate_to_pool` (or a failed capture's routing) and drop its pool count.

    Private for the same reason; also the only way to undo a capture's routing
    by hand when torch's own ``capture_end`` cannot run.
    """
    torch._C._cuda_endAllocateToPool(device, pool)
    torch._C._cuda_releasePool(device, pool)


def storage_at(address: int, device: torch.device, nbytes: int) -> torch.UntypedStorage:
    """A storage over ``nbytes`` at ``address`` that does not own (or free) the memory.

    Private: torch has no public constructor of a non-owning storage; bcg's
    non-owning aliases of pool memory and its poison fill need one.
    """
    return torch._C._construct_storage_from_data_pointer(address, device, nbytes)


def stream_readers() -> tuple[Callable[[], int], Callable[[int], int]]:
    """``(current device, current raw stream of a device)``, the cheapest way torch offers.

    Private: the public ``torch.cuda.current_stream()`` builds a Stream object
    at every call, which a replay would pay; these return plain ints. The
    public route is the fallback.
    """
    get_device = getattr(torch._C, "_cuda_getDevice", None)
    get_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if get_device is not None and get_stream is not None:
        return get_device, get_stream
    return torch.cuda.current_device, lambda device: int(torch.cuda.current_stream(device).cuda_stream)


# (torch.autograd.profiler, "_is_profiler_enabled"): see profiler_enabled
PROFILER_FLAG: tuple[Any, str] = (torch.autograd.profiler, "_is_profiler_enabled")


def profiler_enabled() -> bool:
    """Whether a torch profiler runs (replays then mark each step with ``record_function``):
    ``getattr(*PROFILER_FLAG)``, which the native replay reads without a Python call.

    Private: torch has no public query; this is the flag its own
    ``record_function`` reads.
    """
    return bool(getattr(*PROFILER_FLAG))


@contextlib.contextmanager
def without_mode(mode: TorchDispatchMode) -> Iterator[None]:
    """Run the block without ``mode`` when it is the innermost dispatch mode (else as is).

    Private: torch has no public way to suspend one mode for a block; its own
    modes use ``_pop_mode_temporarily`` for the same.
    """
    from torch.utils._python_dispatch import _get_current_dispatch_mode, _pop_mode_temporarily

    if _get_current_dispatch_mode() is not mode:
        yield
        return
    with _pop_mode_temporarily():
        yield


def view_base(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor ``t`` is a view of (``Tensor._base``), or None.

    Private-named, but the only way torch exposes it.
    """
    return t._base


def has_internal_overlap(t: torch.Tensor) -> bool:
    """Whether some elements of ``t`` share memory (an expanded or strided view).

    Private: the check torch's in-place ops run (``torch._debug_has_internal_overlap``);
    no public equivalent.
    """
    return bool(torch._debug_has_internal_overlap(t) == 1)


def dynamo_graphs() -> int:
    """Graphs Dynamo has compiled in this process so far (0 when Dynamo is not loaded).

    Private: Dynamo's counters are its only record of compiles; read without
    importing Dynamo.
    """
    utils = sys.modules.get("torch._dynamo.utils")
    counters = getattr(utils, "counters", None)
    if counters is None:
        return 0
    return int(counters["stats"]["unique_graphs"])


def inductor_config() -> Any:
    """Inductor's config module, if Inductor is loaded (None otherwise; never imported here).

    Private: Inductor's settings (its CUDA graphs included) have no public API
    beyond ``torch.compile``'s ``mode``/``options``, which apply per compile.
    """
    return sys.modules.get("torch._inductor.config")


@functools.cache
def has_triton() -> bool:
    """Whether Triton (Inductor's GPU backend) is usable here (asked once per process).

    Private: torch's own check (``torch.utils._triton.has_triton``); no public one.
    """
    from torch.utils._triton import has_triton as check

    return bool(check())


def maybe_mark_dynamic(t: torch.Tensor, dim: int) -> None:
    """Tell Dynamo that ``t``'s ``dim`` may change between calls (one compile for every size).

    Private-named: Dynamo's marking API lives in ``torch._dynamo``; ``torch.compiler``
    does not export it.
    """
    torch._dynamo.maybe_mark_dynamic(t, dim)


def fresh_inductor_cache() -> Any:
    """A context in which Inductor (and Triton) compile from empty on-disk caches.

    Private: Inductor's own test helper; torch has no public way to bypass its caches.
    """
    import torch._inductor.utils as inductor_utils

    return (getattr(inductor_utils, "fresh_cache", None) or getattr(inductor_utils, "fresh_inductor_cache"))()
