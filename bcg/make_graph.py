"""``bcg.make_graph``: the callable form, which knows how to re-run what it captured."""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from bcg.core.breakpoint import UNSET, recording
from bcg.capture import capture, capture_fallback
from bcg.eager import EagerRecorder, EagerReplay
from bcg.graph import BreakableGraph, copy_outputs_into
from bcg.core.plan import GraphParts, GraphSource
from bcg.core.pool import PoolHandle
from bcg.core.process import capture_lock, capture_stream
from bcg.staged.staging import StagedWarmup
from bcg.keyed.variants import VariantPolicy

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
    ownership: str = "pool",
    guards: bool | None = None,
    poison: bool | None = None,
    variants: VariantPolicy | None = None,
) -> BreakableGraph:
    """Capture ``fn(*static_args)`` and return the graph; its result is ``graph.outputs``.

    ``mode="graph"`` warms ``fn`` up ``warmup`` times eagerly on the capture
    stream, then captures it. ``mode="eager"`` runs ``fn`` eagerly, records the
    same segment/breakpoint structure, and makes ``replay()`` re-run ``fn`` on
    the static arguments and copy the result into ``graph.outputs`` (for
    debugging and machines with no CUDA). Without CUDA, ``mode="graph"`` falls
    back to eager mode with a warning. Constraints: feed new inputs by writing
    into ``static_args`` in place; ``fn`` must return the same structure every run.
    ``ownership``, ``guards``, ``poison`` and ``variants`` are passed to :class:`bcg.capture`
    (``static_args`` are the guarded inputs). When ``fn`` calls staged
    breakpoints (see :mod:`bcg.staged.staging`), the graph captures them inline and
    also holds its breakable form, in the same pool, which replays whenever
    the live metadata does not fit; ``outputs`` are the same tensors either way.
    """
    if mode not in _MODES:
        raise ValueError(f"mode must be one of {_MODES}, not {mode!r}")
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
            checker = EagerReplay(graph.plan, recorder.stager, graph.variants)
            with recording(checker):
                result = source()
            checker.finish()
            copy_outputs_into(graph.outputs, result, "an eager replay")

        graph.install(
            GraphParts(
                recorder.plan, capture_s=time.perf_counter() - t0, mode="eager", rerun=rerun,
                stager=recorder.stager or None, variant_policy=variants,
            )
        )
        log.info(
            "bcg: recorded %d segment(s) and %d breakpoint(s) in eager mode in %.3f s",
            graph.num_segments, graph.num_breakpoints, graph.stats().capture_s,
        )
    else:
        with capture_lock():  # the warm-up runs on the shared capture stream: no other capture meanwhile
            stream = stream if stream is not None else capture_stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(warmup):  # staged breakpoints run inline, as they will be captured
                    with recording(StagedWarmup(), live):
                        source()
            options: dict[str, Any] = dict(
                stream=stream,
                capture_error_mode=capture_error_mode,
                live=live,
                ownership=ownership,
                inputs=static_args,
                guards=guards,
                poison=poison,
                variants=variants,
            )
            with capture(graph, pool=pool, **options):
                outputs = source()
            graph.outputs = outputs
            if graph.staged:  # the breakable form, for metadata outside the staged bounds
                capture_fallback(graph, source, **options)
    graph.outputs = outputs
    graph.source = source
    return graph
