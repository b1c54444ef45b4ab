"""Who keeps the memory a replay touches alive.

``ownership="graph"`` (default): the graph holds a strong reference to every
tensor a breakpoint reads or returns, so nothing it recorded can be handed to
anybody else while the graph lives.

``ownership="pool"``: tensors that live in the graph's private pool are held
through non-owning aliases; the pool itself (kept alive by the graph's
segments) owns them. Later segments and later captures into the same pool may
then reuse that memory, as torch.cuda.graph does with its temporaries. Safe
because a replay rewrites such memory before reading it, provided graphs that
share a pool never replay concurrently. Tensors outside the pool (static
inputs, caches, weights, eager results) are always held strongly.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch.utils import _pytree as pytree

from bcg.memory import PoolHandle, segments

Ownership = Literal["graph", "pool"]
OWNERSHIPS = ("graph", "pool")


def non_owning_alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor viewing ``t``'s memory that does not keep it alive."""
    storage = t.untyped_storage()
    alias_storage = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), t.device, storage.nbytes())
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
