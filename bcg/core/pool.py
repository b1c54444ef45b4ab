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
import gc
import warnings
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from bcg.core import cudart
from bcg.core.process import on_release
from bcg.errors import CaptureError
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


class _LeaseGraph(torch.cuda.CUDAGraph):
    """The empty graph that holds a :class:`PoolLease`'s counts, named after what the pool serves."""

    owner: str


class SegmentGraph(torch.cuda.CUDAGraph):
    """One segment of a bcg graph; in its pool, the graph is represented by its lease."""


class PoolLease:
    """A pool lease: a graph's hold on a private pool, from capture until ``reset()``.

    torch counts a pool's users in both its device and its pinned-host
    allocator, and asserts when a pool whose count dropped to zero is captured
    into again. The lease is an empty ``CUDAGraph`` captured into the pool
    (public API: it holds one count in each allocator), plus the graph's empty
    segments (consecutive breakpoints), which are kept until the lease ends: so
    neither a failed capture nor dropping empty segments takes the pool to zero
    while the graph lives.

    Arguments:
        owner: what the pool serves, for errors ("the bcg graph captured at ...").
    """

    def __init__(self, device: int, pool: PoolHandle, stream: torch.cuda.Stream, owner: str = "a bcg graph") -> None:
        self.device, self.pool = device, pool
        holder = _LeaseGraph()
        holder.owner = owner
        self._graphs: list[torch.cuda.CUDAGraph] = [holder]
        with torch.cuda.stream(stream), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*CUDA Graph is empty.*")
            # thread_local: a global-mode capture, however short, would refuse other threads'
            # cudaMalloc and synchronize (and its own capture would fail on theirs)
            try:
                begin_capture_into(holder, pool, "thread_local", stream)
            except RuntimeError as exc:
                if "use_count" not in str(exc):
                    raise
                raise CaptureError(
                    f"cannot capture into pool {tuple(pool)}: every graph captured into it was reset or freed "
                    "while tensors it allocated are still alive (say, an old graph's outputs), and torch "
                    "cannot share such a pool again. Capture into a new pool (bcg.graph_pool_handle()), "
                    "keep one graph of the pool captured while capturing the next, or drop those tensors first"
                ) from exc
            holder.capture_end()
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


def begin_capture_into(graph: torch.cuda.CUDAGraph, pool: PoolHandle, mode: str, stream: torch.cuda.Stream,
                       generators: tuple[torch.Generator, ...] = ()) -> None:
    """``graph.capture_begin(pool=pool)`` on ``stream`` (the current stream); if torch refuses, no
    capture is left open on ``stream`` and torch's RNG capture state is closed again (torch opens
    it before it routes allocations to the pool, which is where a refused pool fails) for the
    default generator and ``generators`` (those registered with ``graph``)."""
    try:
        graph.capture_begin(pool=pool, capture_error_mode=mode)
    except BaseException:
        cudart.end_capture(int(stream.cuda_stream))
        reset_rng_capture_state(stream, generators)
        raise


def reset_rng_capture_state(stream: torch.cuda.Stream, generators: tuple[torch.Generator, ...] = ()) -> None:
    """Close the capture state of the default generator and ``generators`` left open by a failed
    ``capture_begin``/``capture_end``.

    torch marks the generators of a graph as capturing in ``capture_begin`` and
    unmarks them only in a successful ``capture_end``; after a failed one every
    eager random op would raise. An empty capture runs the prologue/epilogue pair.
    """
    repair = torch.cuda.CUDAGraph()
    for generator in generators:
        repair.register_generator_state(generator)
    with torch.cuda.stream(stream), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*CUDA Graph is empty.*")
        repair.capture_begin(capture_error_mode="thread_local")  # (see PoolLease: other threads go on)
        repair.capture_end()
    repair.reset()


def _reset_all(graphs: list[torch.cuda.CUDAGraph]) -> None:
    while graphs:
        graphs.pop().reset()


def _captured(graph: torch.cuda.CUDAGraph) -> bool:
    """Whether ``graph`` holds a capture (torch's ``pool()`` refuses before capture and after reset)."""
    try:
        graph.pool()
    except RuntimeError:
        return False
    return True


class PoolWriters:
    """The live graphs captured into one private pool: what rewrites the tensors that live there.

    A tensor in another graph's pool is that graph's output (or its scratch):
    the other graph's replay writes it, so a graph that reads it does not read
    stale values while one of these graphs still holds its capture. bcg's own
    graphs are represented by their leases, torch's by themselves; both are
    referenced weakly.
    """

    def __init__(self, pool: PoolHandle, graphs: list[torch.cuda.CUDAGraph]) -> None:
        leases = [g for g in graphs if isinstance(g, _LeaseGraph)]
        if leases:  # a bcg graph's segments live exactly as long as its lease
            graphs = leases
            name = leases[0].owner
        else:
            name = f"the torch.cuda.CUDAGraph captured into pool {tuple(pool)}"
        if len(graphs) > 1:
            name += f" (and {len(graphs) - 1} other graph(s) sharing its pool)"
        self.name = name
        self._graphs = [weakref.ref(g) for g in graphs]

    def alive(self) -> bool:
        """Whether one of the graphs still holds its capture (not reset, not freed)."""
        return any(g is not None and _captured(g) for g in (r() for r in self._graphs))


def pool_writers(pool: PoolHandle, lease: PoolLease | None = None) -> PoolWriters | None:
    """The graphs captured into ``pool`` and still holding their capture, but for ``lease``'s
    (the capture asking); None if there is none."""
    pool = tuple(pool)
    mine = lease._graphs[0] if lease is not None and lease._graphs else None
    # torch keeps no registry of its graphs by pool (a pool id leads to no CUDAGraph object): the
    # collector's list of tracked objects is the one place every live CUDAGraph can be found. Asked
    # once per foreign pool per capture, never at replay.
    graphs = [
        obj for obj in gc.get_objects()
        if issubclass(type(obj), torch.cuda.CUDAGraph) and not isinstance(obj, SegmentGraph) and obj is not mine
        and _captured(obj) and tuple(obj.pool()) == pool
    ]
    return PoolWriters(pool, graphs) if graphs else None


_HOST_COPIES = (torch.ops.aten.copy_.default, torch.ops.aten._to_copy.default)
_GLOBAL_POOL = (0, 0)


class SegmentMap:
    """The caching allocator's segments at one moment (a capture's start), by address.

    :meth:`external` tells a storage that lives outside the capture's own
    ``pools`` (the global pool, other graphs' pools, pinned host memory) from
    one inside them, or in a segment allocated since (the capture's own);
    :meth:`writers` tells which other graphs' pool a storage lives in.

    Arguments:
        pools: the capture's own pools.
        lease: the capture's lease on a pool it may share with other graphs: then
            a tensor allocated in that pool before the capture began (another
            graph's output) is external too, and rewritten by the pool's other graphs.
    """

    def __init__(self, pools: Iterable[PoolHandle], lease: PoolLease | None = None) -> None:
        own = {tuple(p) for p in pools}
        shared = tuple(lease.pool) if lease is not None else None
        self._lease = lease
        ranges = []
        self._before: set[int] = set()  # blocks of the shared pool in use when the capture began
        for seg in segments():
            start, pool = int(seg["address"]), tuple(seg.get("segment_pool_id", _GLOBAL_POOL))
            ranges.append((start, start + int(seg["total_size"]), pool in own, pool))
            if pool == shared:
                address = start
                for block in seg["blocks"]:
                    if block["state"] == "active_allocated":
                        self._before.add(address)
                    address += int(block["size"])
        ranges.sort()
        self._starts = [start for start, _, _, _ in ranges]
        self._ranges = ranges
        self._writers: dict[PoolHandle, PoolWriters | None] = {}

    def _range(self, ptr: int) -> tuple[int, int, bool, PoolHandle] | None:
        i = bisect.bisect_right(self._starts, ptr) - 1
        if i < 0 or ptr >= self._ranges[i][1]:
            return None
        return self._ranges[i]

    def external(self, op: Any, t: torch.Tensor, ptr: int) -> bool:
        """Whether ``t`` (storage address ``ptr``), an argument of ATen operation ``op``, lives
        outside the capture's pools: on the device, in a segment of another pool; on the host,
        pinned memory that a copy reads by address (other operations take host values)."""
        kind = t.device.type
        if kind == "cpu":
            return op in _HOST_COPIES and t.is_pinned()
        if kind != "cuda":
            return False
        found = self._range(ptr)
        return found is not None and (not found[2] or ptr in self._before)

    def writers(self, ptr: int) -> PoolWriters | None:
        """The other live graphs whose private pool holds the device storage at ``ptr`` (None: it
        lives in the global pool, or in a pool no other live graph was captured into)."""
        found = self._range(ptr)
        if found is None or found[3] == _GLOBAL_POOL:
            return None
        pool = found[3]
        if pool not in self._writers:
            self._writers[pool] = pool_writers(pool, self._lease)
        return self._writers[pool]


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
