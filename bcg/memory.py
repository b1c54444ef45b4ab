"""Memory accounting for graph pools (read from the caching allocator's snapshot)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

PoolHandle = tuple[int, int]


def graph_pool_handle() -> PoolHandle:
    """A new private memory pool token; pass it as ``pool=`` to share one pool between graphs."""
    return torch.cuda.graph_pool_handle()


def pool_bytes(pool: PoolHandle | None, device: int | None = None) -> int:
    """Bytes the caching allocator has reserved for ``pool`` on ``device``."""
    if pool is None or not torch.cuda.is_available():
        return 0
    key = tuple(pool)
    total = 0
    segments: list[dict[str, Any]] = torch.cuda.memory_snapshot()
    for seg in segments:
        if device is not None and seg.get("device") != device:
            continue
        if tuple(seg.get("segment_pool_id", (0, 0))) == key:
            total += int(seg["total_size"])
    return total


class PoolReference:
    """One counted reference on a private pool: keeps it (and every block in it) alive.

    A graph holds one from capture until ``reset()``, so its pool outlives the
    individual segments and bridges allocated between segments.
    """

    def __init__(self, device: int, pool: PoolHandle) -> None:
        self.device, self.pool = device, pool
        torch._C._cuda_beginAllocateCurrentThreadToPool(device, pool)
        torch._C._cuda_endAllocateToPool(device, pool)
        self._held = True

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
        if self._held:
            self._held = False
            torch._C._cuda_releasePool(self.device, self.pool)
