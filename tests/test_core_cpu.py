"""Core behaviour that needs no GPU: decorator, live metadata, eager mode, bridges, errors."""

from __future__ import annotations

import asyncio
import threading
import warnings

import pytest
import torch

import bcg
from bcg.core.bridge import BridgeSet
from bcg.core.pool import non_owning_alias

from .models import TinyLlama, positions_for, random_lengths
from .threads import run_in_threads

# -- @bcg.breakpoint outside a capture ---------------------------------------------------


def test_breakpoint_outside_capture_is_a_plain_call() -> None:
    calls = []

    @bcg.breakpoint
    def f(a: torch.Tensor, *, scale: float = 2.0) -> torch.Tensor:
        """doc"""
        calls.append(a)
        return a * scale

    x = torch.randn(5)
    out = f(x, scale=3.0)
    assert torch.equal(out, x * 3.0)
    assert calls == [x]
    assert f.__name__ == "f" and f.__doc__ == "doc"
    assert f.__bcg_breakpoint__.name.endswith("f")


def test_breakpoint_decorator_with_options_and_errors_pass_through() -> None:
    @bcg.breakpoint(enabled=False, capture_stub=lambda a: a, name="custom")
    def g(a: torch.Tensor) -> torch.Tensor:
        raise KeyError("boom")

    spec = g.__bcg_breakpoint__
    assert spec.name == "custom" and not spec.is_enabled()
    with pytest.raises(KeyError, match="boom"):
        g(torch.randn(2))


def test_graph_break_outside_capture_does_nothing() -> None:
    def fn(t: torch.Tensor) -> torch.Tensor:
        h = t.sin() * 2
        assert bcg.graph_break() is None
        return h.cos() + t

    def unbroken(t: torch.Tensor) -> torch.Tensor:
        return (t.sin() * 2).cos() + t

    x = torch.randn(16)
    before = x.clone()
    assert bcg.graph_break() is None  # no capture, no recording: a plain no-op
    assert torch.equal(fn(x), unbroken(x))  # the code around it computes the same values
    assert torch.equal(x, before)

    # Inside an eager-mode recording the same call splits the work into two segments ...
    graph = bcg.make_graph(fn, x, mode="eager")
    assert graph.stats().segments == 2 and graph.stats().breakpoints == 0
    assert bcg.make_graph(unbroken, x, mode="eager").stats().segments == 1
    # ... and once the recording is over it does nothing again: neither to the recorded
    # graph nor to the values computed around it.
    assert bcg.graph_break() is None
    assert graph.stats().segments == 2
    x.copy_(torch.randn(16))
    out = graph.replay()
    assert out is graph.outputs and torch.equal(out, unbroken(x))
    assert torch.equal(fn(x), unbroken(x))


def test_node_group_work_always_runs_without_cuda_graphs() -> None:
    """Eager mode (and plain calls) run a ``node_group`` block every time; ``set_enabled`` says
    so by refusing to skip it."""
    counter = torch.zeros(())

    def fn(t: torch.Tensor) -> torch.Tensor:
        with bcg.core.session.node_group("extra"):
            counter.add_(1)
        return t * 2

    x = torch.randn(8)
    assert torch.equal(fn(x), x * 2) and counter.item() == 1  # a plain call
    graph = bcg.make_graph(fn, x, mode="eager")
    assert graph.set_enabled("extra", True)
    assert not graph.set_enabled("extra", False)
    before = counter.item()
    out = graph.replay()
    assert torch.equal(out, x * 2) and counter.item() == before + 1
    assert not bcg.BreakableGraph().set_enabled("extra", False)  # not captured


def _orders(edges: list[tuple[int, int]]) -> set[tuple[int, int]]:
    """Every (before, after) pair the edges imply (transitive closure)."""
    closure = set(edges)
    while True:
        more = {(a, d) for a, b in closure for c, d in closure if b == c} - closure
        if not more:
            return closure
        closure |= more


@pytest.mark.parametrize(
    "edges,gone",
    [
        ([(1, 2), (2, 3)], [2]),  # a chain
        ([(1, 2), (2, 3), (3, 4), (4, 5)], [2, 3, 4]),  # consecutive removed nodes
        ([(1, 2), (1, 3), (2, 4), (3, 4), (4, 5)], [2, 4]),  # a diamond and its join
        ([(1, 2), (2, 3), (2, 4)], [1]),  # a removed root
        ([(1, 2), (2, 3), (1, 3)], [3]),  # a removed leaf
        ([(1, 2), (3, 2), (2, 4), (2, 5)], [2]),  # two before, two after
    ],
)
def test_trimming_keeps_every_order_between_the_nodes_that_stay(edges: list[tuple[int, int]], gone: list[int]) -> None:
    """A trimmed executable's graph: the removed nodes' edges go, the bypass edges come, and
    the nodes that stay keep exactly the orders they had."""
    from bcg.core.trim import bypass_edges

    added = bypass_edges(edges, gone)
    kept = [(a, b) for a, b in edges if a not in gone and b not in gone] + added
    assert not {n for e in added for n in e} & set(gone)
    assert not set(added) & set(edges)
    stay = lambda pairs: {(a, b) for a, b in pairs if a not in gone and b not in gone}  # noqa: E731
    assert _orders(kept) == stay(_orders(edges))


def test_mutates_names_the_written_arguments() -> None:
    @bcg.breakpoint(mutates=("out",))
    def f(a: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(a)

    a, out = torch.randn(3), torch.empty(3)
    spec = f.__bcg_breakpoint__
    assert spec.mutated_tensors((a, out), {}) == [out]
    assert spec.mutated_tensors((a,), {"out": out}) == [out]
    plain = bcg.breakpoint(lambda a, b: None).__bcg_breakpoint__
    assert plain.mutated_tensors((a, out), {}) == [a, out]


# -- live metadata -----------------------------------------------------------------------------


def test_live_outside_everything_raises_or_defaults() -> None:
    with pytest.raises(LookupError, match="live_scope"):
        bcg.live()
    assert bcg.live(default=7) == 7


def test_live_scope_nests_and_restores() -> None:
    with bcg.live_scope({"a": 1}):
        assert bcg.live() == {"a": 1}
        with bcg.live_scope([1, 2]):
            assert bcg.live() == [1, 2]
        assert bcg.live() == {"a": 1}
    assert bcg.live(None) is None


def test_live_is_per_thread_and_per_task() -> None:
    seen: dict[int, object] = {}
    barrier = threading.Barrier(4)

    def worker(i: int) -> None:
        with bcg.live_scope(i):
            barrier.wait()
            seen[i] = bcg.live()

    assert not run_in_threads(worker, range(4))
    assert seen == {0: 0, 1: 1, 2: 2, 3: 3}

    async def task(i: int) -> object:
        with bcg.live_scope(("task", i)):
            await asyncio.sleep(0)
            return bcg.live()

    async def main() -> list[object]:
        return await asyncio.gather(*(task(i) for i in range(3)))

    assert asyncio.run(main()) == [("task", 0), ("task", 1), ("task", 2)]


# -- eager mode end to end ---------------------------------------------------------------------


def _cpu_model(returning: bool = False) -> TinyLlama:
    return TinyLlama(layers=3, hidden=64, heads=4, kv_heads=2, intermediate=128, device="cpu", dtype=torch.float32, returning=returning)


@pytest.mark.parametrize("returning", [False, True])
def test_eager_mode_records_structure_and_replays_fresh_inputs(returning: bool) -> None:
    model = _cpu_model(returning)
    gen = torch.Generator().manual_seed(1)
    T = 24
    x = torch.randn(T, 64, generator=gen)
    lengths = random_lengths(T, 3, gen)
    pos = positions_for(lengths, T, "cpu")
    graph = bcg.make_graph(model, x, pos, mode="eager", live={"lengths": lengths})
    assert graph.mode == "eager"
    stats = graph.stats()
    assert stats.mode == "eager"
    assert stats.breakpoints == 3
    assert stats.segments == 4  # before, between and after the three attentions
    assert stats.mode == "eager" and all(n > 0 for n in stats.nodes)
    assert stats.pool_bytes == 0 and stats.capture_s > 0
    out = graph.outputs
    with bcg.live_scope({"lengths": lengths}):
        assert torch.equal(out, model(x, pos))
    for _ in range(3):
        lengths = random_lengths(T, int(torch.randint(1, 5, (1,), generator=gen)), gen)
        x.copy_(torch.randn(T, 64, generator=gen))
        pos.copy_(positions_for(lengths, T, "cpu"))
        result = graph.replay(live={"lengths": lengths})
        assert result is out  # the same output tensors, rewritten
        with bcg.live_scope({"lengths": lengths}):
            assert torch.equal(out, model(x, pos))


def test_eager_mode_consecutive_breakpoints_make_no_empty_segment() -> None:
    @bcg.breakpoint
    def bump(t: torch.Tensor) -> None:
        t.add_(1)

    def fn(t: torch.Tensor) -> torch.Tensor:
        t.mul_(2)
        bump(t)
        bump(t)
        bcg.graph_break()
        bcg.graph_break()
        return t * 3

    t = torch.randn(4)
    graph = bcg.make_graph(fn, t, mode="eager")
    assert graph.stats().segments == 2
    assert graph.stats().breakpoints == 2
    assert [type(s).__name__ for s in graph.plan] == ["SegmentStep", "BreakpointStep", "BreakpointStep", "SegmentStep"]


def test_make_graph_without_cuda_falls_back_to_eager_with_one_warning() -> None:
    if torch.cuda.is_available():
        pytest.skip("checks the no-CUDA fallback")
    x = torch.randn(3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graph = bcg.make_graph(lambda a: a * 2, x)
        graph.replay()
        graph.replay()
    assert graph.mode == "eager"
    assert len([w for w in caught if "falling back" in str(w.message)]) == 1


def test_make_graph_rejects_unknown_mode() -> None:
    with pytest.raises(ValueError, match="mode must be one of"):
        bcg.make_graph(lambda: None, mode="fast")


# -- errors without a GPU -----------------------------------------------------------------------


def test_capture_without_cuda_raises_clearly() -> None:
    if torch.cuda.is_available():
        pytest.skip("checks the no-CUDA error")
    graph = bcg.BreakableGraph()
    with pytest.raises(bcg.CaptureError, match="needs a CUDA GPU.*mode='eager'"):
        with bcg.capture(graph):
            pass
    assert not graph.is_captured


def test_replay_before_capture_and_after_reset() -> None:
    graph = bcg.BreakableGraph()
    with pytest.raises(bcg.ReplayError, match="no capture yet"):
        graph.replay()
    g2 = bcg.make_graph(lambda a: a + 1, torch.randn(2), mode="eager")
    g2.reset()
    with pytest.raises(bcg.ReplayError, match="was reset"):
        g2.replay()


def test_capture_argument_validation() -> None:
    with pytest.raises(ValueError, match="capture_error_mode"):
        bcg.capture(bcg.BreakableGraph(), capture_error_mode="loose")


def test_eager_breakpoint_error_propagates_from_replay() -> None:
    @bcg.breakpoint
    def maybe_fail(t: torch.Tensor) -> None:
        if bcg.live():
            raise RuntimeError("asked to fail")

    graph = bcg.make_graph(lambda t: maybe_fail(t * 2), torch.randn(3), mode="eager", live=False)
    with pytest.raises(RuntimeError, match="asked to fail"):
        graph.replay(live=True)
    graph.replay(live=False)


# -- bridges (device-independent logic) ---------------------------------------------------------


def test_bridges_own_copies_and_refresh_in_place() -> None:
    a = torch.randn(4)
    result = (a * 2, {"n": 3, "t": a + 1})
    bridges = BridgeSet("bp", result, (a,), {})
    caller = bridges.caller_result()
    assert torch.equal(caller[0], result[0]) and caller[0].data_ptr() != result[0].data_ptr()
    assert caller[1]["n"] == 3
    assert bridges.nbytes == 2 * 4 * 4
    fresh = (torch.randn(4), {"n": 3, "t": torch.randn(4)})
    bridges.refresh(fresh)
    assert torch.equal(caller[0], fresh[0]) and torch.equal(caller[1]["t"], fresh[1]["t"])


def test_bridge_of_an_in_place_result_is_the_argument_itself() -> None:
    out = torch.randn(6)
    bridges = BridgeSet("bp", out, (out,), {})
    assert bridges.caller_result() is out
    assert bridges.nbytes == 0 and bridges.bridged() == [False]
    bridges.refresh(out)  # the same argument again: nothing to copy


def test_a_returned_view_of_an_argument_gets_a_bridge() -> None:
    """Only the very same view counts as written in place; another view of an argument is
    copied into a bridge, so a replay never writes into the argument."""
    out = torch.randn(6)
    original = out.clone()
    bridges = BridgeSet("bp", out[:3], (out,), {})
    bridge = bridges.caller_result()
    assert bridge.data_ptr() != out.data_ptr() and bridges.nbytes == 3 * 4
    assert bridges.bridged() == [True]
    bridges.refresh(out[3:])  # another window of the argument at replay
    assert torch.equal(bridge, original[3:]) and torch.equal(out, original)


@pytest.mark.parametrize(
    "fresh, match",
    [
        (torch.randn(5), "shapes and dtypes are fixed"),
        (torch.randn(4, dtype=torch.float64), "shapes and dtypes are fixed"),
    ],
)
def test_bridge_rejects_other_shape_or_dtype(fresh: torch.Tensor, match: str) -> None:
    bridges = BridgeSet("bp", torch.randn(4), (), {})
    with pytest.raises(bcg.errors.BreakpointOutputMismatch, match=match):
        bridges.refresh(fresh)


def test_bridge_rejects_other_structure_and_changed_frozen_values() -> None:
    bridges = BridgeSet("bp", (torch.randn(2), 5), (), {})
    with pytest.raises(bcg.errors.BreakpointOutputMismatch, match="same structure"):
        bridges.refresh([torch.randn(2), 5])
    with pytest.raises(bcg.errors.BreakpointOutputMismatch, match="frozen at capture"):
        bridges.refresh((torch.randn(2), 6))
    with pytest.raises(bcg.errors.BreakpointOutputMismatch, match="was a tensor at capture"):
        bridges.refresh((7, 5))


def test_non_owning_alias_views_the_same_memory() -> None:
    t = torch.randn(4, 6)[1:, 2:]
    alias = non_owning_alias(t)
    assert alias.data_ptr() == t.data_ptr() and alias.stride() == t.stride()
    assert torch.equal(alias, t)
    t.add_(1)
    assert torch.equal(alias, t)


def test_a_breakpoint_that_returned_none_has_nothing_to_refresh_but_still_checks() -> None:
    from bcg.core.plan import BreakpointStep

    def halve(y: torch.Tensor) -> None:
        y.mul_(0.5)

    y = torch.zeros(3)
    spec = bcg.breakpoint(name="halve", mutates=("y",))(halve).__bcg_breakpoint__
    bridges = BridgeSet("halve", None, (y,), {})
    assert bridges.empty and bridges.tensors() == []
    fn, args, kwargs, on_result, always = BreakpointStep(spec=spec, args=(y,), kwargs={}, bridges=bridges).call()
    assert on_result is not None and not always  # replays never call it for a None result
    bridges.refresh(None)  # nothing to do
    with pytest.raises(bcg.errors.BreakpointOutputMismatch, match="halve"):
        on_result(torch.ones(3))  # but a result where the capture had None is a mismatch


def test_copy_outputs_into_skips_a_tensor_already_in_place_and_never_reads_what_it_wrote() -> None:
    """A result tensor that is its destination's memory is not copied (a staged tier whose
    outputs landed in the bucket's); sources that overlap a written destination are read
    before any copy, so swapped halves of one buffer come out swapped."""
    from bcg.form import OutputCopy, copy_outputs_into

    dst = (torch.zeros(4), torch.zeros(3))
    fresh = torch.randn(3)
    in_place = dst[0].view(4)  # another tensor object over the same memory
    in_place.copy_(torch.randn(4))
    expected = in_place.clone()
    assert copy_outputs_into(dst, (in_place, fresh), "a test") == 1
    assert torch.equal(dst[0], expected) and torch.equal(dst[1], fresh)

    buf = torch.randn(10)
    before = buf.clone()
    halves = (buf[:5], buf[5:])
    assert copy_outputs_into(halves, (buf[5:], buf[:5]), "a test") == 2
    assert torch.equal(buf, torch.cat([before[5:], before[:5]]))
    swap = OutputCopy(halves, (buf[5:], buf[:5]), "a test")  # decided once (a form's), run at each replay
    for _ in range(2):
        buf.copy_(torch.randn(10))
        before = buf.clone()
        assert swap() == 2
        assert torch.equal(buf, torch.cat([before[5:], before[:5]]))

    shifted = torch.randn(6)
    want = shifted[:5].clone()
    assert copy_outputs_into((shifted[1:],), (shifted[:5],), "a test") == 1  # overlapping one element off
    assert torch.equal(shifted[1:], want)
    with pytest.raises(bcg.ReplayError, match="output 0 is"):
        copy_outputs_into((torch.zeros(2),), (torch.zeros(3),), "a test")
