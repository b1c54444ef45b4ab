"""Bridges: graph-owned buffers that carry a breakpoint's returned tensors into the next segment.

At capture, every tensor a breakpoint returns gets a bridge, allocated in the
graph's pool and owned by the graph, and the caller receives the bridge (so the following segment is
captured reading the bridge's address). At replay the fresh result is copied
into it. A returned tensor that lives in one of the breakpoint's own tensor
arguments (an in-place write) is its own bridge: no copy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from bcg.errors import BreakpointOutputMismatch


def _storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def tensor_storages(args: tuple[Any, ...], kwargs: dict[str, Any]) -> set[int]:
    """Storage addresses of every tensor reachable in ``args``/``kwargs``."""
    leaves = pytree.tree_leaves((args, kwargs))
    return {_storage_ptr(x) for x in leaves if isinstance(x, torch.Tensor)}


class BridgeSet:
    """The bridges of one breakpoint call, plus its frozen non-tensor return values."""

    __slots__ = ("name", "_spec", "_leaves", "_is_bridge", "_single", "nbytes")

    def __init__(self, name: str, result: Any, arg_storages: set[int]) -> None:
        self.name = name
        leaves, self._spec = pytree.tree_flatten(result)
        self._leaves: list[Any] = []
        self._is_bridge: list[bool] = []
        self.nbytes = 0
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                if _storage_ptr(leaf) in arg_storages:
                    bridge = leaf  # in-place result: lives in an argument the graph owns
                else:
                    bridge = torch.empty_like(leaf)
                    bridge.copy_(leaf)
                    self.nbytes += bridge.untyped_storage().nbytes()
                self._leaves.append(bridge)
                self._is_bridge.append(True)
            else:
                self._leaves.append(leaf)
                self._is_bridge.append(False)
        # Fast paths for the common shapes of a result: None, or one tensor.
        self._single = isinstance(result, torch.Tensor)

    @property
    def empty(self) -> bool:
        return not self._leaves

    def caller_result(self) -> Any:
        """What the caller receives at capture: the result with tensors replaced by bridges."""
        return pytree.tree_unflatten(self._leaves, self._spec)

    def hold_through(self, release: Callable[[Any], Any]) -> None:
        """Hold each bridge as ``release(bridge)`` from now on (``ownership="pool"``)."""
        self._leaves = [release(x) if b else x for x, b in zip(self._leaves, self._is_bridge)]

    def tensors(self) -> list[torch.Tensor]:
        return [leaf for leaf, b in zip(self._leaves, self._is_bridge) if b]

    def refresh(self, result: Any) -> None:
        """Copy a replay's fresh result into the bridges (checks its contract first)."""
        if self._single and isinstance(result, torch.Tensor):
            self._refresh_tensor(0, result)
            return
        if result is None and not self._leaves:
            return
        leaves, spec = pytree.tree_flatten(result)
        if spec != self._spec:
            raise BreakpointOutputMismatch(
                f"breakpoint {self.name!r} returned a {spec} at replay but a "
                f"{self._spec} at capture; a breakpoint must return the same structure every time"
            )
        for i, leaf in enumerate(leaves):
            if self._is_bridge[i]:
                if not isinstance(leaf, torch.Tensor):
                    raise BreakpointOutputMismatch(
                        f"breakpoint {self.name!r} output {i} was a tensor at capture "
                        f"but is {type(leaf).__name__} at replay"
                    )
                self._refresh_tensor(i, leaf)
            elif not same_value(leaf, self._leaves[i]):
                raise BreakpointOutputMismatch(
                    f"breakpoint {self.name!r} output {i} is {leaf!r} at replay but was "
                    f"{self._leaves[i]!r} at capture; non-tensor results are frozen at capture "
                    "(the segments after it were recorded with that value): return a tensor "
                    "instead, or keep the value constant"
                )

    def _refresh_tensor(self, i: int, fresh: torch.Tensor) -> None:
        bridge: torch.Tensor = self._leaves[i]
        if fresh is bridge:
            return  # the breakpoint returned the argument it wrote in place
        if fresh.shape != bridge.shape or fresh.dtype != bridge.dtype or fresh.device != bridge.device:
            raise BreakpointOutputMismatch(
                f"breakpoint {self.name!r} output {i} is {tuple(fresh.shape)} {fresh.dtype} on "
                f"{fresh.device} at replay but its bridge was captured as {tuple(bridge.shape)} "
                f"{bridge.dtype} on {bridge.device}; shapes and dtypes are fixed at capture"
            )
        if fresh.data_ptr() == bridge.data_ptr() and fresh.stride() == bridge.stride():
            return  # written in place
        bridge.copy_(fresh)


def same_value(a: Any, b: Any) -> bool:
    """``a == b`` for frozen Python values, never raising (identity first)."""
    if a is b:
        return True
    try:
        return bool(a == b)
    except Exception:
        return False
