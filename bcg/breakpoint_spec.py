"""What the library knows about one ``@bcg.breakpoint`` function."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
import inspect
from typing import Any

import torch
from torch.utils import _pytree as pytree


@dataclass(frozen=True, eq=False)
class BreakpointSpec:
    """A breakpoint: the eager function, its optional capture stub, and a name.

    ``enabled`` is a bool or a zero-argument callable asked at each capture-time
    call; a disabled breakpoint is captured into the segment like any code.
    ``mutates`` names the arguments it writes in place (``None``: any of them).
    """

    fn: Callable[..., Any]
    name: str
    enabled: bool | Callable[[], bool] = True
    capture_stub: Callable[..., Any] | None = None
    mutates: tuple[str, ...] | None = None

    def is_enabled(self) -> bool:
        return bool(self.enabled() if callable(self.enabled) else self.enabled)

    def mutated_tensors(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
        """The tensor arguments this breakpoint writes: those named in ``mutates``, else all."""
        if self.mutates is None:
            leaves = pytree.tree_leaves((args, kwargs))
        else:
            bound = inspect.signature(self.fn).bind(*args, **kwargs).arguments
            missing = [n for n in self.mutates if n not in bound]
            if missing:
                raise TypeError(f"breakpoint {self.name!r} declares mutates={self.mutates} but got no argument {missing}")
            leaves = pytree.tree_leaves([bound[n] for n in self.mutates])
        return [x for x in leaves if isinstance(x, torch.Tensor)]
