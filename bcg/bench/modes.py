"""Modes: the ways of running a :class:`~bcg.bench.case.Case`, in a registry.

To add a mode, write one function ``build(case, ctx) -> Built`` and decorate it
with :func:`register_mode`; ``--modes`` and the report pick it up. ``Built.run``
performs one forward (a replay) on the current stream and returns the output
tensor; ``Built.close`` frees what the mode holds (graphs, pools).

All modes of one benchmark point are built, then timed in rounds, then closed:
their graphs hold memory together, so a mode must not depend on another's
being closed, and must replay correctly after any other mode's replay.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

import bcg
from bcg.bench.case import Case
from bcg.bench.timing import compiling_call


@dataclass(eq=False)
class BuildContext:
    """Settings every mode may need."""

    capture_warmup: int = 1  # eager runs on the capture stream before a capture


@dataclass(eq=False)
class Built:
    run: Callable[[], torch.Tensor]
    capture_s: float | None = None
    pool_bytes: int | None = None
    info: dict[str, Any] = field(default_factory=dict)  # extra row fields (executor, segments, ...)
    close: Callable[[], None] = lambda: None


@dataclass(frozen=True)
class ModeSpec:
    name: str
    build: Callable[[Case, BuildContext], Built]
    needs_cuda: bool
    help: str
    # returns None when the mode can run here, else why it is skipped
    available: Callable[[], str | None]
    # runs the torch.compile'd forward: rel_err is measured against it run eagerly
    compiled: bool = False


MODES: dict[str, ModeSpec] = {}


def register_mode(
    name: str,
    *,
    needs_cuda: bool = True,
    help: str = "",  # noqa: A002
    available: Callable[[], str | None] | None = None,
    compiled: bool = False,
) -> Callable[[Callable[[Case, BuildContext], Built]], Callable[[Case, BuildContext], Built]]:
    """Register ``build`` as mode ``name`` (order of registration = order of runs)."""

    def deco(build: Callable[[Case, BuildContext], Built]) -> Callable[[Case, BuildContext], Built]:
        if name in MODES:
            raise ValueError(f"bench mode {name!r} is registered twice")
        MODES[name] = ModeSpec(name, build, needs_cuda, help, available or (lambda: None), compiled)
        return build

    return deco


def skip_reason(name: str, cuda: bool) -> str | None:
    """Why mode ``name`` cannot run on this machine, or None."""
    spec = MODES[name]
    if spec.needs_cuda and not cuda:
        return "needs an NVIDIA GPU"
    return spec.available()


# -- helpers -----------------------------------------------------------------------------------


def capture_stream_warmup(fn: Callable[..., Any], args: tuple[Any, ...], n: int, live: Any) -> torch.cuda.Stream:
    """Run ``fn`` ``n`` times on a fresh side stream (as before any CUDA graph capture)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), bcg.live_scope(live):
        for _ in range(n):
            fn(*args)
    torch.cuda.current_stream().wait_stream(stream)
    return stream


def has_native_executor() -> bool:
    """Whether this install can build the ``"native"`` replay executor."""
    from bcg.replay import make_executor

    try:
        make_executor((), "native")
    except Exception:
        return False
    return True


def _native_reason() -> str | None:
    return None if has_native_executor() else "no native executor in this install: the 'bcg' row is the python executor"


class NotApplicable(Exception):
    """A mode that does not apply to this case (e.g. no compiled variant): the row is skipped."""


def forward_of(case: Case, bp: Callable[..., Any], compiled: bool) -> Callable[..., torch.Tensor]:
    """The case's forward around ``bp``: eager regions, or the torch.compile'd ones."""
    if not compiled:
        return case.forward(bp)
    if case.make_compiled_forward is None:
        raise NotApplicable(f"{case.workload} has no torch.compile'd variant here")
    return case.make_compiled_forward(bp)


def _bcg_graph(case: Case, ctx: BuildContext, executor: str | None, compiled: bool = False) -> Built:
    """A bare ``bcg.make_graph``: replays on the static inputs, nothing around them."""
    fn = forward_of(case, case.bp, compiled)
    if compiled:
        compiling_call(fn, case.static_args, case.live, torch.cuda.synchronize)
    graph = bcg.make_graph(fn, *case.static_args, live=case.live, warmup=ctx.capture_warmup)
    if executor is not None:
        graph.use_executor(executor)
    torch.cuda.synchronize()
    stats = graph.stats()
    fresh_live, replay = case.fresh_live, graph.replay
    return Built(
        run=lambda: replay(live=fresh_live()),
        capture_s=stats.capture_s,
        pool_bytes=stats.pool_bytes,
        info={"executor": graph.executor, "segments": stats.segments, "breakpoints": stats.breakpoints},
        close=graph.reset,
    )


def _bcg_runner(
    case: Case, ctx: BuildContext, executor: str | None, compiled: bool = False, **runner_kwargs: Any
) -> Built:
    """The library as a serving engine uses it: a GraphRunner with one bucket of size T
    (``runner_kwargs``: more GraphRunner options, e.g. ``sanitize=False``)."""
    if not case.use_runner and not compiled:
        return _bcg_graph(case, ctx, executor)
    fn = forward_of(case, case.bp, compiled)
    info: dict[str, Any] = {}
    if compiled:
        info.update(compiling_call(fn, case.static_args, case.live, torch.cuda.synchronize))
    runner = bcg.GraphRunner(
        fn,
        buckets=[case.T] if case.T is not None else [case.static_args[0].shape[0]],
        example_inputs=case.static_args,
        capture_live=case.live_for if case.live_for is not None else case.live,
        progress=False,
        **runner_kwargs,
    )
    t0 = time.perf_counter()
    runner.capture()
    capture_s = time.perf_counter() - t0
    graph = runner.graph(runner.buckets[0])
    if graph is None:
        raise RuntimeError(f"the runner's capture failed: {runner.stats()['failed_buckets']}")
    if executor is not None:
        graph.use_executor(executor)
    torch.cuda.synchronize()
    stats = graph.stats()
    args, fresh_live = case.static_args, case.fresh_live
    return Built(
        run=lambda: runner(*args, live=fresh_live()),
        capture_s=capture_s,
        pool_bytes=runner.stats()["pool_bytes"],
        info={**info, "executor": graph.executor, "segments": stats.segments, "breakpoints": stats.breakpoints},
        close=runner.reset,
    )


def _floor(case: Case, ctx: BuildContext, compiled: bool) -> Built:
    """The forward with live values frozen, captured as ONE ``torch.cuda.CUDAGraph``."""
    fn = forward_of(case, case.bp_frozen, compiled)
    info: dict[str, Any] = {"segments": 1, "breakpoints": 0}
    if compiled:
        info.update(compiling_call(fn, case.static_args, case.live, torch.cuda.synchronize))
    args = case.static_args
    stream = capture_stream_warmup(fn, args, ctx.capture_warmup, case.live)
    pool = torch.cuda.graph_pool_handle()
    g = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.cuda.graph(g, pool=pool, stream=stream):
        out = fn(*args)
    capture_s = time.perf_counter() - t0
    from bcg.memory import pool_bytes

    held = {"g": g, "out": out}

    def run() -> torch.Tensor:
        held["g"].replay()
        return held["out"]

    def close() -> None:
        torch.cuda.synchronize()
        held["g"].reset()
        held.clear()

    return Built(
        run=run,
        capture_s=capture_s,
        pool_bytes=pool_bytes(pool, torch.cuda.current_device()),
        info=info,
        close=close,
    )


def _compile_reason() -> str | None:
    from torch.utils._triton import has_triton

    return None if has_triton() else "torch.compile modes need Triton (Inductor's GPU backend)"


# -- the modes ------------------------------------------------------------------------------


@register_mode("eager", needs_cuda=False, help="plain eager run; breakpoints are plain calls (bcg.live_scope)")
def build_eager(case: Case, ctx: BuildContext) -> Built:
    fn = case.forward(case.bp)
    args, fresh_live = case.static_args, case.fresh_live

    def run() -> torch.Tensor:
        with bcg.live_scope(fresh_live()):
            return fn(*args)

    return Built(run=run)


@register_mode("floor", help="the same kernels in ONE torch.cuda.CUDAGraph, live values frozen at capture")
def build_floor(case: Case, ctx: BuildContext) -> Built:
    return _floor(case, ctx, compiled=False)


@register_mode("bcg", help="bcg.GraphRunner (one bucket = T), default executor")
def build_bcg(case: Case, ctx: BuildContext) -> Built:
    return _bcg_runner(case, ctx, None)


@register_mode("bcg-graph", help="a bare bcg.make_graph (no runner: no input copies, no padding sanitizers)")
def build_bcg_graph(case: Case, ctx: BuildContext) -> Built:
    return _bcg_graph(case, ctx, None)


@register_mode(
    "bcg-python",
    help="bcg.GraphRunner with use_executor('python') (only when a native executor exists)",
    available=_native_reason,
)
def build_bcg_python(case: Case, ctx: BuildContext) -> Built:
    return _bcg_runner(case, ctx, "python")


@register_mode("bcg-eager", needs_cuda=False, help="bcg.make_graph(..., mode='eager'): re-runs the function")
def build_bcg_eager(case: Case, ctx: BuildContext) -> Built:
    graph = bcg.make_graph(case.forward(case.bp), *case.static_args, mode="eager", live=case.live)
    stats = graph.stats()
    fresh_live, replay = case.fresh_live, graph.replay
    return Built(
        run=lambda: replay(live=fresh_live()),
        capture_s=stats.capture_s,
        pool_bytes=None,
        info={"segments": stats.segments, "breakpoints": stats.breakpoints},
        close=graph.reset,
    )


@register_mode(
    "floor-compile",
    help="floor over the torch.compile'd regions (Inductor kernels, lengths frozen, ONE graph)",
    available=_compile_reason,
    compiled=True,
)
def build_floor_compile(case: Case, ctx: BuildContext) -> Built:
    return _floor(case, ctx, compiled=True)


@register_mode(
    "bcg-compile",
    help="bcg.GraphRunner (one bucket = T) over the torch.compile'd regions; row has compile_s",
    available=_compile_reason,
    compiled=True,
)
def build_bcg_compile(case: Case, ctx: BuildContext) -> Built:
    return _bcg_runner(case, ctx, None, compiled=True)


# The peers register themselves as modes too (after ours, so they run last).
from bcg.bench import peers as _peers  # noqa: E402,F401
