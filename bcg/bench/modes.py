"""bcg's own modes (``eager``, ``floor``, ``bcg``, ...), registered in :mod:`bcg.bench.registry`.

To add a mode, write one function ``build(case, ctx) -> Built`` and decorate it
with :func:`~bcg.bench.registry.register_mode` (see there for the contract).

All modes of one benchmark point are built, then timed in rounds, then closed:
their graphs hold memory together, so a mode must not depend on another's
being closed, and must replay correctly after any other mode's replay.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import bcg
from bcg.bench.case import Case, eager_step
from bcg.bench.registry import (
    MODES,
    BuildContext,
    Built,
    NotApplicable,
    capture_stream_warmup,
    forward_of,
    looped,
    register_mode,
)
from bcg.bench.timing import compiling_call
from bcg.core.torch_internals import has_triton


# -- helpers -----------------------------------------------------------------------------------


def has_native_executor() -> bool:
    """Whether this install can build the ``"native"`` replay executor."""
    from bcg.core.replay import make_executor

    try:
        make_executor((), "native")
    except Exception:
        return False
    return True


def _native_reason() -> str | None:
    return None if has_native_executor() else "no native executor in this install: the 'bcg' row is the python executor"


def _runner_measures(
    runner_stats: Callable[[], dict[str, Any]], staged: bool = False, keyed: bool = False,
) -> Callable[[], Callable[[], dict[str, Any]]]:
    """A ``Built.measure`` for a runner mode's rows, from its ``stats`` over the timed replays.

    Arguments:
        runner_stats: the runner's ``stats``. ``staged``: adds ``inline_fraction`` (its inline
            replays / graph calls over the timing rounds, their warm-up calls included) and
            ``staged_fallbacks`` ({reason: replays of the breakable form}).
        keyed: the runner's breakpoints are keyed: adds, over the same rounds, ``hit_rate``
            (breakpoint calls served by a variant), ``stitched_share`` (graph calls launched as
            one stitched graph), ``variant_captures``, and ``cache_mib`` (variant pools and
            stitched executables, at the end).
    """

    def start() -> Callable[[], dict[str, Any]]:
        before = runner_stats()

        def stop() -> dict[str, Any]:
            out: dict[str, Any] = {}
            after = runner_stats()
            if staged:
                calls = after["graph_calls"] - before["graph_calls"]
                inline = after["inline_replays"] - before["inline_replays"]
                out["inline_fraction"] = inline / calls if calls else None
                fallbacks = {r: n - before["staged_fallbacks"].get(r, 0) for r, n in after["staged_fallbacks"].items()}
                out["staged_fallbacks"] = {r: n for r, n in fallbacks.items() if n}
            if keyed:
                out.update(_variant_measures(before, after))
            return out

        return stop

    return start


def _variant_measures(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """A keyed runner's hit rate, stitched share, captures and cache size between two ``stats()``;
    the stitched executables' instantiate and update counts and mean ms since the capture."""
    b, a = before["variants"] or {}, after["variants"] or {}
    hits = a.get("hits", 0) - b.get("hits", 0)
    calls = hits + a.get("misses", 0) - b.get("misses", 0)
    graph_calls = after["graph_calls"] - before["graph_calls"]
    return {
        "hit_rate": hits / calls if calls else None,
        "stitched_share": (a.get("stitched_replays", 0) - b.get("stitched_replays", 0)) / graph_calls if graph_calls else None,
        "variant_captures": a.get("captures", 0) - b.get("captures", 0),
        "cache_mib": a.get("cache_bytes", 0) / 2**20,
        **_stitch_costs(a),
    }


def _stitch_costs(variants: dict[str, Any]) -> dict[str, Any]:
    """Stitched executables of every bucket so far: instantiations and in-place updates, and their
    mean cost in ms (instantiate + upload; ``cudaGraphExecUpdate``)."""
    caches = [g["stitched"] for b in variants.get("buckets", {}).values() for g in b.values() if g.get("stitched")]
    out: dict[str, Any] = {}
    for count_key, ms_key in (("instantiations", "instantiate_ms"), ("updates", "update_ms")):
        count = sum(c[count_key] for c in caches)
        total = sum((c[ms_key] or 0.0) * c[count_key] for c in caches)
        out[f"stitched_{count_key}"] = count
        out[f"stitched_{ms_key}"] = total / count if count else None
    return out


def _held_check(graph: bcg.BreakableGraph) -> dict[str, Any]:
    """Row fields: the storages the graph holds outside its pool, and the host cost of the check
    every replay makes first (``graph.check_held``; median over 5 rounds of 2000 calls, in us)."""
    check = graph.check_held
    rounds = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(2000):
            check()
        rounds.append((time.perf_counter() - t0) / 2000 * 1e6)
    stats = graph.stats()
    return {"held_storages": stats.held_storages, "held_check_us": statistics.median(rounds)}


def _bcg_graph(case: Case, ctx: BuildContext, executor: str | None, compiled: bool | str = False) -> Built:
    """A bare ``bcg.make_graph``: replays on the static inputs, nothing around them."""
    fn = forward_of(case, case.bp, compiled)
    if compiled:
        compiling_call(fn, case.static_args, case.live, torch.cuda.synchronize)
    graph = bcg.make_graph(fn, *case.static_args, live=case.live, warmup=ctx.capture_warmup,
                           capture_error_mode=ctx.capture_error_mode)
    if executor is not None:
        graph.use_executor(executor)
    torch.cuda.synchronize()
    stats = graph.stats()
    fresh_live, replay = case.fresh_live, graph.replay

    def run() -> torch.Tensor:
        return replay(live=fresh_live())

    built = Built(
        run=run,
        capture_s=stats.capture_s,
        pool_bytes=stats.pool_bytes,
        info={"executor": graph.executor, "segments": stats.segments, "breakpoints": stats.breakpoints,
              **_held_check(graph)},
        close=graph.reset,
        host=True,
    )
    return looped(case, built, lambda live: replay(live=live), case.static_args)


def _bcg_runner(
    case: Case, ctx: BuildContext, executor: str | None, compiled: bool | str = False, staged: bool = False,
    live_stream: Callable[[], Any] | None = None, keyed: bool = False, warm: int = 0, **runner_kwargs: Any,
) -> Built:
    """The library as a serving engine uses it: a GraphRunner with one bucket of size T, called
    on inputs written into its own buffers (``input_buffers``: no input copy per call)
    (``staged``: the case's breakpoints are staged, rows add the inline fraction;
    ``live_stream``: each call's live metadata (default ``case.fresh_live``); ``keyed``: its
    breakpoints are keyed, rows add hit rate, stitched share, captures and cache size;
    ``warm``: calls made before timing; ``runner_kwargs``: more GraphRunner options, e.g.
    ``sanitize=False``)."""
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
        live=case.live_for if case.live_for is not None else case.live,
        progress=False,
        ranks=ctx.ranks,
        capture_error_mode=ctx.capture_error_mode,
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
    # Inputs built in the runner's own buffers, as an engine builds its batch in persistent
    # buffers (and as the floor replays on its static inputs): calls copy no input.
    args = runner.input_buffers(runner.buckets[0])

    def load_inputs() -> None:  # the case's inputs into the runner's buffers
        for buf, x in zip(args, case.static_args):
            if isinstance(buf, torch.Tensor) and buf is not x:
                buf.copy_(x)

    load_inputs()
    torch.cuda.synchronize()
    stats = graph.stats()
    fresh_live = live_stream if live_stream is not None else case.fresh_live

    def run() -> torch.Tensor:  # (the live metadata is built in the call: the caller's work)
        return runner(*args, live=fresh_live())

    clock = case.user_time
    own: list[float] | None = None
    host_run: Callable[[], torch.Tensor] | None = None
    if clock is not None:  # the host-timed calls keep bcg's own time; the timed replays run no clock
        own = []
        now = time.perf_counter

        def counted_run() -> torch.Tensor:
            live = fresh_live()
            clock.counting = True
            try:
                user0, t0 = clock.charged(), now()
                out = runner(*args, live=live)
                own.append(now() - t0 - (clock.charged() - user0))
            finally:
                clock.counting = False
            return out

        host_run = counted_run

    def check() -> torch.Tensor:  # on the case's current inputs (fresh ones, when checked)
        load_inputs()
        return runner(*args, live=case.live if live_stream is not None else fresh_live())

    for _ in range(warm):
        run()
    built = Built(
        run=run,
        capture_s=capture_s,
        pool_bytes=runner.stats()["pool_bytes"],
        info={**info, "executor": graph.executor, "segments": stats.segments, "breakpoints": stats.breakpoints,
              "forms": [f.name for f in graph.forms], **_held_check(graph)},
        close=runner.reset,
        measure=_runner_measures(runner.stats, staged=staged, keyed=keyed) if staged or keyed else None,
        host=True,
        host_run=host_run,
        check=check,
        own_host_s=own,
    )
    # a decode loop: each step's inputs written into the runner's own buffers on the device
    return looped(case, built, lambda live: runner(*args, live=live), args)


def _bcg_staged(case: Case, ctx: BuildContext, compiled: bool | str) -> Built:
    """:func:`_bcg_runner` over the case's staged form (``case.staged``)."""
    if case.staged is None:
        raise NotApplicable(f"{case.label} has no staged breakpoint here")
    return _bcg_runner(case.staged, ctx, None, compiled=compiled, staged=True)


def _bcg_repeating(case: Case, ctx: BuildContext, kind: str, keyed: bool = True) -> Built:
    """:func:`_bcg_runner` over a stream of length tuples that repeat as ``kind`` says, with the
    case's keyed breakpoint (``keyed``) or its plain one; ``2 * VariantPolicy.window`` calls
    are made before timing (variants captured; capturing stopped where keys do not repeat)."""
    if case.specialized is None or case.live_stream is None:
        raise NotApplicable(f"{case.label} has no keyed breakpoint here (the unfused attention has one)")
    policy = bcg.VariantPolicy(max_stitched=ctx.max_stitched)
    return _bcg_runner(case.specialized if keyed else case, ctx, None, live_stream=case.live_stream(kind),
                       keyed=keyed, warm=2 * policy.window, variants=policy)


def _floor(case: Case, ctx: BuildContext, compiled: bool | str, fn: Callable[..., torch.Tensor] | None = None) -> Built:
    """The forward with live values frozen (or ``fn``), captured as ONE ``torch.cuda.CUDAGraph``;
    rows have its ``host_us_per_replay`` (one ``replay()``)."""
    fn = fn if fn is not None else forward_of(case, case.bp_frozen, compiled)
    info: dict[str, Any] = {"segments": 1, "breakpoints": 0}
    if compiled:
        info.update(compiling_call(fn, case.static_args, case.live, torch.cuda.synchronize))
    args = case.static_args
    stream = capture_stream_warmup(fn, args, ctx.capture_warmup, case.live)
    pool = torch.cuda.graph_pool_handle()
    g = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.cuda.graph(g, pool=pool, stream=stream, capture_error_mode=ctx.capture_error_mode):
        out = fn(*args)
    capture_s = time.perf_counter() - t0
    from bcg.core.pool import pool_bytes

    held = {"g": g, "out": out}

    def run() -> torch.Tensor:
        held["g"].replay()
        return held["out"]

    def close() -> None:
        torch.cuda.synchronize()
        held["g"].reset()
        held.clear()

    built = Built(
        run=run,
        capture_s=capture_s,
        pool_bytes=pool_bytes(pool, torch.cuda.current_device()),
        info=info,
        close=close,
        host=True,  # its host time per replay, beside the runners'
    )
    return looped(case, built, lambda live: run(), args)  # a decode loop: the same graph back to back


def _compile_reason() -> str | None:
    return None if has_triton() else "torch.compile modes need Triton (Inductor's GPU backend)"


# -- the modes ------------------------------------------------------------------------------


@register_mode("eager", needs_cuda=False, help="plain eager run; breakpoints are plain calls (bcg.live_scope)")
def build_eager(case: Case, ctx: BuildContext) -> Built:
    fn = case.forward(case.bp)
    args, fresh_live = case.static_args, case.fresh_live

    def run() -> torch.Tensor:
        with bcg.live_scope(fresh_live()):
            return fn(*args)

    return looped(case, Built(run=run), eager_step(fn, args), args)


@register_mode("floor", help="the same kernels in ONE torch.cuda.CUDAGraph, live values frozen at capture")
def build_floor(case: Case, ctx: BuildContext) -> Built:
    return _floor(case, ctx, compiled=False)


def _again(of: str) -> None:
    """Register ``<of>-again``: mode ``of`` built a second time (its own compile and capture) and
    timed as a mode of its own: its paired ratio to ``of`` is the run's A/A noise for ``of``."""
    spec = MODES[of]

    def build(case: Case, ctx: BuildContext) -> Built:
        return spec.build(case, ctx)

    register_mode(f"{of}-again", help=f"{of} built and captured a second time, timed as its own mode: its paired "
                  f"ratio to {of} is the run's A/A noise (what a ratio can be off by with nothing different)",
                  available=spec.available, compiled=spec.compiled)(build)


_again("floor")


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
    built = Built(
        run=lambda: replay(live=fresh_live()),
        capture_s=stats.capture_s,
        pool_bytes=None,
        info={"segments": stats.segments, "breakpoints": stats.breakpoints},
        close=graph.reset,
    )
    return looped(case, built, lambda live: replay(live=live), case.static_args)


@register_mode(
    "floor-compile",
    help="floor over the torch.compile'd regions (Inductor kernels, lengths frozen, ONE graph)",
    available=_compile_reason,
    compiled=True,
)
def build_floor_compile(case: Case, ctx: BuildContext) -> Built:
    return _floor(case, ctx, compiled=True)


_again("floor-compile")


@register_mode(
    "bcg-compile",
    help="bcg.GraphRunner (one bucket = T) over the torch.compile'd regions; row has compile_s",
    available=_compile_reason,
    compiled=True,
)
def build_bcg_compile(case: Case, ctx: BuildContext) -> Built:
    return _bcg_runner(case, ctx, None, compiled=True)


@register_mode(
    "bcg-staged",
    help="bcg.GraphRunner (one bucket = T) over the staged breakpoint (captured inline, its metadata "
    "staged by prepare; the breakable form as fallback); row has inline_fraction",
)
def build_bcg_staged(case: Case, ctx: BuildContext) -> Built:
    return _bcg_staged(case, ctx, compiled=False)


@register_mode(
    "bcg-staged-pycall",
    help="bcg-staged with the runner's call and the graph's replay in Python around the native executor's "
    "launches (BCG_NATIVE=0 while its first call builds them): the one native call's A/B",
)
def build_bcg_staged_pycall(case: Case, ctx: BuildContext) -> Built:
    built = _bcg_staged(case, ctx, compiled=False)
    previous = os.environ.get("BCG_NATIVE")
    os.environ["BCG_NATIVE"] = "0"  # (the executors were built at the capture: native)
    try:
        built.run()
    finally:
        if previous is None:
            del os.environ["BCG_NATIVE"]
        else:
            os.environ["BCG_NATIVE"] = previous
    return built


@register_mode(
    "bcg-staged-compile",
    help="bcg-staged over the torch.compile'd regions; row has compile_s and inline_fraction",
    available=_compile_reason,
    compiled=True,
)
def build_bcg_staged_compile(case: Case, ctx: BuildContext) -> Built:
    return _bcg_staged(case, ctx, compiled=True)


# -- the whole forward compiled (fullgraph=True), bcg's breakpoints one op each -----------------------


@register_mode(
    "floor-fullcompile",
    help="the whole forward compiled with fullgraph=True, attention frozen, in ONE torch.cuda.CUDAGraph; "
    "row has compile_s",
    available=_compile_reason,
    compiled="full",
)
def build_floor_fullcompile(case: Case, ctx: BuildContext) -> Built:
    return _floor(case, ctx, compiled="full", fn=forward_of(case, case.bp_frozen, "full"))


_again("floor-fullcompile")


@register_mode(
    "bcg-fullcompile",
    help="bcg.GraphRunner (one bucket = T) over the whole forward compiled with fullgraph=True (each "
    "breakpoint one op); row has compile_s",
    available=_compile_reason,
    compiled="full",
)
def build_bcg_fullcompile(case: Case, ctx: BuildContext) -> Built:
    return _bcg_runner(case, ctx, None, compiled="full")


@register_mode(
    "bcg-staged-fullcompile",
    help="bcg-staged over the whole forward compiled with fullgraph=True; row has compile_s and inline_fraction",
    available=_compile_reason,
    compiled="full",
)
def build_bcg_staged_fullcompile(case: Case, ctx: BuildContext) -> Built:
    return _bcg_staged(case, ctx, compiled="full")


def _partition_reason() -> str | None:
    why = _compile_reason()
    if why is not None:
        return why
    if not hasattr(torch.Tag, "cudagraph_unsafe"):
        return "this torch has no cudagraph_unsafe tag (Inductor's graph partition needs torch >= 2.9)"
    return None


@register_mode(
    "inductor-partition",
    help="the peer: the whole forward compiled with mode='reduce-overhead' and Inductor's graph partition, "
    "attention a custom op tagged cudagraph_unsafe (run eagerly between Inductor's CUDA graphs), "
    "torch.compiler.cudagraph_mark_step_begin() per call; row has compile_s (warm-up and recording "
    "included) and pool_mib (memory reserved by them)",
    available=_partition_reason,
    compiled="full",
)
def build_inductor_partition(case: Case, ctx: BuildContext) -> Built:
    if case.make_partition_forward is None:
        raise NotApplicable(f"{case.label}: no attention op for Inductor's graph partition here")
    args, fresh_live, sync = case.static_args, case.fresh_live, torch.cuda.synchronize
    # mode="reduce-overhead" is options={"triton.cudagraphs": True}; torch.compile takes one or the other
    compiled = torch.compile(case.make_partition_forward(), fullgraph=True, dynamic=False,
                             options={"triton.cudagraphs": True, "graph_partition": True})
    sync()
    reserved = torch.cuda.memory_reserved()
    t0 = time.perf_counter()
    with bcg.live_scope(case.live):
        for _ in range(3):  # compile, warm up, record (cudagraph trees record at the later calls)
            torch.compiler.cudagraph_mark_step_begin()
            compiled(*args)
    sync()
    compile_s = time.perf_counter() - t0
    mark = torch.compiler.cudagraph_mark_step_begin

    def run() -> torch.Tensor:
        mark()
        with bcg.live_scope(fresh_live()):
            return compiled(*args)

    return Built(run=run, capture_s=None, pool_bytes=max(torch.cuda.memory_reserved() - reserved, 0),
                 info={"compile_s": compile_s})


@register_mode(
    "bcg-specialized",
    help="bcg.GraphRunner over the keyed breakpoint (variants per length tuple, stitched into one graph "
    "when all hit), the point's fixed tuple; rows have hit_rate, stitched_share, variant_captures, cache_mib",
)
def build_bcg_specialized(case: Case, ctx: BuildContext) -> Built:
    return _bcg_repeating(case, ctx, "fixed")


@register_mode(
    "bcg-specialized-zipf",
    help="bcg-specialized over length tuples drawn Zipf-distributed from --zipf-tuples tuples",
)
def build_bcg_specialized_zipf(case: Case, ctx: BuildContext) -> Built:
    return _bcg_repeating(case, ctx, "zipf")


@register_mode(
    "bcg-specialized-never",
    help="bcg-specialized over length tuples that never repeat (compare with bcg-never)",
)
def build_bcg_specialized_never(case: Case, ctx: BuildContext) -> Built:
    return _bcg_repeating(case, ctx, "never")


@register_mode(
    "bcg-never",
    help="bcg (plain breakpoints) over the same never-repeating length tuples as bcg-specialized-never",
)
def build_bcg_never(case: Case, ctx: BuildContext) -> Built:
    return _bcg_repeating(case, ctx, "never", keyed=False)


@register_mode(
    "floor-no-allreduce",
    help="--tp: the floor without its all-reduces (wrong values by design: rows give allreduce_share)",
)
def build_floor_no_allreduce(case: Case, ctx: BuildContext) -> Built:
    if case.make_forward_no_reduce is None:
        raise NotApplicable(f"{case.label}: no all-reduces here (tensor parallel runs only, --tp)")
    return _floor(case, ctx, compiled=False, fn=case.make_forward_no_reduce(case.bp_frozen))
