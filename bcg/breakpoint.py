"""``@bcg.breakpoint`` and ``bcg.graph_break()``: where a capture splits into segments."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar, overload

from bcg.breakpoint_spec import BreakpointSpec
from bcg.recorder import ACTIVE

F = TypeVar("F", bound=Callable[..., Any])


@overload
def breakpoint(fn: F, /) -> F: ...
@overload
def breakpoint(
    *,
    enabled: bool | Callable[[], bool] = True,
    capture_stub: Callable[..., Any] | None = None,
    name: str | None = None,
    mutates: tuple[str, ...] | None = None,
) -> Callable[[F], F]: ...


def breakpoint(  # noqa: A001 - the public name is part of the contract
    fn: Callable[..., Any] | None = None,
    /,
    *,
    enabled: bool | Callable[[], bool] = True,
    capture_stub: Callable[..., Any] | None = None,
    name: str | None = None,
    mutates: tuple[str, ...] | None = None,
) -> Any:
    """Mark ``fn`` as work that must run eagerly at every replay.

    Outside a capture the decorated function is a plain call. Inside
    ``bcg.capture`` it ends the current segment, runs eagerly (``capture_stub``
    instead, if given: it must return the same structure, shapes and dtypes),
    and a new segment begins. Constraints:

    * Tensor arguments are held by the graph and passed again, at the same
      addresses, at every replay: write results into them in place, or return
      tensors (each is copied into a graph-owned *bridge* buffer at replay).
    * Non-tensor return values are frozen at capture; a replay returning a
      different value, structure, shape or dtype raises ``BreakpointOutputMismatch``.
    * Read per-replay host data with :func:`bcg.live`, never from closures.
    * ``mutates`` names the arguments written in place (default: any tensor
      argument may be); padding sanitizers run on exactly those.
    """

    def decorate(f: Callable[..., Any]) -> Callable[..., Any]:
        spec = BreakpointSpec(
            fn=f,
            name=name or getattr(f, "__qualname__", repr(f)),
            enabled=enabled,
            capture_stub=capture_stub,
            mutates=tuple(mutates) if mutates is not None else None,
        )
        active = ACTIVE.get

        @functools.wraps(f)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            recorder = active()
            if recorder is None:
                return f(*args, **kwargs)
            return recorder.call_breakpoint(spec, args, kwargs)

        wrapper.__bcg_breakpoint__ = spec  # type: ignore[attr-defined]
        return wrapper

    return decorate(fn) if fn is not None else decorate


def graph_break() -> None:
    """End the current segment and begin a new one, with no eager work between."""
    recorder = ACTIVE.get()
    if recorder is not None:
        recorder.graph_break()
