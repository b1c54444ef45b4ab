"""Parity with PyTorch's CUDA-graph tests (issue #50, part 3).

Each test is named after a ``test_graph_*`` test of pytorch/pytorch's ``test/test_cuda.py``, asserts
what it asserts against ``bcg.capture`` (``bcg.make_graph`` where it fits), and has a ``breakpoint``
variant where one makes sense. Where bcg differs from ``torch.cuda.graph`` on purpose, it asserts
bcg's documented behaviour: a capture runs the work once (outputs are right when it ends, random
draws advance the generator); code is warmed up before capture; bcg captures on a stream of its own
(only ``stream=torch.cuda.default_stream()`` is refused); a breakpoint's body runs eagerly (not
capturing: ``manual_seed`` and host syncs are legal there); an empty capture has no segments and no
"CUDA Graph is empty" warning; graphs sharing a pool must not replay concurrently or out of capture
order, so torch's assertions that such replays corrupt each other are not repeated.
"""

from __future__ import annotations

import gc
import inspect
import math
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import bcg

pytestmark = pytest.mark.cuda

BREAKPOINT = pytest.mark.parametrize("breakpoint", [False, True], ids=["plain", "breakpoint"])
F32 = {"rtol": 1.3e-6, "atol": 1e-5}  # torch's assertEqual tolerances for float32
SHARES = ["none", "pool()", "graph_pool_handle()"]


@bcg.breakpoint(mutates="t")
def _scale(t: torch.Tensor) -> None:
    """Eager at every replay: multiplies ``t`` in place by the live factor (1.0 when none is set)."""
    t.mul_(bcg.live(1.0))


@bcg.breakpoint(mutates="t")
def _noise(t: torch.Tensor) -> None:
    """Eager at every replay: adds a fresh draw of normal noise (default generator) to ``t``."""
    t.add_(torch.randn_like(t))


def _capture(fn: Callable[..., Any], *args: Any, **options: Any) -> tuple[bcg.BreakableGraph, Any]:
    """``fn(*args)`` captured by ``bcg.capture`` (the caller warmed it up)."""
    graph = bcg.BreakableGraph()
    with bcg.capture(graph, **options):
        out = fn(*args)
    return graph, out


def _torch_graph(fn: Callable[[], Any], warmup: bool = True) -> tuple[torch.cuda.CUDAGraph, Any]:
    """``fn()`` captured by ``torch.cuda.graph`` on a side stream, warmed up there first (torch's recipe)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    if warmup:
        with torch.cuda.stream(side):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        out = fn()
    return graph, out


def _settle() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def _assert_clean() -> None:
    """No stream is left capturing, and a capture (begun on the default stream) and its replay work."""
    assert not torch.cuda.is_current_stream_capturing()
    x = torch.randn(64, device="cuda")
    x * 3  # warm up
    graph, y = _capture(lambda: x * 3)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert torch.equal(y, x * 3)


def _adds(b: torch.Tensor, step: float, breakpoint: bool) -> torch.Tensor:
    """torch's ``b = b + step`` ten times (a breakpoint after the fifth with ``breakpoint``)."""
    for i in range(10):
        b = b + step
        if breakpoint and i == 4:
            _scale(b)
    return b


def _chain(t: torch.Tensor, val: float, breakpoint: bool, n: int = 5) -> torch.Tensor:
    """torch's ``func_with_temps`` ``n`` times (a breakpoint after the third with ``breakpoint``)."""
    for i in range(n):
        t = (t.clone() + val) + (t.clone() + val)
        if breakpoint and i == 2:
            _scale(t)
    return t


# -- capture, replay, reset, errors --------------------------------------------------------------


def test_graph_is_current_stream_capturing() -> None:
    """Segments are captured; a breakpoint's body is not, at capture and at replay."""
    seen: list[tuple[str, bool]] = []

    @bcg.breakpoint
    def probe(t: torch.Tensor) -> None:
        seen.append(("breakpoint", torch.cuda.is_current_stream_capturing()))

    x = torch.randn(16, device="cuda")
    (x + 1) + 1
    assert not torch.cuda.is_current_stream_capturing()
    graph = bcg.BreakableGraph()
    with bcg.capture(graph):
        seen.append(("segment 0", torch.cuda.is_current_stream_capturing()))
        y = x + 1
        probe(y)
        seen.append(("segment 1", torch.cuda.is_current_stream_capturing()))
        z = y + 1
    assert seen == [("segment 0", True), ("breakpoint", False), ("segment 1", True)]
    assert not torch.cuda.is_current_stream_capturing()
    seen.clear()
    graph.replay()
    assert seen == [("breakpoint", False)] and torch.equal(z, (x + 1) + 1)


@BREAKPOINT
def test_graph_capture_simple(breakpoint: bool) -> None:
    """Ten chained adds replay to eager's result; the capture itself already computed it once."""
    a = torch.randn(1000, device="cuda")
    _adds(a, 1, breakpoint)
    graph, b = _capture(_adds, a, 1, breakpoint)
    assert torch.equal(b, _adds(a, 1, breakpoint))  # torch's capture computes nothing
    a.copy_(torch.randn_like(a))
    graph.replay()
    assert torch.equal(b, _adds(a, 1, breakpoint))
    assert graph.stats().segments == 1 + breakpoint


@BREAKPOINT
def test_graph_capture_reset_recapture(breakpoint: bool) -> None:
    """After reset(), a capture into the same graph that writes the first capture's output and rebinds
    its name (as torch's test does: only the graph reaches the filled tensor) replays correctly."""
    a = torch.randn(1000, device="cuda")
    _adds(a.clone().fill_(2.0), 1, breakpoint)
    graph = bcg.BreakableGraph()
    with bcg.capture(graph):
        b = _adds(a, 1, breakpoint)
    a.copy_(torch.randn_like(a))
    graph.replay()
    assert torch.equal(b, _adds(a, 1, breakpoint))
    graph.reset()
    with bcg.capture(graph):
        b.fill_(2.0)
        b = _adds(b, 2, breakpoint)
    assert torch.equal(b, torch.full_like(b, 22.0))  # the capture ran it
    b.zero_()
    graph.replay()
    assert torch.equal(b, torch.full_like(b, 22.0))
    graph.reset()


@BREAKPOINT
def test_graph_debugdump(breakpoint: bool, tmp_path: Path) -> None:
    """bcg's debug dump (``graph.dump_dot``) of a two-stream capture: one DOT graph per segment."""
    x = torch.randn(1 << 20, device="cuda")
    y = torch.rand_like(x)
    side = torch.cuda.Stream()

    def fn() -> torch.Tensor:
        z = x + y
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            w = z + y
        torch.cuda.current_stream().wait_stream(side)
        if breakpoint:
            _scale(w)
        return w * 2

    fn()
    torch.cuda.synchronize()
    graph, out = _capture(fn)
    paths = graph.dump_dot(tmp_path)
    assert len(paths) == graph.stats().segments == 1 + breakpoint
    assert all(Path(p).read_text().lstrip().startswith("digraph") for p in paths)
    graph.replay()
    assert torch.equal(out, ((x + y) + y) * 2)


@BREAKPOINT
def test_graph_timing(breakpoint: bool) -> None:
    """External timing events recorded inside segments (across a breakpoint too) time a replay."""
    x = torch.randn(10_240_000, device="cuda")
    y = torch.rand_like(x)
    start, end = (torch.cuda.Event(enable_timing=True, external=True) for _ in range(2))

    def fn() -> torch.Tensor:
        start.record()
        z = x + y
        if breakpoint:
            _scale(z)
        end.record()
        return z

    x + y
    graph, z = _capture(fn)
    torch.cuda.synchronize()
    z.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert start.elapsed_time(end) > 0 and torch.equal(z, x + y)


def test_graph_error() -> None:
    """A capture on the default stream is refused (CaptureError, in-process: nothing reached CUDA);
    ``bcg.capture`` entered while the default stream is current captures on bcg's own stream."""
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    with pytest.raises(bcg.CaptureError, match="default stream"):
        with bcg.capture(bcg.BreakableGraph(), stream=torch.cuda.default_stream()):
            pass
    _assert_clean()


@BREAKPOINT
def test_graph_warn_if_has_zero_nodes(breakpoint: bool) -> None:
    """An empty capture is a graph of no segments, without torch's "CUDA Graph is empty" warning;
    holding only a host-only breakpoint, each replay runs that breakpoint and launches nothing."""
    calls: list[int] = []

    @bcg.breakpoint
    def host_only() -> None:
        calls.append(1)

    graph = bcg.BreakableGraph()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with bcg.capture(graph):
            if breakpoint:
                host_only()
    assert not [w for w in caught if "CUDA Graph is empty" in str(w.message)]
    assert (graph.stats().segments, graph.stats().breakpoints) == (0, int(breakpoint))
    graph.replay()
    graph.replay()
    assert len(calls) == 3 * breakpoint  # at capture, then once per replay


@BREAKPOINT
def test_graph_capture_oom(breakpoint: bool) -> None:
    """An allocation larger than the GPU in a segment raises torch's out-of-memory error; the capture
    is abandoned cleanly."""
    x = torch.randn(8, device="cuda")
    _scale(x * 2)
    graph = bcg.BreakableGraph()
    with pytest.raises(RuntimeError, match="out of memory"):
        with bcg.capture(graph):
            y = x * 2
            if breakpoint:
                _scale(y)
            torch.zeros(2**40, device="cuda")
    assert not graph.is_captured
    _assert_clean()


# -- random numbers ------------------------------------------------------------------------------

FUNCTIONAL = {"dropout": (F.dropout, {"p": 0.1}), "rrelu": (F.rrelu, {"training": True})}


@BREAKPOINT
@pytest.mark.parametrize("name", sorted(FUNCTIONAL))
def test_graph_rng_functional(name: str, breakpoint: bool) -> None:
    """Graphed, eager, graphed: one seeded Philox stream, exactly as eager; every replay draws afresh;
    under a seed, plain replays equal ``torch.cuda.graph``'s, and with a breakpoint its eager draw
    between the two segments' draws takes its place in the same stream."""
    op, kwargs = FUNCTIONAL[name]
    a = torch.randn(10_000, device="cuda")

    def fn(t: torch.Tensor) -> torch.Tensor:
        t = op(t, **kwargs)
        if breakpoint:
            _noise(t)
        return op(t, **kwargs)

    torch.cuda.manual_seed(5)
    control = fn(fn(fn(a)))
    graph_in = a.clone()
    fn(graph_in)
    graph, graph_out = _capture(fn, graph_in)
    torch.cuda.manual_seed(5)  # (the capture drew numbers: it ran once)
    graph.replay()
    graph_in.copy_(fn(graph_out))
    graph.replay()
    assert torch.equal(graph_out, control)
    twin = None if breakpoint else _torch_graph(lambda: fn(graph_in))
    for seed in (6, 128, 9999):
        torch.cuda.manual_seed(seed)
        graph_in.copy_(a)
        draws = []
        for _ in range(3):
            graph.replay()
            draws.append(graph_out.clone())
        assert not any(torch.equal(draws[i], draws[j]) for i in range(3) for j in range(i))
        assert not torch.equal(graph_out, control)
        torch.cuda.manual_seed(seed)
        for _ in range(3):
            control = fn(a)
        assert torch.equal(graph_out, control)
        if twin is not None:
            torch.cuda.manual_seed(seed)
            for _ in range(3):
                twin[0].replay()
            assert torch.equal(twin[1], graph_out)


DRAWS: dict[str, Callable[[torch.Tensor], tuple[tuple[Any, ...], dict[str, Any]]]] = {
    "bernoulli": lambda p: ((p.clone(),), {}),
    "normal": lambda p: ((p.clone() + 1, 1.0), {}),
    "poisson": lambda p: ((p.clone(),), {}),
    "rand": lambda p: ((p.numel(),), {"device": "cuda"}),
    "randint": lambda p: ((0, 3, (p.numel(),)), {"device": "cuda", "dtype": torch.float}),
    "randn": lambda p: ((p.numel(),), {"device": "cuda"}),
    "bernoulli_": lambda p: ((p.clone(),), {}),
    "geometric_": lambda p: ((0.3,), {}),
    **{m: (lambda p: ((), {})) for m in ("cauchy_", "exponential_", "log_normal_", "normal_", "random_", "uniform_")},
}


def _draw(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], into: torch.Tensor) -> torch.Tensor:
    """One draw: a torch function (a new tensor) or, for ``name_``, the Tensor method on ``into``."""
    return getattr(into, name)(*args) if name.endswith("_") else getattr(torch, name)(*args, **kwargs)


@bcg.breakpoint(mutates="into")
def _draw_eagerly(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], into: torch.Tensor) -> None:
    """Eager at every replay: one draw, written into ``into``."""
    into.copy_(_draw(name, args, kwargs, into))


@BREAKPOINT
@pytest.mark.parametrize("name", list(DRAWS))
def test_graph_rng_distributions(name: str, breakpoint: bool) -> None:
    """Right after the capture its two draws equal eager's under the same seed (bcg's capture ran them:
    torch asserts the opposite); each replay equals eager's draws under a new seed, after a dummy
    draw, with the breakpoint's own eager draw between the two in the same stream."""
    size = 10_000
    args, kwargs = DRAWS[name](torch.rand(size, device="cuda"))
    mid = torch.zeros(size, device="cuda")

    def draws(s1: torch.Tensor, s2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t1 = _draw(name, args, kwargs, s1)
        if breakpoint:
            _draw_eagerly(name, args, kwargs, mid)
        return t1, _draw(name, args, kwargs, s2)

    def seeded(seed: int) -> None:
        torch.cuda.manual_seed(seed)
        _draw(name, args, kwargs, torch.zeros(size, device="cuda"))  # the dummy draw

    def controls(seed: int) -> list[torch.Tensor]:
        seeded(seed)
        t1, t2 = draws(torch.zeros(size, device="cuda"), torch.zeros(size, device="cuda"))
        return [t1.clone(), t2.clone(), mid.clone()]

    statics = torch.zeros(size, device="cuda"), torch.zeros(size, device="cuda")
    draws(*statics)
    expected = controls(5)
    seeded(5)
    graph, (t1, t2) = _capture(draws, *statics)
    results = [t1, t2, mid] if breakpoint else [t1, t2]
    assert all(torch.equal(r, e) for r, e in zip(results, expected))
    for seed in (6, 314, 271):
        expected = controls(seed)
        seeded(seed)
        for r in results:
            r.zero_()
        graph.replay()
        assert all(torch.equal(r, e) for r, e in zip(results, expected))


def test_graph_checkpoint_preserve_rng_state() -> None:
    """Non-reentrant checkpointing with ``preserve_rng_state`` inside a capture: a replay's gradient
    under a seed equals eager's (no breakpoint variant: the stashed generator state is torch's)."""

    def grad_of() -> torch.Tensor:
        x = torch.ones(1, device="cuda", requires_grad=True)
        fn = lambda t: t * torch.sigmoid(torch.randn(1, device="cuda"))  # noqa: E731
        out = torch.utils.checkpoint.checkpoint(fn, x, use_reentrant=False, preserve_rng_state=True)
        return torch.autograd.grad(out, x)[0]

    grad_of()
    torch.cuda.manual_seed(42)
    eager = grad_of()
    graph, graphed = _capture(grad_of)
    torch.cuda.manual_seed(42)
    graph.replay()
    assert torch.equal(graphed, eager)


@BREAKPOINT
def test_graph_manual_seed_mismatch_raises(breakpoint: bool) -> None:
    """Reseeding to another seed in a segment raises torch's error and abandons the capture cleanly;
    in a breakpoint (eager) it is legal: the next segment draws from the new seed at every replay,
    and the segment before it continues from the last replay's generator state."""
    n = 1024
    torch.cuda.manual_seed(0)
    if not breakpoint:
        with pytest.raises(RuntimeError, match="set_current_seed can be called during stream capture"):
            with bcg.capture(bcg.BreakableGraph()):
                torch.cuda.manual_seed(1)
        _assert_clean()
        return

    @bcg.breakpoint
    def reseed() -> None:
        torch.cuda.manual_seed(bcg.live())

    def fn() -> tuple[torch.Tensor, torch.Tensor]:
        before = torch.rand(n, device="cuda")
        reseed()
        return before, torch.rand(n, device="cuda")

    def expected(seed: int, draw: int) -> torch.Tensor:
        """Draw number ``draw`` (0: the first) after seeding ``seed``, from a generator of our own."""
        gen = torch.Generator(device="cuda").manual_seed(seed)
        return [torch.rand(n, device="cuda", generator=gen) for _ in range(draw + 1)][-1]

    with bcg.live_scope(1):
        fn()
    graph, (before, after) = _capture(fn, live=1)
    previous = 1  # the capture reseeded to 1, then drew once
    for seed in (7, 7, 11):
        graph.replay(live=seed)
        assert torch.equal(after, expected(seed, 0))
        assert torch.equal(before, expected(previous, 1))
        previous = seed


@bcg.breakpoint(mutates="t")
def _noise_from(t: torch.Tensor, generator: torch.Generator) -> None:
    """Eager at every replay: adds a fresh uniform draw from ``generator`` to ``t``."""
    t.add_(torch.rand(t.shape, device=t.device, generator=generator))


@BREAKPOINT
@pytest.mark.parametrize("registered", ["generator", "graphsafe_get_state()"])
def test_graph_custom_generator_registered(breakpoint: bool, registered: str) -> None:
    """torch's ``register_generator_state``: draws from a generator of the user's own inside the
    capture, registered before it (the generator or its graph-safe state), give at every replay
    what the same calls give eagerly from the same seed (with a breakpoint that draws from it
    eagerly in between). Unregistered, the capture raises bcg's ``CaptureError`` naming the fix,
    and leaves CUDA clean."""
    n = 1024
    seed = int(torch.randint(0, 2**31, ()))
    gen = torch.Generator(device="cuda")

    def fn(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        a = torch.rand(n, device="cuda", generator=g)
        if breakpoint:
            _noise_from(a, g)
        return a, torch.rand(n, device="cuda", generator=g) * 2

    fn(gen)  # warm up
    graph = bcg.BreakableGraph()
    with pytest.raises(bcg.CaptureError, match=r"graph.register_generator_state\(generator\)"):
        with bcg.capture(graph):
            fn(gen)
    _assert_clean()
    graph.register_generator_state(gen.graphsafe_get_state() if registered != "generator" else gen)
    with bcg.capture(graph):
        a, b = fn(gen)
    gen.manual_seed(seed)
    reference = torch.Generator(device="cuda").manual_seed(seed)
    draws = set()
    for _ in range(3):
        graph.replay()
        ea, eb = fn(reference)
        assert torch.equal(a, ea) and torch.equal(b, eb)
        draws.add(float(a[0]))
    assert len(draws) == 3  # each replay drew anew
    with pytest.raises(TypeError, match="CUDA torch.Generator"):
        graph.register_generator_state(torch.Generator())
    with pytest.raises(bcg.CaptureError, match="holds a capture already"):
        graph.register_generator_state(torch.Generator(device="cuda"))
    assert len(graph.generator_states) == 1  # (the refused one is not kept)


def test_a_refused_segment_capture_leaves_registered_generators_usable(monkeypatch: pytest.MonkeyPatch) -> None:
    """A segment whose ``capture_begin`` fails (forced here, after torch opened the generators'
    capture state) abandons the capture, and eager draws from a registered generator still work:
    its capture state is closed with the default generator's."""
    from bcg.core.pool import SegmentGraph

    gen = torch.Generator(device="cuda").manual_seed(3)
    graph = bcg.BreakableGraph()
    graph.register_generator_state(gen)
    begin = SegmentGraph.capture_begin

    def refused(self: SegmentGraph, *args: Any, **kwargs: Any) -> None:
        begin(self, *args, **kwargs)
        raise RuntimeError("capture_begin refused (test)")

    monkeypatch.setattr(SegmentGraph, "capture_begin", refused)
    with pytest.raises(RuntimeError, match="refused"):
        with bcg.capture(graph):
            torch.rand(4, device="cuda", generator=gen)
    monkeypatch.undo()
    assert torch.rand(4, device="cuda", generator=gen).shape == (4,)  # not left capturing
    torch.rand(4, device="cuda")
    _assert_clean()


def test_the_generator_watch_tells_work_that_draws_random_numbers() -> None:
    """``bcg.core.rng.GeneratorWatch``: a recorded operation that takes a CUDA generator (by keyword
    or position) draws; one taking a CPU generator, or run while not recording, does not; a run that
    moves the default generator draws."""
    from bcg.core.rng import GeneratorWatch

    device = torch.cuda.current_device()
    recording = [True]
    watch = GeneratorWatch(device, recording=lambda: recording[0])
    with watch:
        torch.rand(3, generator=torch.Generator())
        torch.ones(3, device="cuda") * 2
        recording[0] = False
        torch.rand(3, device="cuda", generator=torch.Generator(device="cuda"))
    assert not watch.took
    before = watch.offsets()
    assert not watch.moved(before)
    torch.rand(3, device="cuda")  # the default generator
    assert watch.moved(before)
    for draw in (lambda g: torch.rand(3, device="cuda", generator=g),
                 lambda g: torch.empty(8, device="cuda").uniform_(generator=g),
                 lambda g: torch.multinomial(torch.ones(4, device="cuda"), 2, generator=g)):
        watch.reset()
        recording[0] = True
        with watch:
            draw(torch.Generator(device="cuda"))
        assert watch.took and watch.moved(watch.offsets())


# -- several graphs, pools, memory, streams ------------------------------------------------------


def _two_successive(share: str, breakpoint: bool, a: torch.Tensor) -> tuple[Any, Any, torch.Tensor]:
    """torch's pair: g0 computes b from a, g1 continues from g0's output (rebinding ``b``)."""
    pool = bcg.graph_pool_handle() if share == "graph_pool_handle()" else None
    g0, g1 = bcg.BreakableGraph(), bcg.BreakableGraph()
    with bcg.capture(g0, pool=pool):
        b = _chain(a.clone(), 1, breakpoint)
    with bcg.capture(g1, pool=g0.pool() if share == "pool()" else pool):
        b = _chain(b, 1, breakpoint)
    return g0, g1, b


@BREAKPOINT
@pytest.mark.parametrize("share", SHARES)
def test_graph_two_successive(share: str, breakpoint: bool) -> None:
    """Two chained graphs replayed between unrelated eager work give eager's results (torch: 3070 and
    442 per element from ones); two graphs sharing a pool reserve less than two pools."""
    a = torch.randn(1000, device="cuda")
    _chain(a, 1, breakpoint)
    g0, g1, b = _two_successive(share, breakpoint, a)
    for _ in range(2):
        a.copy_(torch.randn_like(a))
        c = _chain(a.clone(), 3, False, 2)
        g0.replay()
        c = _chain(c, 3, False, 2)
        g1.replay()
        c = _chain(c, 3, False, 2)
        assert torch.equal(b, _chain(_chain(a.clone(), 1, breakpoint), 1, breakpoint))
        assert torch.equal(c, _chain(a.clone(), 3, False, 6))
    if share != "none":
        assert g0.pool() == g1.pool()
        h0, h1, _ = _two_successive("none", breakpoint, a)
        assert g0.stats().pool_bytes < h0.stats().pool_bytes + h1.stats().pool_bytes


@BREAKPOINT
def test_graph_concurrent_replay(breakpoint: bool) -> None:
    """Two graphs with pools of their own, replayed at once on two streams, both give eager's results."""
    a = torch.randn(1_000_000, device="cuda")
    _chain(a, 1, breakpoint)
    g0, b = _capture(lambda: _chain(a.clone(), 1, breakpoint))
    g1, c = _capture(lambda: _chain(a.clone(), 2, breakpoint))
    s0, s1 = torch.cuda.Stream(), torch.cuda.Stream()
    for _ in range(2):
        a.copy_(torch.randn_like(a))
        torch.cuda.synchronize()
        with torch.cuda.stream(s0):
            torch.cuda._sleep(1_000_000)  # lines both replays' kernels up behind it
            s1.wait_stream(s0)
            g0.replay()
        with torch.cuda.stream(s1):
            g1.replay()
        torch.cuda.current_stream().wait_stream(s0)
        torch.cuda.current_stream().wait_stream(s1)
        assert torch.equal(b, _chain(a.clone(), 1, breakpoint))
        assert torch.equal(c, _chain(a.clone(), 2, breakpoint))


@BREAKPOINT
@pytest.mark.parametrize("share", SHARES)
def test_graph_three_successive(share: str, breakpoint: bool) -> None:
    """g0 makes c and d, g1 reads c (then the caller drops c), g2 reads d: replays in capture order
    give eager's results; graphs with pools of their own also in the order g0, g2, g1."""
    a = torch.randn(1000, device="cuda")
    _scale(a.clone() + 1)
    pool = bcg.graph_pool_handle() if share == "graph_pool_handle()" else None
    g0, g1, g2 = bcg.BreakableGraph(), bcg.BreakableGraph(), bcg.BreakableGraph()
    with bcg.capture(g0, pool=pool):
        b = a.clone()
        c = b + 1
        if breakpoint:
            _scale(c)
        d = b + 2
    later = g0.pool() if share == "pool()" else pool
    with bcg.capture(g1, pool=later):
        e = c + 3
        if breakpoint:
            _scale(e)
        del c
    with bcg.capture(g2, pool=later):
        f = d + 4
    for order in [(g0, g1, g2)] + ([(g0, g2, g1)] if share == "none" else []):
        a.copy_(torch.randn_like(a))
        for graph in order:
            graph.replay()
        assert torch.equal(e, (a + 1) + 3) and torch.equal(f, (a + 2) + 4)


@BREAKPOINT
@pytest.mark.parametrize("how", ["reset", "del"])
@pytest.mark.parametrize("nbytes", [512, (1 << 20) + 512, (10 << 20) + 512], ids=["small", "large", "huge"])
def test_graph_memory_stats_and_use_result_after_destroy_graph(nbytes: int, how: str, breakpoint: bool) -> None:
    """Once the graph is reset or dropped, the output the caller holds is right and is all of the
    graph's memory still allocated; once it is dropped too, the pool goes back to the driver (torch
    asserts its allocator's exact counters, which bcg does not document)."""
    a = torch.randn(nbytes // 4, device="cuda")

    def fn(t: torch.Tensor) -> torch.Tensor:
        b = t.clone()
        for i in range(5):
            b = b.clone() + 1
            if breakpoint and i == 2:
                _scale(b)
        return b

    expected = fn(a)
    _capture(fn, a)[0].reset()  # one-time allocations (RNG holders, handles) happen before the counts
    _settle()
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    graph, b = _capture(fn, a)
    for _ in range(2):
        b.zero_()
        graph.replay()
        assert torch.equal(b, expected)
        torch.cuda.empty_cache()
    if how == "reset":
        graph.reset()
    else:
        del graph
    _settle()
    assert torch.equal(b, expected)
    assert torch.cuda.memory_allocated() - allocated <= b.nbytes + 1024
    del b
    _settle()
    assert torch.cuda.memory_allocated() <= allocated and torch.cuda.memory_reserved() <= reserved


@BREAKPOINT
def test_graph_record_stream(breakpoint: bool) -> None:
    """A capture that begins while a record_stream'ed block is in use on another stream, and calls
    record_stream on a side stream inside a segment, succeeds; later allocations and replays work."""
    a = torch.randn(3, device="cuda")
    s0, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def fn() -> torch.Tensor:
        cur = torch.cuda.current_stream()
        b = a.clone()
        s2.wait_stream(cur)
        with torch.cuda.stream(s2):
            c = b.mul_(2.0) + 1
            b.record_stream(s2)
            del b
        cur.wait_stream(s2)
        if breakpoint:
            _scale(c)
        return c * 2

    fn()
    torch.cuda.synchronize()
    potential_problem = torch.zeros(3, device="cuda")
    with torch.cuda.stream(s0):
        potential_problem.record_stream(s0)
        torch.cuda._sleep(50_000_000)
        potential_problem.fill_(1.0)
    del potential_problem
    graph, out = _capture(fn)
    torch.cuda.synchronize()
    torch.zeros(3, device="cuda")  # processes the end-of-life events of b and potential_problem
    a.copy_(torch.randn_like(a))
    graph.replay()
    assert torch.equal(out, (a * 2 + 1) * 2)


@pytest.mark.skipif(not torch.backends.cudnn.is_available(), reason="needs cuDNN")
@BREAKPOINT
def test_graph_cudnn_dropout(breakpoint: bool) -> None:
    """A cuDNN LSTM with dropout, between eager calls, captures and replays (torch's test is about
    cuDNN's dropout state syncing across captured and eager calls): everything runs."""
    model = torch.nn.LSTM(256, 256, 2, dropout=0.5).cuda()
    x = torch.randn(32, 16, 256, device="cuda")

    def fn() -> torch.Tensor:
        with torch.no_grad():
            out, _ = model(x)
            if breakpoint:
                _scale(out)
            return out.sum(-1)

    fn()
    graph, y = _capture(fn)
    graph.replay()
    eager = fn()
    graph.replay()
    torch.cuda.synchronize()
    assert y.shape == eager.shape == (32, 16)
    assert bool(torch.isfinite(y).all()) and bool(y.abs().sum() > 0)


class _ScaleModule(torch.nn.Module):
    """Calls the ``_scale`` breakpoint on its input (eager at every replay)."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        _scale(h)
        return h


@BREAKPOINT
def test_graph_make_graphed_callables_same_pool(breakpoint: bool) -> None:
    """Three models captured by ``bcg.make_graph`` into one pool (torch: make_graphed_callables with
    ``pool=``; bcg graphs the forward only): each replay equals its model's eager forward."""
    pool = bcg.graph_pool_handle()
    entries = []
    with torch.no_grad():
        for _ in range(3):
            middle = [_ScaleModule()] if breakpoint else []
            model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), *middle,
                                        torch.nn.Linear(128, 128)).cuda()
            x = torch.randn(64, 32, device="cuda")
            entries.append((model, x, bcg.make_graph(model, x, pool=pool, live=1.0)))
        for model, x, graph in entries:
            assert graph.pool() == pool
            for scale in (0.5, 2.0):
                x.copy_(torch.randn_like(x))
                y = graph.replay(live=scale)
                with bcg.live_scope(scale):
                    torch.testing.assert_close(y, model(x))


def _allocator_settings(settings: str) -> None:
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or torch.cuda.memory._set_allocator_settings
    setter(settings)


def test_graph_capture_reclaim_2_streams() -> None:
    """With ``graph_capture_record_stream_reuse``, a block freed in a segment after a side stream used
    it is reused only once that stream joined back (torch's allocator, in bcg's pool)."""
    try:
        _allocator_settings("graph_capture_record_stream_reuse:True")
    except (RuntimeError, ValueError) as exc:
        pytest.skip(f"this torch has no graph_capture_record_stream_reuse: {exc}")
    side, ptrs = torch.cuda.Stream(), []

    def fn() -> list[torch.Tensor]:
        main = torch.cuda.current_stream()
        sink, data1 = torch.empty(8, device="cuda"), torch.empty(8, device="cuda")
        ptrs[:] = [data1.data_ptr()]
        side.wait_stream(main)
        with torch.cuda.stream(side):
            buf = torch.add(data1, 2.0)
            data1.record_stream(side)
        del data1
        data2 = torch.empty(8, device="cuda")  # before the join: not data1's block
        main.wait_stream(side)
        sink.fill_(1.0)
        data3 = torch.empty(8, device="cuda")  # after it: data1's block
        ptrs.extend([data2.data_ptr(), data3.data_ptr()])
        return [sink, buf, data2, data3]

    try:
        fn()
        torch.cuda.synchronize()
        _capture(fn)
        assert ptrs[0] != ptrs[1] and ptrs[0] == ptrs[2]
    finally:
        _allocator_settings("graph_capture_record_stream_reuse:False")


# -- optimizers ----------------------------------------------------------------------------------

OPTIMS: dict[str, dict[str, Any]] = {  # one representative set of torch's optim inputs per class
    "Adadelta": {"lr": 0.1, "weight_decay": 0.1},
    "Adagrad": {"lr": 0.1, "weight_decay": 0.1},  # no capturable flag (lr_decay 0: no step count read)
    "Adam": {"lr": 0.1, "betas": (0.9, 0.99), "weight_decay": 0.1, "amsgrad": True},
    "AdamW": {"lr": 0.1, "betas": (0.9, 0.99)},
    "Adamax": {"lr": 0.1, "weight_decay": 0.1},
    "ASGD": {"lr": 0.1, "weight_decay": 0.1},
    "NAdam": {"lr": 0.1, "weight_decay": 0.1},
    "RAdam": {"lr": 0.1, "weight_decay": 0.1},
    "RMSprop": {"lr": 0.1, "momentum": 0.9, "centered": True},
    "Rprop": {"lr": 0.1},
    "SGD": {"lr": 0.1, "momentum": 0.9, "nesterov": True},  # no capturable flag: capture-safe as is
}
FUSED: dict[str, dict[str, Any]] = {"Adam": {"lr": 0.1}, "AdamW": {"lr": 0.1}, "SGD": {"lr": 0.1, "momentum": 0.9}}
WARMUP, TRAIN = 3, 2  # torch's step counts


@bcg.breakpoint(mutates="grads")
def _unscale(grads: list[torch.Tensor]) -> None:
    """Eager at every replay: divides the gradients in place by this step's host-side loss scale."""
    torch._foreach_div_(grads, bcg.live()["scale"])


def _problem(steps: int, scalar: bool = True) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    params = [torch.randn((i + 5, i + 5), device="cuda") for i in range(2)]
    params += [torch.randn((), device="cuda")] if scalar else []
    return params, [[torch.randn_like(p) for p in params] for _ in range(steps)]


def _train(name: str, mode: str, params: list[torch.Tensor], grads: list[list[torch.Tensor]], *,
           foreach: bool | None = None, fused: bool = False, scales: list[float] | None = None) -> list[torch.Tensor]:
    """Train clones of ``params``, one step per entry of ``grads``; return them.

    ``mode``: ``"control"`` (capturable=False, eager), ``"eager"`` (capturable=True, eager), ``"torch"``
    (WARMUP eager steps, then ``torch.cuda.graph`` captures the step and later steps replay it),
    ``"bcg"`` (WARMUP eager steps, then ``bcg.capture``, which itself runs the next step, then
    replays). ``fused``: a fused optimizer under ``GradScaler.step`` + ``update``. ``scales``: step
    i's gradients arrive multiplied by ``scales[i]``, which the ``_unscale`` breakpoint divides out.
    """
    cls = getattr(torch.optim, name)
    kwargs = dict(FUSED[name], fused=True) if fused else dict(OPTIMS[name], foreach=foreach)
    if "capturable" in inspect.signature(cls).parameters:
        kwargs["capturable"] = mode != "control"
    ps = [p.clone().requires_grad_() for p in params]
    opt = cls(ps, **kwargs)
    scaler = torch.amp.GradScaler("cuda", init_scale=128.0) if fused else None
    if scaler is not None:
        scaler.scale(torch.ones((), device="cuda"))  # creates its scale tensors (torch: _lazy_init_...)
    factor = scales or [1.0] * len(grads)

    def step() -> None:
        if scales is not None:
            _unscale([p.grad for p in ps])
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()

    def feed(i: int, in_place: bool) -> None:
        for p, g in zip(ps, grads[i]):
            if in_place:
                p.grad.copy_(g * factor[i])
            else:
                p.grad = g * factor[i]  # a tensor of its own: later in-place feeds leave ``grads`` alone

    for i in range(len(grads) if mode in ("control", "eager") else WARMUP):
        feed(i, in_place=False)
        with bcg.live_scope({"scale": factor[i]}):
            step()
    if mode == "torch":
        graph, _ = _torch_graph(step, warmup=False)
        for i in range(WARMUP, len(grads)):
            feed(i, in_place=True)
            graph.replay()
    elif mode == "bcg":
        feed(WARMUP, in_place=False)
        bgraph, _ = _capture(step, live={"scale": factor[WARMUP]})
        for i in range(WARMUP + 1, len(grads)):
            feed(i, in_place=True)
            bgraph.replay(live={"scale": factor[i]})
    return [p.detach() for p in ps]


def _assert_all(got: list[torch.Tensor], want: list[torch.Tensor], **tolerance: float) -> None:
    for g, w in zip(got, want, strict=True):
        if tolerance:
            torch.testing.assert_close(g, w, **tolerance)
        else:
            assert torch.equal(g, w), f"max abs difference {(g - w).abs().max().item():.3e}"


@BREAKPOINT
@pytest.mark.parametrize("foreach", [False, True], ids=["for-loop", "foreach"])
@pytest.mark.parametrize("name", list(OPTIMS))
def test_graph_optims(name: str, foreach: bool, breakpoint: bool) -> None:
    """``opt.step()`` captured by bcg (capturable=True where the class has the flag): parameters equal
    ``torch.cuda.graph``'s exactly (with the breakpoint, which divides a host-side loss scale out of the
    gradients before each step: the same code's eager run's), and capturable=False's within torch's
    tolerance (RAdam's: ``test_graph_optims_radam_vs_capturable_false``)."""
    params, grads = _problem(WARMUP + TRAIN)
    scales = [2.0 ** (3 * i % 11) for i in range(len(grads))] if breakpoint else None
    got = _train(name, "bcg", params, grads, foreach=foreach, scales=scales)
    _assert_all(got, _train(name, "eager" if breakpoint else "torch", params, grads, foreach=foreach, scales=scales))
    if name != "RAdam":
        _assert_all(got, _train(name, "control", params, grads, foreach=foreach, scales=scales), **F32)


@pytest.mark.parametrize("steps", [WARMUP + TRAIN, 8], ids=["5-steps-as-torch", "8-steps-rectified"])
@pytest.mark.parametrize("foreach", [False, True], ids=["for-loop", "foreach"])
def test_graph_optims_radam_vs_capturable_false(steps: int, foreach: bool) -> None:
    """RAdam, kept apart: bcg equals ``torch.cuda.graph`` and capturable=True run eagerly, exactly, at
    any step count; within torch's 5 steps also capturable=False within tolerance. From step 6 RAdam
    rectifies (rho_t > 5), where capturable RAdam's float32 rho_t on the device (capturable=False:
    float64 on the host) moves every capturable=True run, graphed or not, beyond that tolerance: a
    torch difference, so there the reference is ``torch.cuda.graph``."""
    params, grads = _problem(steps)
    got = _train("RAdam", "bcg", params, grads, foreach=foreach)
    _assert_all(got, _train("RAdam", "torch", params, grads, foreach=foreach))
    _assert_all(got, _train("RAdam", "eager", params, grads, foreach=foreach))
    if steps <= 5:
        _assert_all(got, _train("RAdam", "control", params, grads, foreach=foreach), **F32)


@pytest.mark.parametrize("second_capturable", [True, False], ids=["both-capturable", "second-not"])
@pytest.mark.parametrize("name", ["Adam", "AdamW", "ASGD", "Adamax", "NAdam", "RAdam", "Adadelta", "RMSprop", "Rprop"])
def test_graph_optims_with_explicitly_capturable_param_groups(name: str, second_capturable: bool) -> None:
    """Param groups with capturable set per group: with one not capturable, the capture raises torch's
    error before any work (parameters untouched, CUDA clean); with both, replays follow capturable=False."""
    cls = getattr(torch.optim, name)
    p1, p2 = (torch.nn.Parameter(torch.randn(1, device="cuda")) for _ in range(2))
    r1, r2 = (torch.nn.Parameter(p.detach().clone()) for p in (p1, p2))
    grads = [[torch.randn(1, device="cuda") for _ in range(2)] for _ in range(WARMUP + TRAIN)]
    ref = cls([{"params": [r1], "capturable": False}, {"params": [r2], "capturable": False}])
    for g1, g2 in grads:
        r1.grad, r2.grad = g1.clone(), g2.clone()
        ref.step()
    opt = cls([{"params": [p1], "capturable": True}, {"params": [p2], "capturable": second_capturable}])
    for g1, g2 in grads[:WARMUP]:
        p1.grad, p2.grad = g1.clone(), g2.clone()
        opt.step()
    p1.grad, p2.grad = (g.clone() for g in grads[WARMUP])  # the capture's step
    if not second_capturable:
        before = [p1.detach().clone(), p2.detach().clone()]
        with pytest.raises(RuntimeError, match="Attempting CUDA graph capture of step"):
            _capture(opt.step)
        _assert_all([p1.detach(), p2.detach()], before)
        _assert_clean()
        return
    graph, _ = _capture(opt.step)  # runs step WARMUP
    for g1, g2 in grads[WARMUP + 1:]:
        p1.grad.copy_(g1)
        p2.grad.copy_(g2)
        graph.replay()
    _assert_all([p1.detach(), p2.detach()], [r1.detach(), r2.detach()], **F32)


@pytest.mark.parametrize("name", list(FUSED))
def test_graph_scaling_fused_optimizers(name: str) -> None:
    """``GradScaler.step`` + ``update`` around a fused optimizer, captured by bcg: parameters equal
    ``torch.cuda.graph``'s exactly and capturable=False's within torch's tolerance (Adagrad's fused
    implementation is CPU-only)."""
    params, grads = _problem(WARMUP + TRAIN, scalar=False)
    got = _train(name, "bcg", params, grads, fused=True)
    _assert_all(got, _train(name, "torch", params, grads, fused=True))
    _assert_all(got, _train(name, "control", params, grads, fused=True), **F32)


@BREAKPOINT
@pytest.mark.parametrize("impl", ["for-loop", "foreach", "fused"])
@pytest.mark.parametrize("name", ["Adam", "SGD"])
def test_graph_grad_scaling(name: str, impl: str, breakpoint: bool) -> None:
    """An fp16 forward and backward under ``GradScaler``, captured: each replay's gradient is the input
    times the scale (inf once fp16 overflows), and scale and growth tracker move as torch expects.
    With the breakpoint, ``scaler.step`` and ``update`` (host syncs) run inside the graph as a
    breakpoint; the capture ran that step once, so the growth tracker reads one higher at first."""
    scaler = torch.amp.GradScaler("cuda", init_scale=4.0)
    weight = torch.ones(100, device="cuda", requires_grad=True)
    opt = getattr(torch.optim, name)([weight], lr=0.1, foreach=impl == "foreach", fused=impl == "fused")
    static_input = torch.ones_like(weight)
    seen: list[torch.Tensor] = []

    @bcg.breakpoint(mutates="grad")
    def step_and_update(grad: torch.Tensor) -> None:
        seen.append(grad.clone())
        scaler.step(opt)
        scaler.update()

    def forward_backward(with_step: bool) -> None:
        scaler.scale((weight.half() * static_input).sum()).backward()
        if with_step:
            step_and_update(weight.grad)

    forward_backward(with_step=False)  # warm up
    opt.zero_grad(set_to_none=True)
    graph, _ = _capture(forward_backward, breakpoint)  # the backward allocates weight.grad in the pool
    trackers = [2, 0, 1, 0] if breakpoint else [1, 0, 1, 0]
    for data, scale, tracker, grad in zip([5, 20000, 5, 40000], [4, 2, 2, 1], trackers, [20, math.inf, 10, math.inf]):
        static_input.fill_(data)
        graph.replay()
        if not breakpoint:
            seen.append(weight.grad.clone())
            scaler.step(opt)
            scaler.update()
        assert torch.equal(seen[-1], torch.full_like(weight, grad))
        assert scaler._scale.item() == scale and scaler._growth_tracker.item() == tracker
