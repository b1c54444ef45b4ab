"""Adapters for other breakable-CUDA-graph libraries on PyPI, registered as modes.

Each adapter builds the same :class:`~bcg.bench.case.Case` with that library's
own breakpoint mechanism: the undecorated breakpoint (``case.bp_raw``) wrapped
in the peer's ``no_graph`` decorator, warmed up on a side stream, captured with
the peer's context manager, and replayed with the peer's ``replay()``. The
breakpoints read :func:`bcg.live`, so capture and every replay run inside
``bcg.live_scope(case.live)`` (the peers have no live-metadata channel of their
own; this is one ContextVar set/reset per replay, as bcg's own ``replay(live=)``).

A peer that is not importable is skipped with a message. Install them with
``pip install piecewise-cuda-graphs==0.1.0 breakable-cuda-graphs==0.1.0``.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

import bcg
from bcg.bench.case import Case
from bcg.bench.registry import BuildContext, Built, NotApplicable, capture_stream_warmup, register_mode


def _import(module: str) -> ModuleType | None:
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


def _reason(module: str, dist: str) -> Callable[[], str | None]:
    def reason() -> str | None:
        if _import(module) is None:
            return f"{dist} is not installed (pip install {dist}==0.1.0)"
        return None

    return reason


def _build_sequence(
    case: Case,
    ctx: BuildContext,
    *,
    no_graph: Callable[..., Any],
    new_sequence: Callable[[], Any],
    capture_ctx: Callable[[Any, torch.cuda.Stream], Any],
) -> Built:
    """Shared skeleton: warm up, capture with the peer's context manager, replay."""
    if case.loop is not None:
        raise NotApplicable(f"{case.label}: the peers' adapters time one forward, not a decode loop")
    fn = case.forward(no_graph(case.bp_raw))
    args, live = case.static_args, case.live
    stream = capture_stream_warmup(fn, args, ctx.capture_warmup, live)
    seq = new_sequence()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with bcg.live_scope(live), capture_ctx(seq, stream):
        out = fn(*args)
    torch.cuda.synchronize()
    capture_s = time.perf_counter() - t0
    from bcg.core.pool import pool_bytes

    held = {"seq": seq, "out": out}
    steps = list(getattr(seq, "_segments", ()))  # private, read only for the counts
    segments = sum(1 for s in steps if isinstance(s, torch.cuda.CUDAGraph))

    fresh_live = case.fresh_live

    def run() -> torch.Tensor:
        with bcg.live_scope(fresh_live()):
            held["seq"].replay()
        return held["out"]

    def close() -> None:
        torch.cuda.synchronize()
        held["seq"].reset()
        held.clear()

    return Built(
        run=run,
        capture_s=capture_s,
        pool_bytes=pool_bytes(seq.pool(), torch.cuda.current_device()),
        info={"segments": segments, "breakpoints": len(steps) - segments} if steps else {},
        close=close,
    )


@register_mode(
    "piecewise-cuda-graphs",
    help="PyPI piecewise-cuda-graphs 0.1.0: CUDAGraphSequence + piecewise_graph + @no_graph",
    available=_reason("piecewise_cuda_graphs", "piecewise-cuda-graphs"),
)
def build_piecewise(case: Case, ctx: BuildContext) -> Built:
    pcg = importlib.import_module("piecewise_cuda_graphs")
    return _build_sequence(
        case,
        ctx,
        no_graph=pcg.no_graph,
        new_sequence=pcg.CUDAGraphSequence,
        capture_ctx=lambda seq, stream: pcg.piecewise_graph(seq, stream=stream),
    )


@register_mode(
    "breakable-cuda-graphs",
    help="PyPI breakable-cuda-graphs 0.1.0: BreakableCUDAGraph + breakable_graph + @no_graph",
    available=_reason("breakable_cuda_graphs", "breakable-cuda-graphs"),
)
def build_breakable(case: Case, ctx: BuildContext) -> Built:
    bcgs = importlib.import_module("breakable_cuda_graphs")
    return _build_sequence(
        case,
        ctx,
        no_graph=bcgs.no_graph,
        new_sequence=bcgs.BreakableCUDAGraph,
        capture_ctx=lambda seq, stream: bcgs.breakable_graph(seq, stream=stream),
    )
