"""Graph memory pools: the pool token, what keeps a pool alive, and what lives in it.

Every graph bcg captures records its segments into one private pool of torch's
caching allocator (shared between graphs with ``pool=``). Everything here reads
the allocator's own bookkeeping (``torch.cuda.memory_snapshot()``): one
walker, :func:`segments`, answers every question about a pool.

Who keeps the memory a replay touches alive: tensors that live in the graph's
private pool (breakpoint arguments, bridges) are held through non-owning
aliases; the pool itself (kept alive by the graph's segments) owns them. Later
segments, and later captures into the same pool, reuse that memory as soon as
the captured code drops its last reference, exactly as ``torch.cuda.graph``
reuses its temporaries within one capture. Why this is safe:

* A replay performs the same reads and writes in the same order as the
  capture. At capture, memory is handed out again only after everything that
  reads it has run (a breakpoint's arguments are referenced until it returns;
  a bridge until the code after it drops it), so at replay every reader of a
  block runs before its next writer, and every value is rewritten before it is
  read. A bridge is refreshed at its breakpoint, before the segments that read
  it, whatever used its memory earlier in the replay.
* Graphs sharing a pool replay one at a time (the documented rule, as for
  ``torch.cuda.graph``): each replay rewrites what it reads, so the graphs may
  share blocks; a graph's outputs are valid until another graph of the pool replays.
* What the caller still references (outputs, tensors kept in Python) is
  never reused: aliasing replaces only the graph's own references.
* Tensors outside the pool (static inputs, caches, weights, eager results) are
  held strongly (see :mod:`bcg.core.storages`).

With ``bcg.Debug(poison=True)`` (NaN in free pool memory before every replay)
a read of memory that nothing wrote in this replay shows up as NaN.
"""

from __future__ import annotations

import bisect
import contextlib
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from bcg.core.process import on_release
from bcg.core.torch_internals import begin_allocate_to_pool, end_allocate_to_pool, pytree, storage_at

PoolHandle = tuple[int, int]


def graph_pool_handle() -> PoolHandle:
    """A new private memory pool token; pass it as ``pool=`` to share one pool between graphs."""
    return torch.cuda.graph_pool_handle()


def segments(device: int | None = None, pool: PoolHandle | None = None) -> list[dict[str, Any]]:
    """The caching allocator's segments (``torch.cuda.memory_snapshot()``), on ``device`` and in ``pool`` if given."""
    if not torch.cuda.is_available():
        return []
    key = tuple(pool) if pool is not None else None
    return [
        seg
        for seg in torch.cuda.memory_snapshot()
        if (device is None or seg.get("device") == device)
        and (key is None or tuple(seg.get("segment_pool_id", (0, 0))) == key)
    ]


def blocks(device: int | None = None, pool: PoolHandle | None = None) -> Iterator[tuple[int, int, bool]]:
    """``(address, size, in_use)`` of every block of :func:`segments` (``in_use``: allocated, or pending free)."""
    for seg in segments(device, pool):
        address = int(seg["address"])
        for block in seg["blocks"]:
            size = int(block["size"])
            yield address, size, block["state"] != "inactive"
            address += size


def pool_bytes(pool: PoolHandle | None, device: int | None = None) -> int:
    """Bytes the caching allocator has reserved for ``pool`` on ``device``."""
    if pool is None:
        return 0
    return sum(int(seg["total_size"]) for seg in segments(device, pool))


class PoolLease:
    """A graph's share of a private pool, from capture until ``reset()``.

    torch counts a pool's users in both its device and its pinned-host
    allocator, and asserts when a pool whose count dropped to zero is captured
    into again. The lease is an empty ``CUDAGraph`` captured into the pool
    (public API: it holds one count in each allocator), plus the graph's empty
    segments (consecutive breakpoints), which are kept until the lease ends: so
    neither a failed capture nor dropping empty segments takes the pool to zero
    while the graph lives.
    """

    def __init__(self, device: int, pool: PoolHandle, stream: torch.cuda.Stream) -> None:
        self.device, self.pool = device, pool
        self._graphs: list[torch.cuda.CUDAGraph] = [torch.cuda.CUDAGraph()]
        with torch.cuda.stream(stream), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*CUDA Graph is empty.*")
            # thread_local: a global-mode capture, however short, would refuse other threads'
            # cudaMalloc and synchronize (and its own capture would fail on theirs)
            self._graphs[0].capture_begin(pool=pool, capture_error_mode="thread_local")
            self._graphs[0].capture_end()
        self._release = on_release(self, lambda graphs=self._graphs: _reset_all(graphs))

    def keep(self, graph: torch.cuda.CUDAGraph) -> None:
        """Hold a captured segment that is never launched (an empty one, or one whose ranks
        voted to abandon the capture), with its pool count, until :meth:`release`."""
        self._graphs.append(graph)

    @contextlib.contextmanager
    def allocating(self) -> Iterator[None]:
        """Route this thread's CUDA allocations to the pool inside the block (outside capture)."""
        begin_allocate_to_pool(self.device, self.pool)
        try:
            yield
        finally:
            end_allocate_to_pool(self.device, self.pool)

    def release(self) -> None:
        """Drop the graph's counts on the pool (idempotent; deferred while a capture runs)."""
        self._release()


def _reset_all(graphs: list[torch.cuda.CUDAGraph]) -> None:
    while graphs:
        graphs.pop().reset()


_HOST_COPIES = (torch.ops.aten.copy_.default, torch.ops.aten._to_copy.default)


class SegmentMap:
    """The caching allocator's segments at one moment (a capture's start), by address.

    :meth:`external` tells a storage that lives outside the capture's own
    ``pools`` (the global pool, other graphs' pools, pinned host memory) from
    one inside them, or in a segment allocated since (the capture's own).
    """

    def __init__(self, pools: Iterable[PoolHandle]) -> None:
        own = {tuple(p) for p in pools}
        ranges = sorted(
            (int(seg["address"]), int(seg["address"]) + int(seg["total_size"]),
             tuple(seg.get("segment_pool_id", (0, 0))) in own)
            for seg in segments()
        )
        self._starts = [start for start, _, _ in ranges]
        self._ranges = ranges

    def external(self, op: Any, t: torch.Tensor, ptr: int) -> bool:
        """Whether ``t`` (storage address ``ptr``), an argument of ATen operation ``op``, lives
        outside the capture's pools: on the device, in a segment of another pool; on the host,
        pinned memory that a copy reads by address (other operations take host values)."""
        kind = t.device.type
        if kind == "cpu":
            return op in _HOST_COPIES and t.is_pinned()
        if kind != "cuda":
            return False
        i = bisect.bisect_right(self._starts, ptr) - 1
        if i < 0:
            return False
        _, end, own = self._ranges[i]
        return ptr < end and not own


def non_owning_alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor viewing ``t``'s memory that does not keep it alive."""
    storage = t.untyped_storage()
    alias_storage = storage_at(storage.data_ptr(), t.device, storage.nbytes())
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(
        alias_storage, t.storage_offset(), t.shape, t.stride()
    )


class PoolMembership:
    """Answers "does this tensor live in ``pool``?" from the allocator's segment map.

    A miss re-reads the map once (the pool grows during capture); addresses
    found outside it are remembered as outside, which is the safe answer.
    """

    def __init__(self, pool: PoolHandle, device: int) -> None:
        self._pool = tuple(pool)
        self._device = device
        self._ranges: list[tuple[int, int]] = []
        self._outside: set[int] = set()

    def _refresh(self) -> None:
        self._ranges = [
            (int(seg["address"]), int(seg["address"]) + int(seg["total_size"]))
            for seg in segments(self._device, self._pool)
        ]

    def _in_ranges(self, ptr: int) -> bool:
        return any(lo <= ptr < hi for lo, hi in self._ranges)

    def contains(self, t: torch.Tensor) -> bool:
        if t.device.type != "cuda":
            return False
        ptr = t.untyped_storage().data_ptr()
        if ptr in self._outside:
            return False
        if self._in_ranges(ptr):
            return True
        self._refresh()
        if self._in_ranges(ptr):
            return True
        self._outside.add(ptr)
        return False

    def release(self, tree: Any) -> Any:
        """``tree`` with its pool-resident tensors replaced by non-owning aliases."""
        return pytree.tree_map_only(
            torch.Tensor, lambda t: non_owning_alias(t) if self.contains(t) else t, tree
        )


def poison_free_pool_memory(pool: PoolHandle, device: int) -> int:
    """Fill every free block of ``pool`` with 0xFF bytes; return how many bytes."""
    poisoned = 0
    for address, size, in_use in blocks(device, pool):
        if not in_use and size > 0:
            storage = storage_at(address, torch.device("cuda", device), size)
            torch.empty(0, dtype=torch.uint8, device=f"cuda:{device}").set_(storage, 0, (size,), (1,)).fill_(0xFF)
            poisoned += size
    return poisoned
