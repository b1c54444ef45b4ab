"""Memory accounting for graph pools (read from the caching allocator's snapshot)."""

from __future__ import annotations

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
