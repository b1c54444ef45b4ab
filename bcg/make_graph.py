"""``bcg.make_graph``: the callable form, which knows how to re-run what it captured."""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

from bcg.capture import capture, capture_lock, capture_stream
from bcg.eager import EagerRecorder, EagerReplay, copy_outputs_into
from bcg.graph import BreakableGraph
from bcg.live import _UNSET, live_scope
from bcg.memory import PoolHandle
from bcg.recorder import ACTIVE

log = logging.getLogger("bcg")

_MODES = ("graph", "eager")


def make_graph(
    fn: Callable[..., Any],
    *static_args: Any,
    mode: str = "graph",
    live: Any = _UNSET,
    pool: PoolHandle | None = None,
    stream: torch.cuda.Stream | None = None,
    capture_error_mode: str = "global",
    warmup: int = 1,
    ownership: str = "pool",
    guards: bool | None = None,
    poison: bool | None = None,
) -> BreakableGraph:
    """Capture ``fn(*static_args)`` and return the graph; its result is ``graph.outputs``.

    ``mode="graph"`` warms ``fn`` up ``warmup`` times eagerly on the capture
    stream, then captures it. ``mode="eager"`` runs ``fn`` eagerly, records the
    same segment/breakpoint structure, and makes ``replay()`` re-run ``fn`` on
    the static arguments and copy the result into ``graph.outputs`` (for
    debugging and machines with no CUDA). Without CUDA, ``mode="graph"`` falls
    back to eager mode with a warning. Constraints: feed new inputs by writing
    into ``static_args`` in place; ``fn`` must return the same structure every run.
    ``ownership``, ``guards`` and ``poison`` are passed to :class:`bcg.capture`
    (``static_args`` are the guarded inputs).
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
    live_ctx = live_scope(live) if live is not _UNSET else contextlib.nullcontext()
    if mode == "eager":
        t0 = time.perf_counter()
        recorder = EagerRecorder()
        token = ACTIVE.set(recorder)
        try:
            with live_ctx, recorder:
                outputs = fn(*static_args)
        finally:
            ACTIVE.reset(token)

        def rerun() -> None:
            checker = EagerReplay(graph.plan)
            token = ACTIVE.set(checker)
            try:
                result = fn(*static_args)
            finally:
                ACTIVE.reset(token)
            checker.finish()
            copy_outputs_into(graph.outputs, result)

        graph._install(recorder.plan, pool=None, device=None, capture_s=time.perf_counter() - t0, mode="eager", rerun=rerun)
        graph.outputs = outputs
        graph._fn, graph._static_args = fn, static_args
        log.info(
            "bcg: recorded %d segment(s) and %d breakpoint(s) in eager mode in %.3f s",
            graph.num_segments, graph.num_breakpoints, graph.stats().capture_s,
        )
        return graph

    with capture_lock():  # the warm-up runs on the shared capture stream: no other capture meanwhile
        stream = stream if stream is not None else capture_stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), live_ctx:
            for _ in range(warmup):
                fn(*static_args)
        with capture(
            graph,
            pool=pool,
            stream=stream,
            capture_error_mode=capture_error_mode,
            live=live,
            ownership=ownership,  # type: ignore[arg-type]
            inputs=static_args,
            guards=guards,
            poison=poison,
        ):
            outputs = fn(*static_args)
    graph.outputs = outputs
    graph._fn, graph._static_args = fn, static_args
    return graph

