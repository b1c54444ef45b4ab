"""The active recorder: whoever is capturing (or eagerly recording) on this context.

Breakpoints look it up on every call; ``None`` means "plain call". It lives in a
:class:`contextvars.ContextVar`, so captures on different threads never see
each other. Every recorder (the capture, eager-mode recording and replay, the
runner's warm-ups, verify's reference run) derives from :class:`Recorder`, which
owns the rules they share: a disabled breakpoint, or one called from inside
another breakpoint, is plain code; ``in_segment`` is false exactly while a
breakpoint's own function runs (:func:`bcg.live` refuses reads otherwise); and
which tensors cross a breakpoint.
"""

from __future__ import annotations

import contextvars
from typing import Any

import torch
from torch.utils import _pytree as pytree

from bcg.breakpoint_spec import BreakpointSpec


class Recorder:
    """Base of the active recorders.

    Subclasses implement :meth:`on_breakpoint` (an enabled breakpoint called
    from segment code) and may override :meth:`on_graph_break`; both run the
    breakpoint's function through :meth:`run_breakpoint`.
    """

    #: What ``bcg.live()`` errors call the code being recorded ("graph segment 3", ...).
    segment_label = "a graph segment"

    def __init__(self) -> None:
        self.in_segment = True

    def call_breakpoint(self, spec: BreakpointSpec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not self.in_segment or not spec.is_enabled():
            return spec.fn(*args, **kwargs)  # nested in a breakpoint, or disabled: plain code
        return self.on_breakpoint(spec, args, kwargs)

    def graph_break(self) -> None:
        if self.in_segment:
            self.on_graph_break()

    def on_breakpoint(self, spec: BreakpointSpec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        raise NotImplementedError

    def on_graph_break(self) -> None:
        pass

    def run_breakpoint(self, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``fn(*args, **kwargs)`` as breakpoint code: ``bcg.live()`` may be read inside."""
        self.in_segment = False
        try:
            return fn(*args, **kwargs)
        finally:
            self.in_segment = True


def crossing_tensors(
    results: list[torch.Tensor], spec: BreakpointSpec, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> list[torch.Tensor]:
    """The tensors crossing a breakpoint: its results, then its mutated arguments, each object once.

    This order is the contract of ``bcg.capture(after_breakpoint=...)``; the
    runner's eager warm-ups compute the same list so that the ``k``-th list of
    an eager run lines up with the ``k``-th of a capture.
    """
    seen: set[int] = set()
    out = []
    for t in results + spec.mutated_tensors(args, kwargs):
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def tensor_leaves(tree: Any) -> list[torch.Tensor]:
    return [x for x in pytree.tree_leaves(tree) if isinstance(x, torch.Tensor)]


ACTIVE: contextvars.ContextVar[Recorder | None] = contextvars.ContextVar(
    "bcg_active_recorder", default=None
)
