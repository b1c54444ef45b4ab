"""Memory accounting for graph pools (read from the caching allocator's snapshot)."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch

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


class PoolAnchor:
    """Keeps a private pool alive from capture until ``reset()``.

    torch counts a pool's users in both its device and its pinned-host
    allocator, and a pool whose count dropped to zero must not be captured into
    again. The anchor is an empty ``CUDAGraph`` captured into the pool: it holds
    one count in each, so dropping empty segments or a failed capture never
    takes the pool to zero while the graph lives.
    """

    def __init__(self, device: int, pool: PoolHandle, stream: torch.cuda.Stream) -> None:
        self.device, self.pool = device, pool
        self._graph: torch.cuda.CUDAGraph | None = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*CUDA Graph is empty.*")
            self._graph.capture_begin(pool=pool)
            self._graph.capture_end()

    @contextlib.contextmanager
    def allocating(self) -> Iterator[None]:
        """Route this thread's CUDA allocations to the pool inside the block (outside capture)."""
        torch._C._cuda_beginAllocateCurrentThreadToPool(self.device, self.pool)
        try:
            yield
        finally:
            torch._C._cuda_endAllocateToPool(self.device, self.pool)
            torch._C._cuda_releasePool(self.device, self.pool)

    def release(self) -> None:
        if self._graph is not None:
            self._graph.reset()
            self._graph = None
