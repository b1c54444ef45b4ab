"""Graphs that stay right for the life of a process (GPU).

1. Nothing outside a graph frees memory its replay uses: Inductor's CUDA graphs, torch's
   cuBLAS workspace clears, ``torch.cuda.graph`` captures, other graphs' resets and
   ``empty_cache`` leave every bcg graph right, whichever was captured first.
2. Graphs, runners and keyed variants dropped on one thread never break another thread's
   capture, in either capture mode.
3. A replaced tensor is never read silently: a replay raises :class:`bcg.errors.StaleTensorError`.
4. What a forward builds and keeps while a lazy runner lays its pool out stays outside the pool.

Each test can fail on a bcg that gets these wrong: the first kind with an illegal address
(which poisons the CUDA context: run such a bcg one test per process).
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable

import pytest
import torch

import bcg

from .threads import run_in_threads

pytestmark = pytest.mark.cuda

N = 2048


def _clear_cublas() -> None:
    torch._C._cuda_clearCublasWorkspaces()  # what Inductor's CUDA graph trees do around recordings


def _model() -> tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor], torch.Tensor]:
    """``fwd(a)``: a matmul, a breakpoint, a matmul; and its eager twin; and the weight."""
    w = torch.randn(N, N, device="cuda") / N**0.5

    @bcg.breakpoint(mutates="h")
    def touch(h: torch.Tensor) -> None:
        h.mul_(1.0)

    def fwd(a: torch.Tensor) -> torch.Tensor:
        h = a @ w
        touch(h)
        return (h @ w).tanh()

    def eager(a: torch.Tensor) -> torch.Tensor:
        return ((a @ w) @ w).tanh()

    return fwd, eager, w


def _fill_memory(count: int = 96) -> list[torch.Tensor]:
    """New 4 MiB tensors holding a known value: they take whatever memory went back."""
    return [torch.full((1 << 20,), float(i), device="cuda") for i in range(count)]


def _assert_untouched(blocks: list[torch.Tensor]) -> None:
    torch.cuda.synchronize()
    for i, t in enumerate(blocks):
        assert bool((t == float(i)).all()), f"tensor {i} allocated after the capture was overwritten"


_INDUCTOR: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}


def _inductor(w: torch.Tensor, calls: int = 4, rows: int = 512) -> None:
    """Inductor's own CUDA graphs (cudagraph trees), recorded and replayed."""
    from torch.utils._triton import has_triton

    if not has_triton():
        pytest.skip("torch.compile(mode='reduce-overhead') needs Triton")
    w2 = w.clone()
    f = torch.compile(lambda a: (a @ w2).relu() @ w2, mode="reduce-overhead")
    for _ in range(calls):
        x = torch.randn(rows, N, device="cuda")
        out = f(x)
        torch.testing.assert_close(out, ((x @ w2).relu() @ w2), rtol=2e-2, atol=2e-2)
    torch.cuda.synchronize()


def _torch_graph_between_clears(w: torch.Tensor) -> None:
    _clear_cublas()
    a = torch.randn(256, N, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        a @ w  # warm up
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=side):
        b = a @ w
    g.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(b, a @ w)
    _clear_cublas()
    del g


def _clear_and_empty(w: torch.Tensor) -> None:
    _clear_cublas()
    torch.cuda.empty_cache()


def _sibling_reset(w: torch.Tensor) -> None:
    fwd, _, _ = _model()
    sibling = bcg.make_graph(fwd, torch.randn(512, N, device="cuda"))
    sibling.reset()
    torch.cuda.empty_cache()


def _empty_cache(w: torch.Tensor) -> None:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


OTHERS = {
    "inductor": _inductor,
    "torch-graph-between-clears": _torch_graph_between_clears,
    "clear-and-empty-cache": _clear_and_empty,
    "sibling-reset": _sibling_reset,
    "empty-cache": _empty_cache,
}


@pytest.mark.parametrize("order", ["bcg-first", "other-first"])
@pytest.mark.parametrize("other", sorted(OTHERS))
def test_a_graph_survives_what_others_do_to_workspaces_and_the_cache(other: str, order: str) -> None:
    """The repro of the lifetime issue: a bcg graph, then (or before it) whatever else runs in a
    server process, then new allocations that take any memory that went back; the graph
    must stay right and write nothing outside its own memory."""
    torch.manual_seed(0)
    _clear_cublas()  # a fresh start: the workspace a warm-up on the capture stream makes is new
    fwd, eager, w = _model()
    x = torch.randn(512, N, device="cuda")
    act = OTHERS[other]
    if order == "other-first":
        act(w)
    g = bcg.make_graph(fwd, x)
    torch.testing.assert_close(g.replay(), eager(x))
    act(w)
    if other == "inductor":
        _inductor(w, calls=2, rows=256)  # recordings after the graph too (a new shape)
    blocks = _fill_memory()
    for _ in range(3):
        x.copy_(torch.randn(512, N, device="cuda"))
        out = g.replay()
        torch.testing.assert_close(out, eager(x))
    _assert_untouched(blocks)
    g.reset()


def test_graphs_captured_on_one_stream_do_not_share_a_workspace() -> None:
    """Two graphs replayed at once on two streams (the pytorch#193402 class): each has its own
    cuBLAS workspace, so both are right. Long, thin matmuls make cuBLAS split K through it."""
    torch.manual_seed(1)

    def model() -> tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]:
        w1 = torch.randn(16384, 256, device="cuda") / 128
        w2 = torch.randn(256, 16384, device="cuda") / 16

        @bcg.breakpoint(mutates="h")
        def touch(h: torch.Tensor) -> None:
            h.mul_(1.0)

        def fwd(a: torch.Tensor) -> torch.Tensor:
            h = a @ w1
            touch(h)
            return (h @ w2) @ w1

        return fwd, lambda a: ((a @ w1) @ w2) @ w1

    (fwd_a, eager_a), (fwd_b, eager_b) = model(), model()
    xa, xb = torch.randn(64, 16384, device="cuda"), torch.randn(64, 16384, device="cuda")
    ga, gb = bcg.make_graph(fwd_a, xa), bcg.make_graph(fwd_b, xb)
    sa, sb = torch.cuda.Stream(), torch.cuda.Stream()
    for _ in range(20):
        xa.copy_(torch.randn(64, 16384, device="cuda"))
        xb.copy_(torch.randn(64, 16384, device="cuda"))
        sa.wait_stream(torch.cuda.current_stream())
        sb.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(sa):
            oa = ga.replay()
        with torch.cuda.stream(sb):
            ob = gb.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(oa, eager_a(xa))
        torch.testing.assert_close(ob, eager_b(xb))
    ga.reset()
    gb.reset()


# -- 2. threads ---------------------------------------------------------------------------------------


def _thread_model(seed: int) -> tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor], torch.Tensor]:
    """A forward with many small kernels (captures take a while) and a breakpoint."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    ws = [torch.randn(256, 256, device="cuda", generator=gen) / 16 for _ in range(4)]

    @bcg.breakpoint(mutates="h")
    def scale(h: torch.Tensor) -> None:
        h.mul_(float(bcg.live({"s": 1.0})["s"]))

    def body(a: torch.Tensor, bp: Callable[[torch.Tensor], None]) -> torch.Tensor:
        h = a
        for i in range(40):
            h = torch.tanh(h @ ws[i % 4]) + 0.5 * h
            if i == 20:
                bp(h)
        return h

    def fwd(a: torch.Tensor) -> torch.Tensor:
        return body(a, scale)

    def eager(a: torch.Tensor, s: float) -> torch.Tensor:
        return body(a, lambda h: h.mul_(s))

    return fwd, eager, torch.randn(64, 256, device="cuda", generator=gen)


def _keyed_model(seed: int) -> tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor], torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(256, 256, device="cuda", generator=gen) / 16

    @bcg.breakpoint(mutates="h", key=lambda live: live["n"])
    def head(h: torch.Tensor) -> None:
        n = bcg.live()["n"]
        h[:n].mul_(2.0)

    def fwd(a: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(a @ w)
        head(h)
        return h @ w

    def eager(a: torch.Tensor, n: int) -> torch.Tensor:
        h = torch.tanh(a @ w)
        h[:n].mul_(2.0)
        return h @ w

    return fwd, eager, torch.randn(64, 256, device="cuda", generator=gen)


def _one_round(kind: str, seed: int, mode: str, stream: torch.cuda.Stream) -> Callable[[], None]:
    """Build (capture) one graph, runner or keyed graph, replay it on fresh inputs and compare;
    return what to drop afterwards (the caller drops it, maybe while others capture).

    Random inputs come from the thread's own generator: torch forbids drawing from the default
    CUDA generator on one thread while another captures (the generator is in capture mode)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", generator=gen)

    if kind == "runner":
        fwd, eager, x = _thread_model(seed)
        runner = bcg.GraphRunner(fwd, [32, 64], example_inputs=(x,), capture_error_mode=mode,
                                 progress=False, live={"s": 1.0}, stream=stream)
        runner.capture()
        for T in (24, 64):
            a = randn(T, 256)
            got = runner(a, live={"s": 0.5}).clone()
            pad = torch.zeros(32 if T <= 32 else 64, 256, device="cuda")
            pad[:T] = a
            torch.testing.assert_close(got, eager(pad, 0.5)[:T], rtol=1e-4, atol=1e-4,
                                       msg=lambda m: f"runner round {seed}, T={T}: {m}")
        holder: object = runner
    elif kind == "keyed":
        fwd, eager, x = _keyed_model(seed)
        g = bcg.make_graph(fwd, x, live={"n": 8}, stream=stream, capture_error_mode=mode,
                           variants=bcg.VariantPolicy(max_variants=2, window=1000))
        for n in (8, 16, 24, 8, 32, 16):  # captures variants and evicts them (two kept)
            x.copy_(randn(64, 256))
            torch.testing.assert_close(g.replay(live={"n": n}).clone(), eager(x, n), rtol=1e-4, atol=1e-4,
                                       msg=lambda m: f"keyed round {seed}, n={n}: {g.stats().keyed} {m}")
        holder = g
    else:
        fwd, eager, x = _thread_model(seed)
        g = bcg.make_graph(fwd, x, live={"s": 1.0}, stream=stream, capture_error_mode=mode)
        for s in (0.5, 2.0):
            x.copy_(randn(64, 256))
            torch.testing.assert_close(g.replay(live={"s": s}).clone(), eager(x, s), rtol=1e-4, atol=1e-4,
                                       msg=lambda m: f"{kind} round {seed}, s={s}: {m}")
        if kind == "cycle":
            g.cycle = g  # type: ignore[attr-defined] - freed by the cycle collector, not by reference counts
        holder = g
    torch.cuda.current_stream().synchronize()  # its own stream: a device-wide sync is refused while any stream captures
    box = [holder]

    def drop() -> None:
        box.clear()
        if kind == "cycle":
            gc.collect()

    return drop


@pytest.mark.parametrize("mode", ["thread_local", "global"])
def test_graphs_dropped_on_one_thread_never_break_another_threads_capture(mode: str) -> None:
    """Threads build, replay, check and drop graphs, runners, keyed graphs (with evictions) and
    graphs in reference cycles, over and over; the drops land while other threads capture.

    As docs/constraints.md says: in ``"thread_local"`` mode the threads allocate and synchronize
    their own streams freely (a device-wide synchronize is refused while any stream captures,
    whatever the mode); in ``"global"`` mode they do that only outside other threads'
    captures (here: under one lock around each build-and-check), but drop anywhere."""
    kinds = ["graph", "runner", "keyed", "cycle"]
    user_lock = threading.Lock() if mode == "global" else None
    start = threading.Barrier(len(kinds))

    def work(k: int) -> None:
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            start.wait()
            for i in range(12):
                kind = kinds[(k + i) % len(kinds)]
                if user_lock is not None:
                    with user_lock:
                        drop = _one_round(kind, 100 * k + i, mode, stream)
                else:
                    drop = _one_round(kind, 100 * k + i, mode, stream)
                drop()  # outside the lock: while another thread captures

    errors = run_in_threads(work, range(len(kinds)))
    assert not errors, errors
    assert gc.isenabled()
    torch.cuda.synchronize()


def test_work_on_any_torch_stream_is_never_recorded_into_a_bcg_capture() -> None:
    """While one thread captures on bcg's capture stream, another runs work on 64 new
    ``torch.cuda.Stream()`` s (torch hands out 32 pooled streams round-robin): every one of them
    runs its work, none is capturing, and the capture stays clean."""
    x = torch.randn(1024, device="cuda")
    w = torch.randn(1024, device="cuda")
    capturing, done = threading.Event(), threading.Event()

    @bcg.breakpoint(mutates="h")
    def bump(h: torch.Tensor) -> None:
        h.add_(1.0)

    def capture() -> None:
        g = bcg.BreakableGraph()
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            with bcg.capture(g, capture_error_mode="thread_local"):
                h = x * w
                capturing.set()
                assert done.wait(60)
                bump(h)
                y = h * 2
            for _ in range(2):
                x.copy_(torch.randn(1024, device="cuda"))
                g.replay()
                torch.testing.assert_close(y, (x * w + 1) * 2)
        torch.cuda.current_stream().synchronize()

    def other() -> None:
        assert capturing.wait(60)
        try:
            for _ in range(64):
                s = torch.cuda.Stream()
                with torch.cuda.stream(s):
                    assert not torch.cuda.is_current_stream_capturing(), "a torch stream is bcg's capture stream"
                    a = torch.arange(256, device="cuda", dtype=torch.float32)  # (the default generator
                    b = a * 3  # is in capture mode: no randn here)
                    s.synchronize()
                    torch.testing.assert_close(b.cpu(), a.cpu() * 3)
        finally:
            done.set()

    errors = run_in_threads(lambda f: f(), [capture, other])
    assert not errors, errors


# -- 3. replaced tensors --------------------------------------------------------------------------------


def _weight_graph(guards: bool) -> tuple[bcg.BreakableGraph, dict[str, torch.Tensor], torch.Tensor]:
    weights = {"w": torch.randn(N, N, device="cuda") / N**0.5}

    @bcg.breakpoint(mutates="h")
    def touch(h: torch.Tensor) -> None:
        h.add_(1.0)

    def fwd(a: torch.Tensor) -> torch.Tensor:
        h = a @ weights["w"]
        touch(h)
        return h @ weights["w"]

    x = torch.randn(256, N, device="cuda")
    return bcg.make_graph(fwd, x, debug=bcg.Debug(guards=guards)), weights, x


def _block_state(ptr: int) -> str | None:
    """The caching allocator's state of the block at ``ptr`` (None: in no segment any more)."""
    for seg in torch.cuda.memory_snapshot():
        address = int(seg["address"])
        for block in seg["blocks"]:
            if address == ptr:
                return str(block["state"])
            address += int(block["size"])
    return None


def _expected(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x @ w + 1.0) @ w


@pytest.mark.parametrize("guards", [False, True])
def test_a_weight_replaced_in_place_is_read_and_a_rebound_one_is_refused(guards: bool) -> None:
    g, weights, x = _weight_graph(guards)
    torch.testing.assert_close(g.replay(), _expected(x, weights["w"]))
    weights["w"].copy_(torch.randn(N, N, device="cuda") / N**0.5)  # in place: the graph follows
    x.copy_(torch.randn(256, N, device="cuda"))
    torch.testing.assert_close(g.replay(), _expected(x, weights["w"]))

    old_ptr = weights["w"].data_ptr()
    weights["w"] = torch.randn(N, N, device="cuda") / N**0.5  # rebound: the old storage is dropped
    gc.collect()
    # the graph still holds the old weight: nothing it reads went back to the allocator
    assert _block_state(old_ptr) == "active_allocated"
    fresh = [torch.empty(N, N, device="cuda") for _ in range(4)]
    assert old_ptr not in [t.data_ptr() for t in fresh]
    with pytest.raises(bcg.ReplayError, match="replaced tensor") as err:
        g.replay()
    assert type(err.value).__name__ == "StaleTensorError"
    message = str(err.value)
    assert f"shape ({N}, {N})" in message and "torch.float32" in message and "aten.mm" in message
    assert "test_lifetime_cuda.py" in message and "copy_" in message and "reset()" in message
    del err  # (its traceback holds the old weight)
    with pytest.raises(bcg.ReplayError):  # refused every time, and nothing launched
        g.replay()
    g.reset()  # the old weight goes with the graph
    gc.collect()
    assert _block_state(old_ptr) != "active_allocated"


def test_a_graph_keeps_a_tensor_its_caller_dropped_and_reports_it() -> None:
    """A temporary the captured kernels read, dropped right after the capture (torch.cuda.graph
    would read freed memory): bcg keeps it, and says so instead of replaying silently."""

    def build() -> tuple[bcg.BreakableGraph, torch.Tensor]:
        bias = torch.randn(N, device="cuda")
        x = torch.randn(64, N, device="cuda")
        graph = bcg.BreakableGraph()
        x + bias  # warm up
        with bcg.capture(graph):
            y = x + bias
        return graph, y

    graph, _ = build()
    _fill_memory(8)
    with pytest.raises(bcg.ReplayError, match="replaced tensor"):
        graph.replay()
    graph.reset()


# -- legal torch.cuda.graph code that replaces nothing ----------------------------------------------


def test_a_recapture_whose_first_op_overwrites_a_dropped_tensor_replays() -> None:
    """torch's reset-and-recapture: the second capture's first op fills the first capture's
    output, then the name moves on. Nothing is replaced: every replay fills it first."""
    a = torch.randn(1000, device="cuda")
    b = a + 1  # warm-up
    torch.empty_like(a).fill_(2.0)
    g = bcg.BreakableGraph()
    with bcg.capture(g):
        b = a
        for _ in range(10):
            b = b + 1
    a.copy_(torch.randn_like(a))
    g.replay()
    torch.testing.assert_close(b, a + 10)
    g.reset()
    with bcg.capture(g):
        b.fill_(2.0)  # b: the first capture's output, in the reset graph's pool
        for _ in range(10):
            b = b + 2
    gc.collect()
    b.zero_()
    g.replay()
    assert torch.equal(b, torch.full_like(a, 22.0))
    assert g.stats().held_storages == 1  # the filled tensor: held (replays write it), never refused
    g.reset()


def _temps(t: torch.Tensor, val: float) -> torch.Tensor:
    """torch's chained-graph test body: temporaries a later graph may reuse."""
    return (t.clone() + val) + (t.clone() + val)


@pytest.mark.parametrize("producer", ["bcg", "torch"])
@pytest.mark.parametrize("share", ["none", "pool()", "graph_pool_handle()"])
@pytest.mark.parametrize("breakpoint", [False, True], ids=["plain-then-reset", "breakpoint-then-freed"])
def test_a_graph_reads_another_graphs_output_while_that_graph_lives(producer: str, share: str,
                                                                      breakpoint: bool) -> None:
    """torch's two-successive-graphs pattern: g1 reads g0's output, and the user's name moves on
    to g1's output, so the graphs alone hold g0's. g0's replay rewrites it: g0 then g1 replay
    as torch.cuda.graph's do. Once g0 is reset (or freed), g1's next replay names g0 and
    launches nothing."""
    a = torch.randn(1000, device="cuda")
    _temps(a, 1.0)  # warm-up

    @bcg.breakpoint
    def scale(t: torch.Tensor) -> torch.Tensor:
        return t * 0.5

    def second(t: torch.Tensor) -> torch.Tensor:
        for i in range(5):
            t = _temps(t, 1.0)
            if breakpoint and i == 2:
                t = scale(t)
        return t

    handle = bcg.graph_pool_handle() if share == "graph_pool_handle()" else None
    g0: bcg.BreakableGraph | torch.cuda.CUDAGraph
    if producer == "torch":
        g0 = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g0, pool=handle):
            b = a.clone()
            for _ in range(5):
                b = _temps(b, 1.0)
    else:
        g0 = bcg.BreakableGraph()
        with bcg.capture(g0, pool=handle):
            b = a.clone()
            for _ in range(5):
                b = _temps(b, 1.0)
    g1 = bcg.BreakableGraph()
    with bcg.capture(g1, pool=g0.pool() if share == "pool()" else handle):
        b = second(b)  # g0's output: the graphs' alone from here on
    gc.collect()
    for _ in range(3):
        a.copy_(torch.randn_like(a))
        expected = a.clone()
        for _ in range(5):
            expected = _temps(expected, 1.0)
        expected = second(expected)
        g0.replay()
        g1.replay()
        assert torch.equal(b, expected)

    if breakpoint:
        del g0
        gc.collect()
    else:
        g0.reset()
    name = "test_lifetime_cuda.py" if producer == "bcg" else "torch.cuda.CUDAGraph"
    b.zero_()
    with pytest.raises(bcg.errors.StaleTensorError, match=f"(?s)reset or freed \\(.*{name}"):
        g1.replay()
    torch.cuda.synchronize()
    assert not b.any()  # nothing was launched
    g1.reset()


# -- 4. State a forward builds on its first run at a size never lives in a lazy runner's pool -------

CACHE_HIDDEN = 64


def _table(rows: int, scale: float) -> torch.Tensor:
    """A rotary-like table ``[rows, CACHE_HIDDEN]``."""
    pos = torch.arange(rows, device="cuda", dtype=torch.float32)[:, None]
    freq = torch.exp(-9.2 * torch.arange(CACHE_HIDDEN, device="cuda", dtype=torch.float32) / CACHE_HIDDEN)
    return torch.cos(pos * freq * scale)


@bcg.breakpoint(mutates=())
def _add_rows(h: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    return h + table[: h.shape[0]]  # the whole table handed over, sliced eagerly at every replay


class _GrowingCache(torch.nn.Module):
    """Builds its cache at the first call and a new, longer one when a call is longer (as rotary
    caches do); read by a captured op, or handed whole to a breakpoint."""

    def __init__(self, reader: str) -> None:
        super().__init__()
        self.reader, self.scale = reader, 1.0
        self.cache: torch.Tensor | None = None

    def table(self, n: int) -> torch.Tensor:
        if self.cache is None or self.cache.shape[0] < n:
            self.cache = _table(n, self.scale)
        return self.cache

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        if self.reader == "segment":
            return torch.tanh(x * 2.0 + self.table(n)[:n])
        return torch.tanh(_add_rows(x * 2.0, self.table(n)))


def _allocated(ptr: int) -> bool:
    from bcg.core.pool import blocks

    return any(address <= ptr < address + size and in_use for address, size, in_use in blocks())


@pytest.mark.parametrize("reader", ["segment", "breakpoint"])
def test_a_cache_built_while_a_lazy_runner_lays_its_pool_out_stays_outside_the_pool(reader: str) -> None:
    """A lazy runner's second capture runs ``forward`` at the largest bucket to lay its pool out;
    the cache that run grows must not land in the pool (whose tensors a graph holds through
    non-owning aliases, and whose freed blocks later captures reuse). Replaced afterwards (a
    longer call, or new values), then another bucket captured lazily: the earlier buckets'
    replays raise StaleTensorError or equal eager, and the old cache's memory is not reused."""
    from bcg.core.pool import PoolMembership
    from bcg.errors import StaleTensorError

    gen = torch.Generator().manual_seed(0)
    model = _GrowingCache(reader)
    runner = bcg.GraphRunner(model, [16, 32, 64], example_inputs=(torch.randn(8, CACHE_HIDDEN, device="cuda"),),
                             progress=False, lazy=True)

    def check(T: int) -> None:
        x = torch.randn(T, CACHE_HIDDEN, generator=gen).cuda()
        try:
            y = runner(x).clone()
        except StaleTensorError:
            return
        with torch.no_grad():
            torch.testing.assert_close(y, model(x), rtol=1e-5, atol=1e-5)

    for T in (12, 30):  # each eager, then its bucket captured; the second lays the pool out at 64
        check(T)
    assert set(runner.captured_buckets) == {16, 32}
    assert model.cache is not None and model.cache.shape[0] == 64
    assert not PoolMembership(runner.pool(), torch.cuda.current_device()).contains(model.cache)
    old = model.cache.untyped_storage().data_ptr()
    if reader == "segment":
        model.scale = 3.0
        model.cache = _table(64, model.scale)  # new values
    else:
        check(100)  # above the ladder: eager, and the cache grows (same values in the rows read)
        assert model.cache.shape[0] == 100
    check(60)  # bucket 64: eager, then captured into the same pool
    assert 64 in runner.captured_buckets
    for T in (13, 16, 29, 32):
        check(T)
    assert _allocated(old), "the replaced cache's memory went back while graphs still read it"
    runner.reset()
