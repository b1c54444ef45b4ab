"""What the library knows about one ``@bcg.breakpoint`` function."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree


def normalize_mutates(fn: Callable[..., Any], mutates: Any) -> tuple[str, ...] | None:
    """``mutates`` as a tuple of parameter names of ``fn``, checked against its signature.

    A single string is one name. Raises ``TypeError`` naming what is wrong: an
    entry that is not a string, or a name ``fn`` has no parameter for (allowed
    only when ``fn`` takes ``**kwargs``).
    """
    if mutates is None:
        return None
    names = (mutates,) if isinstance(mutates, str) else tuple(mutates)
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"mutates must name parameters (strings), got {name!r}")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins and C functions: nothing to check against
        return names
    params = signature.parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return names
    unknown = [n for n in names if n not in params]
    if unknown:
        qualname = getattr(fn, "__qualname__", repr(fn))
        raise TypeError(
            f"@bcg.breakpoint(mutates=...) names {', '.join(map(repr, unknown))}, which "
            f"{'is not a parameter' if len(unknown) == 1 else 'are not parameters'} of "
            f"{qualname}({', '.join(params)}); name the arguments the function writes in place"
        )
    return names


@dataclass(frozen=True, eq=False)
class BreakpointSpec:
    """A breakpoint: the eager function, its optional capture stub, and a name.

    ``enabled`` is a bool or a zero-argument callable asked at each capture-time
    call; a disabled breakpoint is captured into the segment like any code.
    ``mutates`` names the arguments it writes in place (``None``: any of them);
    build specs through :func:`bcg.breakpoint`, which checks the names.
    """

    fn: Callable[..., Any]
    name: str
    enabled: bool | Callable[[], bool] = True
    capture_stub: Callable[..., Any] | None = None
    mutates: tuple[str, ...] | None = None

    def is_enabled(self) -> bool:
        return bool(self.enabled() if callable(self.enabled) else self.enabled)

    @functools.cached_property
    def _signature(self) -> inspect.Signature:
        return inspect.signature(self.fn)

    def mutated_tensors(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
        """The tensor arguments this breakpoint writes: those named in ``mutates``, else all."""
        if self.mutates is None:
            leaves = pytree.tree_leaves((args, kwargs))
        else:
            params = self._signature.parameters
            bound = self._signature.bind(*args, **kwargs).arguments
            extra: dict[str, Any] = next(
                (v for k, v in bound.items() if params[k].kind is inspect.Parameter.VAR_KEYWORD), {}
            )
            leaves = pytree.tree_leaves([bound[n] if n in bound else extra.get(n) for n in self.mutates])
        return [x for x in leaves if isinstance(x, torch.Tensor)]
