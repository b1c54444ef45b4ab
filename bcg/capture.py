"""``bcg.capture``: record a ``with`` block into a :class:`bcg.BreakableGraph`, as
``torch.cuda.graph`` records one into a ``torch.cuda.CUDAGraph``; and :func:`capture_into`,
which make_graph and the runner use to capture a graph's forms.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch

from bcg.core.args import check_choice, check_pool, check_stream, check_type
from bcg.core.breakpoint import UNSET
from bcg.core.debug import Debug
from bcg.core.plan import Recording
from bcg.core.pool import PoolHandle
from bcg.core.session import CAPTURE_ERROR_MODES, Capture, CaptureOptions
from bcg.errors import CaptureError
from bcg.graph import BreakableGraph
from bcg.keyed.variants import VariantPolicy
from bcg.staged.staging import StagedBreakpoints


class capture:  # noqa: N801 - lower-case like torch.cuda.graph; the name is the public contract
    """Capture the CUDA work of a ``with`` block into a :class:`bcg.BreakableGraph`.

    Each ``@bcg.breakpoint`` call inside ends the current graph segment, runs
    eagerly, and begins the next one; ``graph.replay()`` then runs segment,
    breakpoint, segment, ... in stream order.

    Arguments:
        graph: the :class:`bcg.BreakableGraph` to fill (empty, or reset).
        pool: a private memory pool to share with other graphs (``graph.pool()``
            or :func:`bcg.graph_pool_handle`); default: a new one.
        stream: the capture stream, a ``torch.cuda.Stream``; default: bcg's
            capture stream of the device.
        capture_error_mode: ``"global"``, ``"thread_local"`` or ``"relaxed"``, as in ``torch.cuda.graph``.
        live: what :func:`bcg.live` returns inside breakpoints during capture.
        variants: a :class:`bcg.VariantPolicy`, the bounds of keyed breakpoints'
            variants and stitched executables (default: its defaults).
        debug: a :class:`bcg.Debug`, aids checked before every replay (default:
            ``BCG_GUARDS`` and ``BCG_POISON`` from the environment).

    Arguments are checked at construction: a wrong type raises ``TypeError``,
    a value not offered ``ValueError``, naming the argument, what it got and
    what it expects.

    Constraints:
        * Warm the code up eagerly first: lazy initialization and torch.compile's
          compiling must not happen inside a segment.
        * Code between breakpoints must be capturable: no ``.item()``, no
          pageable host copies, no data-dependent host control flow, no
          ``bcg.live()`` (it raises; see :func:`bcg.live`).
        * Work forked to a side stream must be joined back before the next
          breakpoint; a fork that crosses a breakpoint is joined there by bcg,
          and a later join raises :class:`bcg.errors.StreamForkError`.
        * Graphs sharing a pool must not replay concurrently; a graph's outputs are
          valid until another graph in the same pool replays.

    .. warning::
        Process-wide for the capture's duration: captures are serialized (a
        second thread's capture waits), Python's cycle collector is paused,
        Inductor's own CUDA graphs are off, and bcg's frees of CUDA graph
        resources wait until the capture ends.

    .. warning::
        A staged breakpoint whose live metadata does not fit at replay needs the
        graph's breakable form, which ``bcg.make_graph`` and ``bcg.GraphRunner``
        capture; a graph of this context manager then raises :class:`bcg.ReplayError`.
    """

    def __init__(
        self,
        graph: BreakableGraph,
        pool: PoolHandle | None = None,
        stream: torch.cuda.Stream | None = None,
        capture_error_mode: str = "global",
        *,
        live: Any = UNSET,
        variants: VariantPolicy | None = None,
        debug: Debug | None = None,
    ) -> None:
        if not isinstance(graph, BreakableGraph):
            hint = "pass the graph to fill: bcg.BreakableGraph()"
            if callable(graph):
                hint += "; to capture a function, use bcg.make_graph(fn, *args)"
            check_type("bcg.capture", "graph", graph, BreakableGraph, "a bcg.BreakableGraph", hint=hint)
        check_capture_options("bcg.capture", pool, stream, capture_error_mode, variants, debug)
        self.graph = graph
        self._options = CaptureOptions(pool=pool, stream=stream, capture_error_mode=capture_error_mode, live=live,
                                       debug=debug if debug is not None else Debug.from_env())
        self._variants = variants
        self._capture: Capture | None = None

    def __enter__(self) -> BreakableGraph:
        if self.graph.is_captured:
            raise CaptureError("this BreakableGraph already holds a capture: call graph.reset() first")
        options = dataclasses.replace(self._options, generators=self.graph.generator_states)
        self._capture = Capture(options, StagedBreakpoints())
        self._capture.__enter__()
        return self.graph

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        cap = self._capture
        assert cap is not None
        self._capture = None
        try:
            suppress = cap.__exit__(exc_type, exc, tb)
        finally:
            if cap.failed_lease is not None:
                self.graph.hold(cap.failed_lease)
        if exc is None and cap.recording is not None:
            _install(self.graph, cap.recording, None, self._variants)
        return suppress


def check_capture_options(where: str, pool: Any, stream: Any, capture_error_mode: Any, variants: Any,
                          debug: Any) -> None:
    """The capture options ``bcg.capture``, ``bcg.make_graph`` and ``bcg.GraphRunner`` share, checked
    (``TypeError`` or ``ValueError`` naming the first that is wrong; ``where`` names the entry point)."""
    check_pool(where, pool)
    check_stream(where, stream)
    check_choice(where, "capture_error_mode", capture_error_mode, CAPTURE_ERROR_MODES,
                 hint="as in torch.cuda.graph")
    check_type(where, "variants", variants, VariantPolicy, "a bcg.VariantPolicy", optional=True)
    check_type(where, "debug", debug, Debug, "a bcg.Debug", optional=True,
               hint="e.g. debug=bcg.Debug(guards=True)")


def capture_into(
    graph: BreakableGraph,
    fn: Callable[[], Any],
    options: CaptureOptions,
    *,
    variants: VariantPolicy | None = None,
    form: str = "first",
    agree: Callable[[], bool] | None = None,
    release: Callable[[Any], Any] | None = None,
) -> Any:
    """Capture ``fn()`` into ``graph``; return what it returned.

    Arguments:
        form: ``"first"``: the graph's first form (the graph must be empty);
            ``"breakable"``: its breakable form (staged breakpoints recorded as
            breakpoints), captured into its pool; ``"tier"``: a staged form with
            smaller bounds (its ``fn`` ends by copying its outputs into the
            graph's). A failed ``"breakable"`` capture resets the graph (a staged
            graph without it would refuse metadata that does not fit).
        agree: asked once the capture succeeded (ranks' vote): False frees it and
            raises :class:`bcg.CaptureError`.
        release: maps a form's outputs before the graph keeps them (the runner's
            non-owning aliases, so later captures into the pool reuse that memory).

    The inline forms end a segment before the first staged copy
    (``CaptureOptions.split_staged``): the caller captures a staged graph's
    breakable form too (make_graph and the runner do, unless
    ``StagedTiers(breakable=False)``), whose segments end at every staged
    breakpoint anyway; the split asks no more of the code than that would.
    """
    options = dataclasses.replace(options, split_staged=True)
    if form != "first":
        options = dataclasses.replace(options, pool=graph.pool(), inline=form == "tier", watch=False)
    cap = Capture(options, StagedBreakpoints())
    try:
        with cap:
            out = fn()
    except BaseException:
        if cap.failed_lease is not None:
            graph.hold(cap.failed_lease)
        if form == "breakable":
            graph.reset()
        raise
    assert cap.recording is not None
    kept = None if form == "first" else (release(out) if release is not None else out)
    _install(graph, cap.recording, kept, variants, form, agree)
    return out


def _install(graph: BreakableGraph, recording: Recording, outputs: Any, variants: VariantPolicy | None,
             form: str = "first", agree: Callable[[], bool] | None = None) -> None:
    """Give ``recording`` to ``graph`` (its first form, or another one); freed if the graph (or
    another rank) refuses it."""
    try:
        if agree is not None and not agree():
            raise CaptureError("another rank failed to capture it")
        if form == "first":
            graph.install(recording, variants)
        else:
            graph.add_form(recording, outputs, tier=form == "tier")
    except BaseException:
        recording.release()
        if form == "breakable":
            graph.reset()
        raise
