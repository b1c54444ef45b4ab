"""``torch.compile``'d code inside a bcg capture.

Inductor's kernels (Triton and library calls) are ordinary CUDA work on the
current stream, so a capture records them in the current segment like any other
kernel. A breakpoint called from code Dynamo traces is an opaque custom op
(:func:`opaque_op`) where its signature allows, so whole-model compiles with
``fullgraph=True`` keep their breakpoints; otherwise it is a graph break. Two
things need care, and this module handles them for the duration of one capture:

* Inductor's own CUDA graphs (``mode="reduce-overhead"`` / ``"max-autotune"``,
  i.e. cudagraph trees) are **switched off** while a bcg capture runs: compiled
  regions then launch their kernels directly and bcg records them (bcg makes the
  graphs). Outside the capture they behave as compiled. This uses Inductor's
  ``triton.cudagraph_capture_sizes`` setting (an empty tuple: no size is
  graphed), patched process-wide for the capture. With
  ``torch._inductor.config.triton.cudagraph_trees = False`` Inductor's older
  graph wrapper does not read that setting: compile without CUDA graphs then.
* Compiling (or autotuning) inside a capture is not supported: run the compiled
  code eagerly on every shape you capture first (``bcg.make_graph`` and
  ``bcg.GraphRunner`` do this). A capture during which Dynamo compiled says so:
  a warning when it succeeded, a note on the error when it failed.

Nothing here imports Inductor: when it is not loaded there is nothing to switch.
"""

from __future__ import annotations

import functools
import inspect
import logging
import re
import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch

from bcg.core.torch_internals import dynamo_graphs, inductor_config

log = logging.getLogger("bcg")

CAPTURE_SIZES = "triton.cudagraph_capture_sizes"


class _InductorGraphsOff:
    """Inductor's ``triton.cudagraph_capture_sizes`` set to ``()``, process-wide, reference counted.

    The setting is process-wide, so overlapping captures (on several threads)
    share one patch: the first turns it on, the last restores the user's value.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._depth = 0
        self._patch: Any = None

    def enter(self) -> None:
        with self._lock:
            self._depth += 1
            if self._depth > 1:
                return
            config = inductor_config()
            if config is not None and getattr(config.triton, "cudagraph_capture_sizes", ()) != ():
                self._patch = config.patch({CAPTURE_SIZES: ()})
                self._patch.__enter__()
                log.debug("bcg: Inductor's own CUDA graphs are off while bcg captures")

    def exit(self) -> None:
        with self._lock:
            self._depth -= 1
            if self._depth == 0 and self._patch is not None:
                self._patch.__exit__(None, None, None)
                self._patch = None


_GRAPHS_OFF = _InductorGraphsOff()


class CompileWatch:
    """One capture's view of torch.compile: Inductor's CUDA graphs off, compiles counted.

    Use as a context manager around the capture. ``compiled`` is how many
    Dynamo graphs were compiled since it was entered.
    """

    def __init__(self) -> None:
        self._start = 0
        self._entered = False

    def __enter__(self) -> CompileWatch:
        self._start = dynamo_graphs()
        _GRAPHS_OFF.enter()
        self._entered = True
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._entered:
            self._entered = False
            _GRAPHS_OFF.exit()

    @property
    def compiled(self) -> int:
        return dynamo_graphs() - self._start

    def message(self) -> str | None:
        """What to tell the user when Dynamo compiled during the capture (None: it did not)."""
        n = self.compiled
        if n <= 0:
            return None
        return (
            f"bcg: torch.compile compiled {n} graph(s) during this capture. Compiling and autotuning "
            "may synchronize the device, which a capture forbids, and cost seconds inside it: run the "
            "compiled code eagerly once on every shape you capture before capturing (bcg.make_graph "
            "and bcg.GraphRunner warm up for you)"
        )


# -- breakpoints in traced code ------------------------------------------------------------------

_OP_NAMESPACE = "bcg"
_op_names: set[str] = set()  # names taken in the namespace (torch cannot unregister a custom op)
_op_names_lock = threading.Lock()
# Inductor keeps ops with this tag out of the CUDA graphs it records (torch >= 2.9)
_UNSAFE_TAGS = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()


def _op_name(name: str) -> str:
    base = re.sub(r"\W+", "_", name).strip("_") or "breakpoint"
    with _op_names_lock:
        candidate, k = base, 1
        while candidate in _op_names:
            k += 1
            candidate = f"{base}_{k}"
        _op_names.add(candidate)
    return candidate


def opaque_op(fn: Callable[..., Any], name: str, mutates: tuple[str, ...] | None, call: Callable[..., Any],
              fake: Callable[..., Any] | None) -> tuple[Any, str | None]:
    """A ``torch.library`` custom op that Dynamo records, opaque, where traced code calls the
    breakpoint ``fn``; running it calls ``call`` (the breakpoint's own dispatch: eager, or the
    active capture's). Returns ``(op, None)``, or ``(None, why)`` when ``fn`` cannot be one.

    The op's schema comes from ``fn``'s annotations (``torch.library.custom_op``);
    ``mutates`` become its mutated arguments (``None``: ``"unknown"``, any of them).
    Its fake (meta) implementation is ``fake``, else, for a function annotated to
    return ``None``, one that returns nothing. It is tagged ``cudagraph_unsafe``: a
    breakpoint never runs inside a CUDA graph that Inductor records
    (``mode="reduce-overhead"``), which partitions its graphs around the op instead
    (graph partition), or runs that graph without CUDA graphs.
    """
    try:
        returns = inspect.signature(fn).return_annotation
    except (TypeError, ValueError) as exc:
        return None, f"no signature ({exc})"
    if fake is None and returns not in (None, "None"):
        return None, "it returns values and has no fake=: give @bcg.breakpoint(fake=...) a function of the " \
                     "same arguments that returns empty tensors of the result's shapes and dtypes"

    @functools.wraps(fn)  # (the op's schema is read from fn's signature through __wrapped__)
    def run(*args: Any, **kwargs: Any) -> Any:
        return call(*args, **kwargs)

    try:
        op = torch.library.custom_op(f"{_OP_NAMESPACE}::{_op_name(name)}",
                                     mutates_args=mutates if mutates is not None else "unknown",
                                     tags=_UNSAFE_TAGS)(run)
        op.register_fake(fake if fake is not None else _returns_nothing)
    except Exception as exc:  # no schema for its annotations (untyped, *args, a non-tensor container ...)
        return None, f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    return op, None


def _returns_nothing(*args: Any, **kwargs: Any) -> None:
    return None
