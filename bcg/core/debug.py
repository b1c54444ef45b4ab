"""Debugging aids used at replay: guards and poison.

*Guards* (``bcg.capture(..., debug=bcg.Debug(guards=True))`` or ``BCG_GUARDS=1``): before each
replay, every tensor a breakpoint receives and every declared static input
must still have its captured address, shape, stride and dtype; a violation
raises ``GuardError`` naming the tensor.

*Poison* (``BCG_POISON=1`` at capture, or ``bcg.Debug(poison=True)``): before each
replay, the free blocks of the graph's private pool are filled with 0xFF bytes
(NaN in every float format) and the pool-resident floating-point breakpoint
arguments and bridges it holds with NaN, so a read of memory nothing wrote during
this replay — a stale intermediate, a padded row no one filled — shows up as
NaN in the outputs. Slow (it reads the allocator's segment map): debugging only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from bcg.core.torch_internals import pytree

from bcg.core.args import check_bool
from bcg.core.env import env_flag
from bcg.core.pool import PoolHandle, poison_free_pool_memory
from bcg.errors import GuardError


@dataclass(frozen=True)
class Debug:
    """Debugging aids a graph applies before every replay (slow: for finding bugs, not serving).

    Arguments:
        guards: every static input (``make_graph``'s) and every tensor a
            breakpoint receives must keep its captured address, shape, stride
            and dtype; a violation raises :class:`bcg.errors.GuardError` naming it.
        poison: fill the pool's free blocks, and the pool-resident breakpoint
            arguments and bridges (which every replay must rewrite before
            reading), with NaN: a read of memory nothing wrote shows up as NaN.

    ``bcg.capture(..., debug=None)`` (the default) reads ``BCG_GUARDS`` and
    ``BCG_POISON`` from the environment. Both are bools (``TypeError`` otherwise).
    """

    guards: bool = False
    poison: bool = False

    def __post_init__(self) -> None:
        check_bool("bcg.Debug", "guards", self.guards)
        check_bool("bcg.Debug", "poison", self.poison)

    @classmethod
    def from_env(cls) -> Debug:
        return cls(guards=env_flag("BCG_GUARDS"), poison=env_flag("BCG_POISON"))


@dataclass(frozen=True)
class _Guard:
    name: str
    tensor: torch.Tensor
    data_ptr: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    def violation(self) -> str | None:
        t = self.tensor
        if t.data_ptr() != self.data_ptr:
            return f"its address moved from {self.data_ptr:#x} to {t.data_ptr():#x} (reallocated or .set_())"
        if tuple(t.shape) != self.shape or t.stride() != self.stride:
            return f"its shape/stride changed from {self.shape}/{self.stride} to {tuple(t.shape)}/{t.stride()}"
        if t.dtype != self.dtype:
            return f"its dtype changed from {self.dtype} to {t.dtype}"
        return None


class Guards:
    """The captured signature of every tensor a replay depends on."""

    def __init__(self) -> None:
        self._guards: list[_Guard] = []

    def add(self, name: str, tree: Any) -> None:
        leaves = pytree.tree_leaves(tree)
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        for i, t in enumerate(tensors):
            label = name if len(tensors) == 1 else f"{name}[{i}]"
            self._guards.append(_Guard(label, t, t.data_ptr(), tuple(t.shape), t.stride(), t.dtype))

    def __len__(self) -> int:
        return len(self._guards)

    def check(self) -> None:
        for g in self._guards:
            problem = g.violation()
            if problem is not None:
                raise GuardError(
                    f"bcg guard: {g.name} no longer matches the capture: {problem}. The captured "
                    "segments still use the old address; write new values into the captured "
                    "tensor in place (tensor.copy_(new)) instead of replacing it, or capture again."
                )


class Poison:
    """Fills, before each replay, the pool's free blocks and the pool-resident
    tensors the graph holds (breakpoint arguments and bridges, which every
    replay must rewrite before reading) with 0xFF bytes."""

    def __init__(self, pool: PoolHandle, device: int, held: list[torch.Tensor]) -> None:
        self.pool, self.device, self.held = pool, device, held

    def apply(self) -> int:
        for t in self.held:
            if t.is_floating_point():
                t.fill_(float("nan"))
        return poison_free_pool_memory(self.pool, self.device)


__all__ = ["Debug", "Guards", "Poison"]
