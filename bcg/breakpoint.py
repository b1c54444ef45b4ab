"""``@bcg.breakpoint`` and ``bcg.graph_break()``: where a capture splits into segments."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar, overload

import torch

from bcg.breakpoint_spec import BreakpointSpec, normalize_mutates
from bcg.recorder import ACTIVE

try:  # one C call, ~50 ns: is a Dynamo frame callback installed right now?
    from torch._C._dynamo.eval_frame import get_eval_frame_callback as _eval_frame_callback

    def _dynamo_active() -> bool:
        return _eval_frame_callback() is not None
except ImportError:  # pragma: no cover - torch without Dynamo's C hooks: always play safe

    def _dynamo_active() -> bool:
        return True


def _dynamo_skip(fn: Callable[..., Any]) -> None:
    from torch._dynamo.decorators import skip

    skip(fn)

F = TypeVar("F", bound=Callable[..., Any])


@overload
def breakpoint(fn: F, /) -> F: ...
@overload
def breakpoint(
    *,
    enabled: bool | Callable[[], bool] = True,
    capture_stub: Callable[..., Any] | None = None,
    name: str | None = None,
    mutates: str | tuple[str, ...] | None = None,
) -> Callable[[F], F]: ...


def breakpoint(  # noqa: A001 - the public name is part of the contract
    fn: Callable[..., Any] | None = None,
    /,
    *,
    enabled: bool | Callable[[], bool] = True,
    capture_stub: Callable[..., Any] | None = None,
    name: str | None = None,
    mutates: str | tuple[str, ...] | None = None,
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
    * ``mutates`` names the parameters written in place (a name or a tuple of
      names, checked against the signature: ``TypeError`` otherwise; default:
      any tensor argument may be); padding sanitizers run on exactly those.
    * A result that is one of its tensor arguments exactly (same storage,
      offset, shape, strides, dtype) is taken as written in place and must be
      that same argument at every replay; any other result, views of arguments
      included, is copied into a bridge.
    * Inside ``torch.compile``d code a breakpoint is a Dynamo graph break: it is
      never traced and runs eagerly with Dynamo off.
    """

    def decorate(f: Callable[..., Any]) -> Callable[..., Any]:
        spec = BreakpointSpec(
            fn=f,
            name=name or getattr(f, "__qualname__", repr(f)),
            enabled=enabled,
            capture_stub=capture_stub,
            mutates=normalize_mutates(f, mutates),
        )
        active = ACTIVE.get

        def call(*args: Any, **kwargs: Any) -> Any:
            recorder = active()
            if recorder is None:
                return f(*args, **kwargs)
            return recorder.call_breakpoint(spec, args, kwargs)

        uncompiled = torch.compiler.disable(call)

        @functools.wraps(f)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if _dynamo_active():  # called from torch.compile'd code: run it all with Dynamo off
                return uncompiled(*args, **kwargs)
            return call(*args, **kwargs)

        # Dynamo sees a disabled function (a graph break, never traced into) and never
        # compiles the wrapper's own frame when compiled code calls it.
        _dynamo_skip(wrapper)
        wrapper._torchdynamo_orig_callable = f  # type: ignore[attr-defined]
        wrapper.__bcg_breakpoint__ = spec  # type: ignore[attr-defined]
        return wrapper

    return decorate(fn) if fn is not None else decorate


def graph_break() -> None:
    """End the current segment and begin a new one, with no eager work between."""
    recorder = ACTIVE.get()
    if recorder is not None:
        recorder.graph_break()
