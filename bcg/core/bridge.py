"""Bridges: graph-owned buffers that carry a breakpoint's returned tensors into the next segment.

At capture, every tensor a breakpoint returns gets a bridge, allocated in the
graph's pool and owned by the graph, and the caller receives the bridge (so the
following segment is captured reading the bridge's address). At replay the
fresh result is copied into it.

One exception: a result that *is* one of the breakpoint's tensor arguments --
the same view: storage, offset, shape, strides and dtype -- was written in
place, and later segments read that argument's memory as the result. It needs
no bridge, but it must be that same argument at every replay: copying another
tensor there would overwrite the argument, which later segments also read. Any
other result, a different view of an argument included, gets a bridge.

The same :class:`BridgeSet` holds a breakpoint's output contract (structure,
shapes, dtypes, frozen non-tensor values, in-place results) for eager mode,
where it checks every call but allocates nothing.
"""

from __future__ import annotations

from typing import Any

import torch
from bcg.core.torch_internals import pytree

from bcg.errors import BreakpointOutputMismatch
from bcg.core.breakpoint import tensor_leaves

_VALUE, _BRIDGE, _IN_PLACE = 0, 1, 2

_ViewKey = tuple[int, int, tuple[int, ...], tuple[int, ...], torch.dtype]


def view_key(t: torch.Tensor) -> _ViewKey:
    """What makes two tensors the same view: storage address, offset, shape, strides, dtype."""
    return t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype


def in_place_position(leaf: torch.Tensor, arg_keys: dict[_ViewKey, int]) -> int | None:
    """The position (among the call's tensor arguments) of the argument ``leaf`` is exactly, if any."""
    return arg_keys.get(view_key(leaf))


def argument_keys(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[_ViewKey, int]:
    """The view of each tensor argument of a call, to its position (the first, if repeated)."""
    keys: dict[_ViewKey, int] = {}
    for i, t in enumerate(tensor_leaves((args, kwargs))):
        keys.setdefault(view_key(t), i)
    return keys


class BridgeSet:
    """The bridges of one breakpoint call, plus its frozen non-tensor return values.

    Arguments:
        name: the breakpoint's name, for errors.
        result: what the breakpoint returned at capture.
        args, kwargs: the call's arguments (results that are one of them exactly
            are in-place results, see the module documentation).
        allocate: ``False`` records the contract only (eager mode): no bridge
            is allocated and :meth:`check` compares later calls with it.
    """

    __slots__ = ("name", "_spec", "_leaves", "_kinds", "_meta", "_keys", "_single", "_none", "nbytes")

    def __init__(
        self, name: str, result: Any, args: tuple[Any, ...], kwargs: dict[str, Any], *, allocate: bool = True
    ) -> None:
        self.name = name
        leaves, self._spec = pytree.tree_flatten(result)
        arg_keys = argument_keys(args, kwargs)
        self._leaves: list[Any] = []
        self._kinds: list[int] = []
        self._meta: list[tuple[torch.Size, torch.dtype, torch.device] | None] = []
        self._keys: list[tuple[int, _ViewKey] | None] = []  # in-place results: (position, view)
        self.nbytes = 0
        for leaf in leaves:
            if not isinstance(leaf, torch.Tensor):
                self._kinds.append(_VALUE)
                self._leaves.append(leaf)
                self._meta.append(None)
                self._keys.append(None)
                continue
            self._meta.append((leaf.shape, leaf.dtype, leaf.device))
            pos = in_place_position(leaf, arg_keys)
            if pos is not None:
                self._kinds.append(_IN_PLACE)
                self._keys.append((pos, view_key(leaf)))
                self._leaves.append(leaf if allocate else None)
                continue
            self._kinds.append(_BRIDGE)
            self._keys.append(None)
            if allocate:
                bridge = torch.empty_like(leaf)
                bridge.copy_(leaf)
                self.nbytes += bridge.untyped_storage().nbytes()
                self._leaves.append(bridge)
            else:
                self._leaves.append(None)
        # Fast path for the common shape of a result: one tensor.
        self._single = isinstance(result, torch.Tensor)
        self._none = result is None  # pytree flattens None to one leaf, None

    @property
    def empty(self) -> bool:
        """Nothing to refresh or check when a replay returns None: the capture returned None (or
        an empty structure). A replay that returns something else must still be checked."""
        return self._none or not self._kinds

    def caller_result(self) -> Any:
        """What the caller receives at capture: the result with tensors replaced by bridges."""
        return pytree.tree_unflatten(self._leaves, self._spec)

    def hold_through(self, release: Any) -> None:
        """Hold each bridge and in-place result as ``release(tensor)`` from now on (non-owning aliases, see :mod:`bcg.core.pool`)."""
        self._leaves = [release(x) if k != _VALUE else x for x, k in zip(self._leaves, self._kinds)]

    def tensors(self) -> list[torch.Tensor]:
        """The tensors later segments read: bridges and in-place results, in result order."""
        return [x for x, k in zip(self._leaves, self._kinds) if k != _VALUE]

    def bridged(self) -> list[bool]:
        """For each entry of :meth:`tensors`: is it a graph-owned bridge (not an argument)?"""
        return [k == _BRIDGE for k in self._kinds if k != _VALUE]

    def refresh(self, result: Any) -> None:
        """Copy a replay's fresh result into the bridges (checks the contract first)."""
        if self._single and isinstance(result, torch.Tensor):
            self._refresh_tensor(0, result, None)
            return
        for i, leaf in self._leaves_of(result):
            self._refresh_tensor(i, leaf, None)

    def check(self, result: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Check an eager call's result against the contract (``allocate=False`` sets)."""
        arg_tensors: list[torch.Tensor] | None = None
        for i, leaf in self._leaves_of(result):
            if self._kinds[i] == _IN_PLACE and arg_tensors is None:
                arg_tensors = tensor_leaves((args, kwargs))
            self._refresh_tensor(i, leaf, arg_tensors)

    def _leaves_of(self, result: Any) -> list[tuple[int, torch.Tensor]]:
        """The tensor leaves of ``result`` by position, after checking structure and frozen values."""
        if result is None and self.empty:
            return []
        leaves, spec = pytree.tree_flatten(result)
        if spec != self._spec:
            raise BreakpointOutputMismatch(
                f"breakpoint {self.name!r} returned a {spec} at replay but a "
                f"{self._spec} at capture; a breakpoint must return the same structure every time"
            )
        out = []
        for i, leaf in enumerate(leaves):
            if self._kinds[i] != _VALUE:
                if not isinstance(leaf, torch.Tensor):
                    raise BreakpointOutputMismatch(
                        f"breakpoint {self.name!r} output {i} was a tensor at capture "
                        f"but is {type(leaf).__name__} at replay"
                    )
                out.append((i, leaf))
            elif not same_value(leaf, self._leaves[i]):
                raise BreakpointOutputMismatch(
                    f"breakpoint {self.name!r} output {i} is {leaf!r} at replay but was "
                    f"{self._leaves[i]!r} at capture; non-tensor results are frozen at capture "
                    "(the segments after it were recorded with that value): return a tensor "
                    "instead, or keep the value constant"
                )
        return out

    def _refresh_tensor(self, i: int, fresh: torch.Tensor, arg_tensors: list[torch.Tensor] | None) -> None:
        target = self._leaves[i]
        if fresh is target:
            return  # the argument written in place, or the bridge itself
        if self._kinds[i] == _IN_PLACE:
            pos, key = self._keys[i]  # type: ignore[misc]
            if arg_tensors is not None:
                key = view_key(arg_tensors[pos])
            if view_key(fresh) != key:
                raise BreakpointOutputMismatch(
                    f"breakpoint {self.name!r} output {i} was its tensor argument {pos} itself at capture "
                    "(written in place: the segments after it read that argument's memory as this "
                    "output), but at this replay it is a different tensor or view. Copying it there "
                    "would overwrite the argument, which later segments also read. Return a new "
                    "tensor in every case (e.g. x.clone() where you returned x), or always return "
                    "the argument itself"
                )
            return
        shape, dtype, device = self._meta[i]  # type: ignore[misc]
        if fresh.shape != shape or fresh.dtype != dtype or fresh.device != device:
            raise BreakpointOutputMismatch(
                f"breakpoint {self.name!r} output {i} is {tuple(fresh.shape)} {fresh.dtype} on "
                f"{fresh.device} at replay but its bridge was captured as {tuple(shape)} "
                f"{dtype} on {device}; shapes and dtypes are fixed at capture"
            )
        if target is not None:
            target.copy_(fresh)


def same_value(a: Any, b: Any) -> bool:
    """``a == b`` for frozen Python values, never raising (identity first)."""
    if a is b:
        return True
    try:
        return bool(a == b)
    except Exception:
        return False
