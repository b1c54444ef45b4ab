"""Eager recording: run the code as-is and record its segment/breakpoint structure.

Used by ``make_graph(..., mode="eager")`` (debugging, machines with no CUDA).
Work between breakpoints is counted in ATen operations through a dispatch
mode, so a region with no tensor work is not a segment, as in graph mode.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bcg.breakpoint_spec import BreakpointSpec
from bcg.plan import BreakpointStep, SegmentStep, Step

log = logging.getLogger("bcg")


class _OpCounter(TorchDispatchMode):
    """Counts non-view ATen operations while ``counting`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.counting = True

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.counting and not getattr(func, "is_view", False):
            self.ops += 1
        return func(*args, **(kwargs or {}))


class EagerRecorder:
    """The active recorder of an eager-mode run: runs breakpoints plainly, records structure."""

    def __init__(self) -> None:
        self.plan: list[Step] = []
        self._counter = _OpCounter()
        self._segments = 0
        self._breakpoints = 0

    def __enter__(self) -> EagerRecorder:
        self._counter.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            if exc[0] is None:
                self._close_region()
        finally:
            self._counter.__exit__(*exc)

    def _close_region(self) -> None:
        if self._counter.ops:
            self.plan.append(SegmentStep(index=self._segments, cuda_graph=None, nodes=self._counter.ops, kernel_nodes=None))
            self._segments += 1
        self._counter.ops = 0

    def call_breakpoint(
        self, spec: BreakpointSpec, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        if not spec.is_enabled():
            return spec.fn(*args, **kwargs)
        self._close_region()
        self._counter.counting = False
        try:
            result = spec.fn(*args, **kwargs)
        finally:
            self._counter.counting = True
        self.plan.append(BreakpointStep(spec=spec, args=(), kwargs={}, index=self._breakpoints))
        self._breakpoints += 1
        log.debug("breakpoint %r after segment %d (eager mode)", spec.name, self._segments - 1)
        return result

    def graph_break(self) -> None:
        self._close_region()


def copy_outputs_into(dst: Any, src: Any) -> None:
    """Copy a fresh eager result into the tensors of the first result (same structure)."""
    from torch.utils import _pytree as pytree

    dst_leaves, dst_spec = pytree.tree_flatten(dst)
    src_leaves, src_spec = pytree.tree_flatten(src)
    if dst_spec != src_spec:
        raise RuntimeError(f"eager replay returned {src_spec}, but the first run returned {dst_spec}")
    for d, s in zip(dst_leaves, src_leaves):
        if isinstance(d, torch.Tensor):
            d.copy_(s)
