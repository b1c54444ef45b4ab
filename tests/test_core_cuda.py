"""Core behaviour on a GPU: capture, replay, bridges, pools, RNG, side streams, errors, memory."""

from __future__ import annotations

import gc
import random

import pytest
import torch

import bcg
from bcg.capture import capture_into
from bcg.core import cudart
from bcg.core.plan import BreakpointStep
from bcg.core.session import CaptureOptions

from .models import TinyLlama, positions_for, random_lengths

pytestmark = pytest.mark.cuda

def _capture(fn, *args, live=None, **kw):  # noqa: ANN001, ANN202
    graph = bcg.BreakableGraph()
    with bcg.capture(graph, live=live, **kw):
        out = fn(*args)
    return graph, out


def _capture_with(fn, *args, **options):  # noqa: ANN001, ANN202
    """A capture with options only make_graph and the runner pass (after_breakpoint, compute_outputs)."""
    graph = bcg.BreakableGraph()
    out = capture_into(graph, lambda: fn(*args), CaptureOptions(**options))
    return graph, out


def _breakpoint_steps(graph: bcg.BreakableGraph) -> list[BreakpointStep]:
    return [s for s in graph.plan if isinstance(s, BreakpointStep)]


def _assert_clean(
    stream: torch.cuda.Stream | None = None, pool: tuple[int, int] | None = None, capture: bool = True
) -> None:
    """No stream capturing, and the next eager op, random op and capture (into ``pool``) work."""
    assert not torch.cuda.is_current_stream_capturing()
    if stream is not None:
        assert cudart.capture_status(int(stream.cuda_stream)) == "none"
    x = torch.randn(64, device="cuda")
    torch.testing.assert_close((x * 2).sum().item(), x.sum().item() * 2, rtol=1e-4, atol=1e-4)
    static = torch.randn(32, device="cuda")
    torch.nn.functional.dropout(static, 0.5)
    if not capture:
        return

    @bcg.breakpoint
    def double(t: torch.Tensor) -> None:
        t.mul_(2)

    def fn(t: torch.Tensor) -> torch.Tensor:
        u = t + 1
        double(u)
        return u - 1

    fn(static.clone())  # warm up: lazily loaded kernels must not load inside a segment
    graph, out = _capture(fn, static, pool=pool, stream=stream)
    static.copy_(torch.randn(32, device="cuda"))
    graph.replay()
    torch.testing.assert_close(out, (static + 1) * 2 - 1, rtol=0, atol=0)
    graph.reset()


# -- the Llama block: bit-identical to eager over many request-length sets ----------------------


@pytest.mark.parametrize("returning", [False, True])
def test_llama_block_replay_is_bit_identical_to_eager(returning: bool) -> None:
    torch.manual_seed(0)
    model = TinyLlama(layers=3, hidden=256, heads=8, kv_heads=2, intermediate=512, returning=returning)
    T = 96
    gen = torch.Generator().manual_seed(123)
    x = torch.randn(T, 256, device="cuda", dtype=torch.bfloat16)
    lengths = random_lengths(T, 4, gen)
    pos = positions_for(lengths, T, "cuda")
    with bcg.live_scope({"lengths": lengths}):
        model(x, pos)  # warm up
    graph, out = _capture(model, x, pos, live={"lengths": lengths})
    stats = graph.stats()
    assert stats.breakpoints == 3 and stats.segments == 4
    assert all(k > 0 for k in stats.nodes)
    assert stats.pool_bytes > 0
    assert (stats.bridge_bytes > 0) == returning
    for trial in range(50):
        requests = 1 + trial % 6
        lengths = random_lengths(T, requests, gen)
        x.copy_(torch.randn(T, 256, device="cuda", dtype=torch.bfloat16))
        pos.copy_(positions_for(lengths, T, "cuda"))
        graph.replay(live={"lengths": lengths})
        with bcg.live_scope({"lengths": lengths}):
            expected = model(x, pos)
        assert torch.equal(out, expected), f"trial {trial} lengths {lengths}"
    graph.reset()


def test_capture_output_is_valid_right_after_capture() -> None:
    model = TinyLlama(layers=2, hidden=128, heads=4, kv_heads=2, intermediate=256)
    T = 40
    x = torch.randn(T, 128, device="cuda", dtype=torch.bfloat16)
    lengths = [10, 30]
    pos = positions_for(lengths, T, "cuda")
    with bcg.live_scope({"lengths": lengths}):
        expected = model(x, pos)
    graph, out = _capture(model, x, pos, live={"lengths": lengths})
    torch.cuda.synchronize()
    assert torch.equal(out, expected)


# -- bridges ------------------------------------------------------------------------------------


def test_returned_tensor_bridges_are_owned_and_refreshed() -> None:
    @bcg.breakpoint
    def split_scale(t: torch.Tensor) -> tuple[torch.Tensor, dict]:
        s = bcg.live()
        return t * s, {"neg": -t, "scale": 1}

    x = torch.randn(16, 8, device="cuda")

    def fn(a: torch.Tensor) -> torch.Tensor:
        h = a.sin()
        scaled, extra = split_scale(h)
        return scaled + extra["neg"] * extra["scale"]

    graph, out = _capture(fn, x, live=2.0)
    steps = _breakpoint_steps(graph)
    assert len(steps) == 1 and len(steps[0].bridges.tensors()) == 2
    assert graph.stats().bridge_bytes == 2 * 16 * 8 * 4
    for scale in (3.0, -1.5, 0.25):
        x.copy_(torch.randn(16, 8, device="cuda"))
        graph.replay(live=scale)
        torch.testing.assert_close(out, x.sin() * scale - x.sin(), rtol=0, atol=0)


def test_replay_raises_when_a_breakpoint_changes_its_output_contract() -> None:
    @bcg.breakpoint
    def shaped(t: torch.Tensor) -> torch.Tensor:
        return t[: bcg.live()] * 2

    x = torch.randn(8, device="cuda")
    graph, out = _capture(lambda a: shaped(a + 1) - 1, x, live=8)
    graph.replay(live=8)
    with pytest.raises(bcg.errors.BreakpointOutputMismatch, match="shapes and dtypes are fixed"):
        graph.replay(live=4)
    graph.replay(live=8)  # still replayable
    torch.testing.assert_close(out, (x + 1) * 2 - 1, rtol=0, atol=0)


def test_bridges_survive_the_caller_dropping_them() -> None:
    """The weak-reference bug class: a later capture must not break a bridge the caller dropped.

    The caller drops the bridge right away (``b`` is local to ``fn``). A second graph is then
    captured into the same pool, on the same capture stream (the allocator reuses a pool's
    free blocks per stream), allocating and NaN-filling many tensors of the bridge's size:
    the bridge is held through a non-owning alias, so the contract lets later captures reuse
    its memory (a replay rewrites it before reading it; graphs sharing a pool replay one at a
    time): the first graph's results are what is promised, with the second replayed before
    each of its replays.
    """

    @bcg.breakpoint
    def produce(t: torch.Tensor) -> torch.Tensor:
        return t.cos()  # an eager allocation, outside any pool

    x = torch.randn(1024, device="cuda")

    def fn(a: torch.Tensor) -> torch.Tensor:
        b = produce(a)
        return (b * 2).sum(0, keepdim=True)

    graph, out = _capture(fn, x)
    (bridge,) = _breakpoint_steps(graph)[0].bridges.tensors()

    def scribble() -> list[torch.Tensor]:
        return [torch.full((1024,), float("nan"), device="cuda") for _ in range(64)]

    scribble()  # warm up: the fill kernel must not load lazily inside the capture
    other = bcg.BreakableGraph()
    with bcg.capture(other, pool=graph.pool()):
        junk = scribble()  # NaN-filled at capture (each segment runs once right away)
    assert other.pool() == graph.pool()
    for _ in range(4):
        other.replay()  # NaN into its tensors: they may share graph's temporaries and its bridge
        x.copy_(torch.randn(1024, device="cuda"))
        graph.replay()
        torch.testing.assert_close(out, (x.cos() * 2).sum(0, keepdim=True), rtol=0, atol=0)
        assert torch.equal(bridge, x.cos())
    del junk
    other.reset()


# -- shared pools: graphs captured one after the other, replayed in random order ------------------


def test_graphs_sharing_a_pool_replay_in_random_order() -> None:
    pool = bcg.graph_pool_handle()

    @bcg.breakpoint
    def mix(a: torch.Tensor) -> torch.Tensor:
        return a.flip(0) * bcg.live()

    def make(width: int):  # noqa: ANN202
        x = torch.randn(256, width, device="cuda")

        def fn(t: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(t * 0.5)
            m = mix(h)
            g = torch.empty_like(h)
            mix2 = m + torch.sigmoid(h)
            g.copy_(mix2)
            return g.cumsum(0)

        graph = bcg.BreakableGraph()
        with bcg.capture(graph, pool=pool, live=1.0):
            out = fn(x)

        def reference(s: float) -> torch.Tensor:
            h = torch.tanh(x * 0.5)
            return (h.flip(0) * s + torch.sigmoid(h)).cumsum(0)

        return graph, x, out, reference

    graphs = [make(w) for w in (64, 32, 64)]
    assert all(g.pool() == pool for g, *_ in graphs)
    rng = random.Random(0)
    for _ in range(30):
        graph, x, out, reference = graphs[rng.randrange(len(graphs))]
        x.copy_(torch.randn_like(x))
        s = rng.uniform(-2, 2)
        graph.replay(live=s)
        torch.testing.assert_close(out, reference(s), rtol=0, atol=0)


# -- RNG ---------------------------------------------------------------------------------------


def test_rng_in_segments_gives_fresh_numbers_each_replay() -> None:
    @bcg.breakpoint
    def noop(t: torch.Tensor) -> None:
        t.add_(0)

    x = torch.ones(4096, device="cuda")

    def fn(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        d1 = torch.nn.functional.dropout(a, p=0.5)
        noop(d1)
        return d1, torch.rand_like(a)

    graph, (d, r) = _capture(fn, x)
    assert any(s.uses_rng for s in graph.forms[0].segments)
    gen = torch.cuda.default_generators[torch.cuda.current_device()]
    seen_d, seen_r = [], []
    for _ in range(4):
        before = gen.get_offset()
        graph.replay()
        assert gen.get_offset() > before
        seen_d.append(d.clone())
        seen_r.append(r.clone())
    for i in range(len(seen_d)):
        keep = (seen_d[i] != 0).float().mean().item()
        assert 0.4 < keep < 0.6
        for j in range(i):
            assert not torch.equal(seen_d[i], seen_d[j])
            assert not torch.equal(seen_r[i], seen_r[j])


# -- side streams ------------------------------------------------------------------------------


def test_unjoined_side_stream_is_joined_at_breakpoints_and_end() -> None:
    side = torch.cuda.Stream()

    @bcg.breakpoint
    def read(t: torch.Tensor) -> torch.Tensor:
        return t * 1.0

    x = torch.randn(1 << 20, device="cuda")

    def fn(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            b = a.exp()
            for _ in range(20):  # long enough to lose a race if unordered
                b = b * 1.0001
        c = read(b)  # side stream never joined: bcg joins it before the break
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            d = c.sqrt() + 1  # forked again, never joined before the end of capture
        return c, d

    graph, (c, d) = _capture(fn, x)
    for _ in range(5):
        x.copy_(torch.rand_like(x))
        graph.replay()
        b = x.exp()
        for _ in range(20):
            b = b * 1.0001
        torch.testing.assert_close(c, b, rtol=0, atol=0)
        torch.testing.assert_close(d, b.sqrt() + 1, rtol=0, atol=0)
    _assert_clean()


# -- structure ------------------------------------------------------------------------------------


def test_consecutive_breakpoints_and_graph_breaks_launch_no_empty_graph() -> None:
    @bcg.breakpoint
    def bump(t: torch.Tensor) -> None:
        t.add_(bcg.live())

    x = torch.randn(8, device="cuda")

    def fn(a: torch.Tensor) -> torch.Tensor:
        h = a * 2
        bump(h)
        bump(h)
        bcg.graph_break()
        bcg.graph_break()
        h2 = h + 1
        bcg.graph_break()
        return h2 * 3

    graph, out = _capture(fn, x, live=1.0)
    kinds = [type(s).__name__ for s in graph.plan]
    assert kinds == ["SegmentStep", "BreakpointStep", "BreakpointStep", "SegmentStep", "SegmentStep"]
    graph.replay(live=0.5)
    h = x * 2
    h.add_(0.5)
    h.add_(0.5)
    torch.testing.assert_close(out, (h + 1) * 3, rtol=0, atol=0)


def test_capture_stub_and_disabled_breakpoints() -> None:
    @bcg.breakpoint(capture_stub=lambda t: torch.zeros_like(t))
    def stubbed(t: torch.Tensor) -> torch.Tensor:
        return t + bcg.live()

    @bcg.breakpoint(enabled=False)
    def inline(t: torch.Tensor) -> torch.Tensor:
        return t * 3

    x = torch.randn(8, device="cuda")
    graph, out = _capture(lambda a: inline(stubbed(a)) - 1, x, live=None)
    assert graph.stats().breakpoints == 1
    graph.replay(live=2.0)
    torch.testing.assert_close(out, (x + 2.0) * 3 - 1, rtol=0, atol=0)


def test_after_breakpoint_hook_is_captured_into_the_next_segment() -> None:
    @bcg.breakpoint(mutates=("out",))
    def partial_write(a: torch.Tensor, out: torch.Tensor) -> None:
        n = bcg.live()
        out[:n].copy_(a[:n])  # rows past n left as they were

    mask = torch.ones(64, 1, device="cuda", dtype=torch.bool)
    crossed: list[list[torch.Tensor]] = []

    def sanitize(tensors: list[torch.Tensor]) -> None:
        crossed.append(tensors)
        for t in tensors:
            t.masked_fill_(~mask, 0)

    x = torch.randn(64, 4, device="cuda")

    def fn(a: torch.Tensor) -> torch.Tensor:
        out = torch.full_like(a, float("nan"))
        partial_write(a * 2, out)
        return out + 1

    graph, y = _capture_with(fn, x, live=64, after_breakpoint=sanitize)
    assert len(crossed) == 1 and len(crossed[0]) == 1  # only the declared `out`
    for n in (64, 10, 1):
        mask.copy_((torch.arange(64, device="cuda") < n)[:, None])
        graph.replay(live=n)
        assert not torch.isnan(y).any()
        torch.testing.assert_close(y[:n], x[:n] * 2 + 1, rtol=0, atol=0)
        torch.testing.assert_close(y[n:], torch.ones_like(y[n:]), rtol=0, atol=0)


def test_node_group_nodes_are_skipped_and_run_again_across_segments_and_executors() -> None:
    """Work inside ``node_group`` blocks, in two segments: disabled, replays skip it; enabled
    again, they run it. The rest of the graph runs either way, with either executor."""
    @bcg.breakpoint
    def bump(t: torch.Tensor) -> None:
        t.add_(bcg.live())

    x = torch.randn(256, device="cuda")
    extra = torch.zeros(256, device="cuda")

    def fn(a: torch.Tensor) -> torch.Tensor:
        h = a * 2
        with bcg.core.session.node_group("extra"):
            extra.add_(1)  # a kernel
            extra[:8].zero_()  # a memset or a kernel: both can be disabled
        bump(h)
        with bcg.core.session.node_group("extra"):
            h.mul_(3)
        return h + 1

    graph, y = _capture(fn, x, live=0.0)
    for executor in ("python", "native") if bcg.core.native.available() else ("python",):
        graph.use_executor(executor)
        for enabled in (True, False, False, True, False, True):
            assert graph.set_enabled("extra", enabled)
            x.copy_(torch.randn(256, device="cuda"))
            live = float(random.randint(1, 9))
            before = extra.clone()
            graph.replay(live=live)
            h = x * 2 + live
            if enabled:
                torch.testing.assert_close(y, h * 3 + 1, rtol=0, atol=0)
                expected = before + 1
                expected[:8] = 0
                torch.testing.assert_close(extra, expected, rtol=0, atol=0)
            else:
                torch.testing.assert_close(y, h + 1, rtol=0, atol=0)
                torch.testing.assert_close(extra, before, rtol=0, atol=0)
    assert graph.set_enabled("no such group", False)  # an empty group is trivially off
    graph.reset()


@pytest.mark.parametrize("compute_outputs", [True, False])
def test_compute_outputs_runs_or_only_uploads_the_last_segment(compute_outputs: bool) -> None:
    """Segments before a breakpoint always run at capture (the breakpoint reads their results);
    the last one runs only with ``compute_outputs`` (else the outputs are filled by the first
    replay), and every replay after is exact either way."""
    x = torch.randn(1024, device="cuda")
    out = torch.full((1024,), float("nan"), device="cuda")  # outside the pool: never reused
    seen: list[float] = []

    @bcg.breakpoint
    def peek(t: torch.Tensor) -> None:
        seen.append(t.sum().item())  # a host read: what the segment before computed

    def fn(x: torch.Tensor) -> None:
        h = x * 2
        peek(h)
        out.copy_(h + 1)

    graph, _ = _capture_with(fn, x, compute_outputs=compute_outputs)
    torch.cuda.synchronize()
    assert seen == [pytest.approx((x * 2).sum().item(), rel=1e-5)]
    assert torch.isnan(out).all() != compute_outputs  # the last segment ran, or not
    for _ in range(2):
        x.copy_(torch.randn(1024, device="cuda"))
        graph.replay()
        torch.testing.assert_close(out, x * 2 + 1, rtol=0, atol=0)
    graph.reset()
    _assert_clean()


def test_a_skipped_group_between_dependent_kernels_keeps_their_order() -> None:
    """A skipped group replays as an executable without its nodes; the kernels around it stay
    ordered (each reads what the one before wrote: big enough that a lost edge races), and
    a segment that uses RNG (replayed through torch) disables the nodes instead."""
    n = 1 << 24
    a = torch.randn(n, device="cuda")
    extra = torch.zeros(n, device="cuda")

    @bcg.breakpoint
    def bump(t: torch.Tensor) -> None:
        t.add_(bcg.live())

    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x * 2
        with bcg.core.session.node_group("extra"):
            h.add_(1)
            extra.add_(1)
        h = h.sin() * 3  # reads h right after the group
        bump(h)
        noise = torch.rand(8, device="cuda")  # this segment uses RNG
        with bcg.core.session.node_group("extra"):
            h.add_(1)
        return h.cos(), noise

    graph, (y, noise) = _capture(fn, a, live=0.0)
    plain, rng = graph.forms[0].segments
    assert not plain.uses_rng and rng.uses_rng
    for executor in ("python", "native") if bcg.core.native.available() else ("python",):
        graph.use_executor(executor)
        for enabled in (False, True, False, False, True):
            assert graph.set_enabled("extra", enabled)
            assert (plain.exec_handle != int(plain.cuda_graph.raw_cuda_graph_exec())) == (not enabled)
            assert rng.exec_handle == int(rng.cuda_graph.raw_cuda_graph_exec())
            form = graph.forms[0]
            assert form.disabled == (frozenset() if enabled else frozenset({"extra"}))
            assert sum(len(s.trimmed) for s in form.segments) == 1  # built once, kept (the RNG segment builds none)
            a.copy_(torch.randn(n, device="cuda"))
            live = float(random.randint(1, 9))
            before = extra.clone()
            graph.replay(live=live)
            step = 1.0 if enabled else 0.0
            expected = (((a * 2 + step).sin() * 3) + live + step).cos()
            torch.testing.assert_close(y, expected)
            torch.testing.assert_close(extra, before + step, rtol=0, atol=0)
    first = noise.clone()
    graph.replay(live=1.0)
    assert not torch.equal(noise, first)  # the RNG segment still draws fresh numbers
    graph.reset()
    _assert_clean()


@pytest.mark.parametrize("refused", [False, True])
def test_nested_and_overlapping_groups_switch_node_by_node(refused: bool, monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    """Blocks nested in a block of the same label, or of another label: a node runs while none of
    its groups is skipped. In a trimmed executable, in a segment using RNG (disabled nodes), and,
    where CUDA refuses to build a trimmed executable, with its nodes disabled (logged)."""
    if refused:
        def refuse(*args: object, **kwargs: object) -> int:
            raise RuntimeError("cudaErrorNotSupported: refused for the test")

        monkeypatch.setattr(bcg.core.plan, "trimmed_exec", refuse)
    x = torch.randn(1024, device="cuda")
    a = torch.zeros(1024, device="cuda")
    b = torch.zeros(1024, device="cuda")

    @bcg.breakpoint
    def bump(t: torch.Tensor) -> None:
        t.add_(bcg.live())

    def body() -> None:
        with bcg.core.session.node_group("a"):
            a.add_(1)
            with bcg.core.session.node_group("a"):
                a.add_(10)
            with bcg.core.session.node_group("b"):
                b.add_(1)  # in both groups

    def fn(t: torch.Tensor) -> torch.Tensor:
        body()
        h = t * 2
        bump(h)
        torch.rand(4, device="cuda")  # the second segment uses RNG
        body()
        return h + 1

    graph, y = _capture(fn, x, live=0.0)
    assert [s.uses_rng for s in graph.forms[0].segments] == [False, True]
    with caplog.at_level("WARNING", logger="bcg"):
        for on_a, on_b in [(False, True), (True, False), (False, False), (True, True), (False, True)]:
            assert graph.set_enabled("a", on_a) and graph.set_enabled("b", on_b)
            da, db = a.clone(), b.clone()
            graph.replay(live=1.0)
            torch.testing.assert_close(y, x * 2 + 1.0 + 1, rtol=0, atol=0)  # h = x * 2, bumped by 1, + 1
            torch.testing.assert_close(a - da, torch.full_like(a, 22.0 if on_a else 0.0), rtol=0, atol=0)
            torch.testing.assert_close(b - db, torch.full_like(b, 2.0 if on_a and on_b else 0.0), rtol=0, atol=0)
    plain = graph.forms[0].segments[0]
    assert (plain.in_place is not None) == refused
    assert ("no executable without" in caplog.text) == refused
    graph.reset()


def test_a_node_group_spanning_a_breakpoint_or_recording_an_event_always_runs() -> None:
    @bcg.breakpoint
    def bp(t: torch.Tensor) -> None:
        t.add_(1)

    x = torch.randn(64, device="cuda")
    counter = torch.zeros((), device="cuda")

    def spanning(a: torch.Tensor) -> torch.Tensor:
        h = a + 0
        with bcg.core.session.node_group("s"):
            counter.add_(1)
            bp(h)  # the segment ends inside the block
        return h * 2

    event = torch.cuda.Event(external=True)  # outlives the graphs whose nodes record it

    def with_event(a: torch.Tensor) -> torch.Tensor:
        h = a + 0
        with bcg.core.session.node_group("s"):
            counter.add_(1)
            event.record()  # an event-record node
        return h * 2

    for fn in (spanning, with_event):
        graph, y = _capture(fn, x)
        assert not graph.set_enabled("s", False)  # refused: its nodes always run
        before = counter.item()
        graph.replay()
        torch.cuda.synchronize()
        assert counter.item() == before + 1
        graph.reset()


def test_a_node_group_with_side_stream_work_skips_only_its_own_nodes() -> None:
    """Side-stream work forked and joined inside the block is the block's: skipped with it.
    Side-stream work recorded before the block and joined inside it is not: bcg cannot
    tell the block's nodes apart, so the group always runs (never the earlier work)."""
    x = torch.randn(256, device="cuda")
    a = torch.zeros(256, device="cuda")
    b = torch.zeros(256, device="cuda")
    side = torch.cuda.Stream()

    def joined(t: torch.Tensor) -> torch.Tensor:
        h = t * 2
        with bcg.core.session.node_group("s"):
            main = torch.cuda.current_stream()
            side.wait_stream(main)
            with torch.cuda.stream(side):
                a.add_(1)
            main.wait_stream(side)
        return h + 1

    def earlier(t: torch.Tensor) -> torch.Tensor:
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            b.add_(1)  # before the block
        h = t * 2
        with bcg.core.session.node_group("s"):
            a.add_(1)
            main.wait_stream(side)  # joined inside it
        return h + 1

    for fn, can_skip in ((joined, True), (earlier, False)):
        graph, y = _capture(fn, x)
        assert graph.set_enabled("s", False) == can_skip
        da, db = a.clone(), b.clone()
        graph.replay()
        torch.testing.assert_close(y, x * 2 + 1, rtol=0, atol=0)
        torch.testing.assert_close(a - da, torch.full_like(a, 0.0 if can_skip else 1.0), rtol=0, atol=0)
        if fn is earlier:
            torch.testing.assert_close(b - db, torch.ones_like(b), rtol=0, atol=0)  # always runs
        graph.reset()


def test_stats_count_kernel_nodes_per_segment() -> None:
    @bcg.breakpoint
    def bp(t: torch.Tensor) -> None:
        pass

    x = torch.randn(8, device="cuda")

    def fn(a: torch.Tensor) -> torch.Tensor:
        h = a + 1
        h = h * 2
        bp(h)
        return h.exp()

    graph, _ = _capture(fn, x)
    stats = graph.stats()
    assert stats.segments == 2 and stats.breakpoints == 1
    assert stats.nodes == (2, 1)
    assert stats.capture_s > 0 and stats.pool_bytes > 0
    assert graph.forms[0].segments[0].graph_handle != 0 and graph.forms[0].segments[0].exec_handle != 0


# -- errors, each followed by a working capture ------------------------------------------------


def test_item_inside_a_segment_raises_host_sync_error_naming_the_line() -> None:
    graph = bcg.BreakableGraph()
    stream = torch.cuda.Stream()
    pool = bcg.graph_pool_handle()
    x = torch.randn(4, device="cuda")
    with pytest.raises(bcg.errors.HostSyncInCaptureError, match=r"test_core_cuda.py:\d+: .*\.item\(\)"):
        with bcg.capture(graph, stream=stream, pool=pool):
            y = x * 2
            y.sum().item()
    assert not graph.is_captured
    _assert_clean(stream, pool)  # the same stream and the same pool capture again


def test_pageable_host_copy_inside_a_segment_raises_host_sync_error() -> None:
    graph = bcg.BreakableGraph()
    stream = torch.cuda.Stream()
    x = torch.randn(4, device="cuda")
    host = torch.randn(4)  # pageable
    pool = bcg.graph_pool_handle()
    with pytest.raises(bcg.errors.HostSyncInCaptureError, match="segment"):
        with bcg.capture(graph, stream=stream, pool=pool):
            x.copy_(host)
    _assert_clean(stream, pool, capture=False)


def test_capture_after_a_refused_pageable_host_copy_works() -> None:
    stream = torch.cuda.Stream()
    pool = bcg.graph_pool_handle()
    x = torch.randn(4, device="cuda")
    with pytest.raises(bcg.errors.HostSyncInCaptureError):
        with bcg.capture(bcg.BreakableGraph(), stream=stream, pool=pool):
            x.copy_(torch.randn(4))
    _assert_clean(stream, pool)


def _captured_graph(x: torch.Tensor) -> torch.cuda.CUDAGraph:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        x * 3  # warm up
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream):
        x * 3
    torch.cuda.current_stream().wait_stream(stream)
    return g


def _drop_into_garbage(holder: list) -> None:
    """Move the last graph of ``holder`` into a garbage reference cycle (its only reference),
    then allocate enough containers that Python's cycle collector runs, if it is enabled."""
    cycle: list = [holder.pop()]
    cycle.append(cycle)
    del cycle
    junk = [[i] for i in range(50_000)]
    del junk


def test_the_cycle_collector_cannot_destroy_a_graph_inside_a_capture() -> None:
    """Collecting garbage that holds a CUDA graph destroys it, which CUDA forbids during a
    capture: torch.cuda.graph's capture is invalidated (control); bcg's is not."""
    import gc

    assert gc.isenabled()
    x = torch.randn(256, device="cuda")
    y = torch.empty_like(x)
    holder = [_captured_graph(x) for _ in range(3)]
    control = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    # the outer stream context restores the current stream: a failing torch.cuda.graph
    # leaves its capture stream current (its __exit__ stops at the failed capture_end)
    with torch.cuda.stream(side), pytest.raises(RuntimeError):
        with torch.cuda.graph(control, stream=side):
            y.copy_(x + 1)
            _drop_into_garbage(holder)
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    del control
    gc.collect()
    torch.cuda.synchronize()

    @bcg.breakpoint
    def bp(t: torch.Tensor) -> None:
        t.mul_(2)

    def fn(t: torch.Tensor) -> torch.Tensor:
        u = t + 1
        if holder:
            _drop_into_garbage(holder)
        bp(u)
        if holder:
            _drop_into_garbage(holder)
        return u - 1

    (x.clone() + 1).mul_(2) - 1  # warm up the kernels (a warm-up run of fn would use the holder up)
    graph = bcg.make_graph(fn, x, warmup=0)
    assert not holder and gc.isenabled()  # both graphs became garbage inside; collection resumed
    x.copy_(torch.randn(256, device="cuda"))
    torch.testing.assert_close(graph.replay(), (x + 1) * 2 - 1, rtol=0, atol=0)
    graph.reset()
    with pytest.raises(bcg.errors.HostSyncInCaptureError):
        with bcg.capture(bcg.BreakableGraph()):
            float(x.sum())
    assert gc.isenabled()  # resumed after a failed capture too
    _assert_clean()


def test_host_sync_in_a_later_segment_releases_earlier_segments() -> None:
    @bcg.breakpoint
    def bp(t: torch.Tensor) -> None:
        t.add_(1)

    graph = bcg.BreakableGraph()
    x = torch.randn(1 << 16, device="cuda")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with pytest.raises(bcg.errors.HostSyncInCaptureError, match="segment 1"):
        with bcg.capture(graph):
            h = x * 2
            bp(h)
            float(h.sum())
    del h
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= before
    _assert_clean()


def test_nested_capture_is_refused() -> None:
    outer = bcg.BreakableGraph()
    x = torch.randn(4, device="cuda")
    with pytest.raises(bcg.errors.NestedCaptureError, match="cannot nest"):
        with bcg.capture(outer):
            y = x + 1
            with bcg.capture(bcg.BreakableGraph()):
                pass
    del y
    _assert_clean()
    tg = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with pytest.raises(bcg.errors.NestedCaptureError):
        with torch.cuda.graph(tg, stream=s):
            z = x + 1
            bcg.capture(bcg.BreakableGraph()).__enter__()
    del z
    _assert_clean()


def test_replay_before_capture_and_after_reset_raise() -> None:
    graph = bcg.BreakableGraph()
    with pytest.raises(bcg.ReplayError, match="no capture yet"):
        graph.replay()
    x = torch.randn(4, device="cuda")
    graph, _ = _capture(lambda a: a * 2, x)
    graph.reset()
    with pytest.raises(bcg.ReplayError, match="was reset"):
        graph.replay()
    with bcg.capture(graph):  # a reset graph can be captured again
        out = x * 3
    graph.replay()
    torch.testing.assert_close(out, x * 3)


def test_breakpoint_raising_during_capture_abandons_cleanly() -> None:
    @bcg.breakpoint
    def broken(t: torch.Tensor) -> None:
        raise ValueError("metadata missing")

    graph = bcg.BreakableGraph()
    stream = torch.cuda.Stream()
    x = torch.randn(4, device="cuda")
    with pytest.raises(ValueError, match="metadata missing") as info:
        with bcg.capture(graph, stream=stream):
            broken(x * 2)
    assert any("during capture" in n for n in getattr(info.value, "__notes__", []))
    assert not graph.is_captured
    _assert_clean(stream)


@pytest.mark.parametrize("staged", [False, True], ids=["plain", "staged"])
def test_a_breakpoint_error_caught_inside_the_capture_block_still_fails_the_capture(staged: bool) -> None:
    """A breakpoint that raises abandons the capture; a ``try``/``except`` around it inside the block
    must not turn that into a graph missing the work after it (or an internal error at exit)."""
    options = {"prepare": lambda live: live, "fits": lambda live: True} if staged else {}

    @bcg.breakpoint(**options)
    def broken(t: torch.Tensor) -> None:
        raise ValueError("metadata missing")

    graph = bcg.BreakableGraph()
    stream = torch.cuda.Stream()
    pool = bcg.graph_pool_handle()
    x = torch.randn(4, device="cuda")
    with pytest.raises(bcg.CaptureError, match="caught inside the capture block") as info:
        with bcg.capture(graph, pool, stream, live=1):
            y = x * 2
            try:
                broken(y)
            except ValueError:
                pass
            y.add_(1)
    assert "broken" in str(info.value)
    assert not graph.is_captured
    _assert_clean(stream, pool)


def test_capturing_into_a_pool_whose_graphs_were_reset_while_its_tensors_live_fails_cleanly() -> None:
    """torch cannot share a pool whose graphs are all gone while tensors it allocated live on (its
    allocator asserts): bcg says so and what to do, leaves no stream capturing and the RNG usable."""
    pool = bcg.graph_pool_handle()
    stream = torch.cuda.Stream()
    x = torch.randn(16, device="cuda")
    graph = bcg.BreakableGraph()
    with bcg.capture(graph, pool, stream):
        out = x * 2  # allocated in the pool, kept alive below
    graph.reset()
    with pytest.raises(bcg.CaptureError, match="graph_pool_handle"):
        with bcg.capture(graph, pool, stream):
            x * 3
    assert not graph.is_captured
    torch.rand(4, device="cuda")  # eager random ops work (torch's RNG is not left capturing)
    _assert_clean(stream)
    del out


def test_a_breakpoint_reached_on_a_side_stream_inside_a_capture_says_to_join_it() -> None:
    """A segment must end on the stream it began on: a breakpoint called inside
    ``with torch.cuda.stream(side)`` gets bcg's StreamForkError naming the fix, not torch's
    capture_end message, and CUDA state stays clean."""

    @bcg.breakpoint
    def bump(t: torch.Tensor) -> None:
        t.add_(1)

    graph = bcg.BreakableGraph()
    stream = torch.cuda.Stream()
    side = torch.cuda.Stream()
    x = torch.randn(16, device="cuda")
    with pytest.raises(bcg.errors.StreamForkError, match="wait_stream"):
        with bcg.capture(graph, stream=stream):
            y = x * 2
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                bump(y + 1)
    assert not graph.is_captured
    _assert_clean(stream)


def test_breakpoint_raising_during_replay_leaves_graph_replayable() -> None:
    @bcg.breakpoint
    def flaky(t: torch.Tensor) -> None:
        if bcg.live() == "fail":
            raise RuntimeError("backend unavailable")
        t.mul_(2)

    x = torch.randn(16, device="cuda")

    def fn(a: torch.Tensor) -> torch.Tensor:
        h = a + 1
        flaky(h)
        return h - 1

    graph, out = _capture(fn, x, live="ok")
    with pytest.raises(RuntimeError, match="backend unavailable") as info:
        graph.replay(live="fail")
    assert any("during replay" in n for n in info.value.__notes__)
    x.copy_(torch.randn_like(x))
    graph.replay(live="ok")
    torch.testing.assert_close(out, (x + 1) * 2 - 1, rtol=0, atol=0)
    _assert_clean()


def test_default_stream_is_refused() -> None:
    with pytest.raises(bcg.CaptureError, match="default stream"):
        with bcg.capture(bcg.BreakableGraph(), stream=torch.cuda.default_stream()):
            pass
    _assert_clean()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_replay_under_another_device_raises() -> None:
    x = torch.randn(4, device="cuda:0")
    with torch.cuda.device(0):
        graph, out = _capture(lambda a: a * 2, x)
    with torch.cuda.device(1), pytest.raises(bcg.ReplayError, match="captured on cuda:0"):
        graph.replay()
    with torch.cuda.device(0):
        graph.replay()
    torch.testing.assert_close(out, x * 2)


# -- memory ---------------------------------------------------------------------------------------


def test_reset_frees_segments_bridges_and_pool() -> None:
    @bcg.breakpoint
    def grow(t: torch.Tensor) -> torch.Tensor:
        return t.repeat(2, 1)

    x = torch.randn(1024, 1024, device="cuda")
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    allocated0 = torch.cuda.memory_allocated()

    def fn(a: torch.Tensor) -> torch.Tensor:
        h = a * 2
        g = grow(h)
        return (g + 1).sum()

    graph, out = _capture(fn, x)
    pool = graph.stats().pool_bytes
    assert pool >= 2 * x.nbytes  # the bridge of grow's result, and segment temporaries
    reserved_captured = torch.cuda.memory_reserved()
    del out
    graph.reset()
    assert torch.cuda.memory_allocated() <= allocated0
    assert torch.cuda.memory_reserved() <= reserved_captured - pool  # the pool went back to the driver


def test_ten_thousand_replays_do_not_grow_memory() -> None:
    """GEMMs in the segments before and after the breakpoint (and one in the breakpoint, eager):
    a cuBLAS workspace allocated per replay (or per stream) would show as growth."""
    w_in = torch.randn(64, 64, device="cuda") / 8
    w_out = torch.randn(64, 32, device="cuda", dtype=torch.bfloat16) / 8
    w_bp = torch.randn(64, 64, device="cuda") / 8

    @bcg.breakpoint
    def attn_like(q: torch.Tensor) -> torch.Tensor:
        n = bcg.live()
        out = torch.zeros_like(q)
        out[:n] = (q[:n] @ w_bp).softmax(-1)
        return out

    x = torch.randn(128, 64, device="cuda")

    def fn(a: torch.Tensor) -> torch.Tensor:
        h = (a @ w_in).relu()  # fp32 GEMM in segment 0
        return (attn_like(h) * 2).bfloat16() @ w_out  # bf16 GEMM in segment 1

    with bcg.live_scope(128):
        fn(x)  # warm up (cuBLAS handles are created eagerly, not inside a segment)
    graph, out = _capture(fn, x, live=128)
    assert graph.stats().segments == 2 and graph.stats().breakpoints == 1
    assert all(k > 0 for k in graph.stats().nodes)
    for i in range(256):  # every n once or more: each size's temporaries have been cached
        graph.replay(live=1 + i % 128)
    torch.cuda.synchronize()
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    for i in range(10_000):
        graph.replay(live=1 + i % 128)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= allocated
    assert torch.cuda.memory_reserved() <= reserved
    x.copy_(torch.randn_like(x))
    graph.replay(live=77)
    with bcg.live_scope(77):
        expected = fn(x)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_pool_ownership_lets_later_segments_reuse_breakpoint_memory() -> None:
    @bcg.breakpoint(mutates=("out",))
    def copy_into(a: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(a)

    x = torch.randn(1 << 20, device="cuda")

    def fn(a: torch.Tensor) -> torch.Tensor:
        h = a
        for _ in range(8):
            h = h * 1.5
            out = torch.empty_like(h)
            copy_into(h, out)
            h = out + 1
        return h

    graph, out = _capture(fn, x)
    graph.replay()
    ref = x
    for _ in range(8):
        ref = ref * 1.5 + 1
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    # eight breakpoints, each with its argument and result: reused, not one pair of 4 MiB blocks each
    assert graph.stats().pool_bytes < 8 * 2 * x.nbytes
    del out
    graph.reset()


def test_make_graph_captures_and_knows_its_outputs() -> None:
    model = TinyLlama(layers=2, hidden=128, heads=4, kv_heads=2, intermediate=256)
    T = 48
    x = torch.randn(T, 128, device="cuda", dtype=torch.bfloat16)
    lengths = [20, 28]
    pos = positions_for(lengths, T, "cuda")
    graph = bcg.make_graph(model, x, pos, live={"lengths": lengths})
    eager_graph = bcg.make_graph(model, x, pos, mode="eager", live={"lengths": lengths})
    assert graph.mode == "graph" and eager_graph.mode == "eager"
    assert graph.stats().segments == eager_graph.stats().segments
    assert graph.stats().breakpoints == eager_graph.stats().breakpoints
    for lengths in ([48], [1, 47], [16, 16, 16]):
        x.copy_(torch.randn_like(x))
        pos.copy_(positions_for(lengths, T, "cuda"))
        a = graph.replay(live={"lengths": lengths})
        b = eager_graph.replay(live={"lengths": lengths})
        assert torch.equal(a, b)


def test_a_swallowed_host_sync_error_still_fails_the_capture_cleanly() -> None:
    """CUDA reports the invalidation at the capture's end, with no trace of its cause: the
    error says so and names both possible causes, rather than blaming a line."""
    graph = bcg.BreakableGraph()
    stream = torch.cuda.Stream()
    pool = bcg.graph_pool_handle()
    x = torch.randn(4, device="cuda")
    with pytest.raises(bcg.errors.CaptureInvalidatedError, match="invalidated earlier(.|\n)*another thread"):
        with bcg.capture(graph, stream=stream, pool=pool):
            y = x * 2
            try:
                y.sum().item()
            except RuntimeError:
                pass  # the capture is invalidated all the same
    del y
    _assert_clean(stream, pool)
    _assert_clean(stream, pool)
