"""``bcg.make_graph``: the callable form, which knows how to re-run what it captured."""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from bcg.capture import capture_into, check_capture_options
from bcg.core.args import check_callable, check_choice, check_int
from bcg.core.breakpoint import UNSET, recording
from bcg.core.debug import Debug
from bcg.core.plan import GraphSource, Recording
from bcg.core.pool import PoolHandle
from bcg.core.process import capture_lock, capture_stream
from bcg.core.session import CaptureOptions
from bcg.eager import EagerRecorder, EagerReplay
from bcg.form import copy_outputs_into
from bcg.graph import BreakableGraph
from bcg.keyed.variants import VariantPolicy
from bcg.staged.staging import StagedWarmup

log = logging.getLogger("bcg")

_MODES = ("graph", "eager")


def make_graph(
    fn: Callable[..., Any],
    *static_args: Any,
    mode: str = "graph",
    live: Any = UNSET,
    pool: PoolHandle | None = None,
    stream: torch.cuda.Stream | None = None,
    capture_error_mode: str = "global",
    warmup: int = 1,
    variants: VariantPolicy | None = None,
    debug: Debug | None = None,
) -> BreakableGraph:
    """Capture ``fn(*static_args)`` and return the graph; its result is ``graph.outputs``.

    ``mode="graph"`` warms ``fn`` up ``warmup`` times eagerly on the capture
    stream, then captures it; when ``fn`` calls staged breakpoints it also
    captures the graph's breakable form, in the same pool, which replays
    whenever the live metadata does not fit (``outputs`` are the same tensors
    either way). ``mode="eager"`` runs ``fn`` eagerly, records the same
    segment/breakpoint structure, and makes ``replay()`` re-run ``fn`` on the
    static arguments and copy the result into ``graph.outputs`` (for debugging
    and machines with no CUDA). Without CUDA, ``mode="graph"`` falls back to
    eager mode with a warning.

    Arguments:
        fn, static_args: the function (callable) and its inputs (feed new inputs by
            writing into ``static_args`` in place; ``Debug(guards=True)`` checks it).
        mode: ``"graph"`` or ``"eager"``.
        live, pool, stream, capture_error_mode, variants, debug: as in :class:`bcg.capture`.
        warmup: eager runs before the capture (an int >= 0).

    ``fn`` must return the same structure every run. Arguments are checked
    before anything runs: a wrong type raises ``TypeError``, a value out of range
    ``ValueError``, naming the argument, what it got and what it expects.
    """
    _check_arguments(fn, static_args, mode, pool, stream, capture_error_mode, warmup, variants, debug)
    if mode == "graph" and not torch.cuda.is_available():
        warnings.warn(
            "bcg.make_graph: CUDA is not available, falling back to mode='eager' "
            "(same code and breakpoint structure, no CUDA graphs)",
            RuntimeWarning,
            stacklevel=2,
        )
        mode = "eager"
    graph = BreakableGraph()
    source = GraphSource(fn, static_args)
    if mode == "eager":
        t0 = time.perf_counter()
        recorder = EagerRecorder()
        with recording(recorder, live), recorder:
            outputs = source()

        def rerun() -> None:
            checker = EagerReplay(graph.plan, recorder.staged_breakpoints, graph.forms[0].variants)
            with recording(checker):
                result = source()
            checker.finish()
            copy_outputs_into(graph.outputs, result, "an eager replay")

        graph.install(
            Recording(recorder.plan, capture_s=time.perf_counter() - t0, mode="eager", rerun=rerun,
                      staged_breakpoints=recorder.staged_breakpoints or None),
            variants,
        )
        log.info(
            "bcg: recorded %d segment(s) and %d breakpoint(s) in eager mode in %.3f s",
            graph.stats().segments, graph.stats().breakpoints, graph.stats().capture_s,
        )
    else:
        with capture_lock():  # the warm-up runs on the shared capture stream: no other capture meanwhile
            stream = stream if stream is not None else capture_stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(warmup):  # staged breakpoints run inline, as they will be captured
                    with recording(StagedWarmup(), live):
                        source()
            options = CaptureOptions(pool=pool, stream=stream, capture_error_mode=capture_error_mode, live=live,
                                     debug=debug, inputs=static_args)
            outputs = capture_into(graph, source, options, variants=variants)
            graph.outputs = outputs
            if graph.staged:  # the breakable form, for metadata outside the staged bounds
                capture_into(graph, source, options, form="breakable")
    graph.outputs = outputs
    graph.source = source
    return graph


def _check_arguments(fn: Any, static_args: tuple[Any, ...], mode: Any, pool: Any, stream: Any,
                     capture_error_mode: Any, warmup: Any, variants: Any, debug: Any) -> None:
    where = "bcg.make_graph"
    if not callable(fn):
        hint = "the signature is make_graph(fn, *static_args)"
        if any(callable(a) for a in static_args):
            hint = "did you swap fn and the static arguments? " + hint
        check_callable(where, "fn", fn, hint=hint)
    check_choice(where, "mode", mode, _MODES)
    check_int(where, "warmup", warmup, minimum=0, hint="it counts the eager runs before the capture (0: none)")
    check_capture_options(where, pool, stream, capture_error_mode, variants, debug)
