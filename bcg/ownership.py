"""Who keeps the memory a replay touches alive.

``ownership="pool"`` (default): tensors that live in the graph's private pool
(breakpoint arguments, bridges) are held through non-owning aliases; the pool
itself (kept alive by the graph's segments) owns them. Later segments, and
later captures into the same pool, reuse that memory as soon as the captured
code drops its last reference, exactly as ``torch.cuda.graph`` reuses its
temporaries within one capture. Why this is safe:

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
  always held strongly.

``ownership="graph"``: the graph holds a strong reference to every tensor a
breakpoint reads or returns, so nothing it recorded is reused, by its own later
segments or by anybody else, while the graph lives. The pool then grows with
the number of breakpoints. For debugging: with ``poison=True`` (NaN in free
pool memory before every replay) a difference between the two ownerships shows
that something read memory it did not own.
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
