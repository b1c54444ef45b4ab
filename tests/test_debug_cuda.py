"""Verification and debugging aids on a GPU: verify, guards, poison, profiler ranges, DOT dumps."""

from __future__ import annotations

import pytest
import torch

import bcg

from .models import TinyLlama, positions_for, random_lengths

pytestmark = pytest.mark.cuda

T = 64


def _make_inputs(gen: torch.Generator):  # noqa: ANN202
    def make() -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(T, 128, generator=gen).to("cuda", torch.bfloat16)
        return x, positions_for([T], T, "cuda")

    return make


def _samples(n: int, gen: torch.Generator) -> list[dict]:
    return [{"lengths": random_lengths(T, 2 + i % 4, gen)} for i in range(n)]


def test_verify_passes_on_a_correct_model_over_twenty_samples() -> None:
    model = TinyLlama(layers=3, hidden=128, heads=4, kv_heads=2, intermediate=256)
    gen = torch.Generator().manual_seed(0)
    report = bcg.verify(model, _make_inputs(gen), _samples(20, gen))
    assert report.ok and report.samples == 20
    assert report.graph.stats().breakpoints == 3


def test_verify_points_at_the_segment_holding_a_forgotten_breakpoint() -> None:
    # Layer 1's attention is not marked: it is captured into segment 1 with the
    # capture-time lengths and silently replays them.
    model = TinyLlama(layers=3, hidden=128, heads=4, kv_heads=2, intermediate=256, forget_layer=1)
    gen = torch.Generator().manual_seed(1)
    samples = [{"lengths": [T]}] + _samples(5, gen)
    with pytest.raises(bcg.errors.VerificationError) as info:
        bcg.verify(model, _make_inputs(gen), samples)
    report = info.value.report
    graph = report.graph
    assert graph.stats().breakpoints == 2 and graph.stats().segments == 3
    first = report.first
    assert first is not None and first.sample == 1  # sample 0 repeats the capture-time lengths
    assert first.where == "segment" and first.segment == 1
    assert "segment 1" in str(report)


def test_guards_catch_a_reallocated_input() -> None:
    @bcg.breakpoint
    def scale(t: torch.Tensor) -> None:
        t.mul_(2)

    x = torch.randn(32, device="cuda")

    def fn(a: torch.Tensor) -> torch.Tensor:
        h = a + 1
        scale(h)
        return h

    graph = bcg.make_graph(fn, x, debug=bcg.Debug(guards=True))
    graph.replay()
    x.data = torch.randn(32, device="cuda")  # a new allocation behind the same Python tensor
    with pytest.raises(bcg.errors.GuardError, match="static input 0.*address moved"):
        graph.replay()
    unguarded = bcg.make_graph(fn, torch.randn(32, device="cuda"))
    assert unguarded.forms[0].recording.guards is None


def test_guards_from_the_environment_cover_breakpoint_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BCG_GUARDS", "1")
    kv = torch.randn(16, device="cuda")

    @bcg.breakpoint
    def read_cache(t: torch.Tensor, cache: torch.Tensor) -> None:
        t.add_(cache)

    x = torch.randn(16, device="cuda")
    graph = bcg.BreakableGraph()
    with bcg.capture(graph):
        h = x * 2
        read_cache(h, kv)
        out = h - 1
    graph.replay()
    kv.set_(torch.randn(32, device="cuda"))
    with pytest.raises(bcg.errors.GuardError, match="argument 1 of breakpoint"):
        graph.replay()
    del out


def test_poison_turns_a_stale_read_into_nan() -> None:
    @bcg.breakpoint(mutates=("out",))
    def partial(a: torch.Tensor, out: torch.Tensor) -> None:
        n = bcg.live()
        out[:n].copy_(a[:n])  # rows past n keep whatever was there: a stale read downstream

    x = torch.randn(64, 8, device="cuda")

    def fn(a: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(a)
        partial(a * 3, out)
        return out * 2

    graph = bcg.make_graph(fn, x, live=64, debug=bcg.Debug(poison=True))
    y = graph.replay(live=10)
    assert torch.isnan(y[10:]).all()
    torch.testing.assert_close(y[:10], x[:10] * 3 * 2, rtol=0, atol=0)
    clean = bcg.make_graph(fn, x, live=64, debug=bcg.Debug())
    y2 = clean.replay(live=10)
    assert not torch.isnan(y2[10:]).any()  # stale but finite: the bug would go unseen


def test_profiler_shows_named_ranges_for_segments_and_breakpoints() -> None:
    @bcg.breakpoint
    def mid(t: torch.Tensor) -> None:
        t.add_(1)

    x = torch.randn(64, device="cuda")

    def fn(a: torch.Tensor) -> torch.Tensor:
        h = a * 2
        mid(h)
        return h.exp()

    graph = bcg.make_graph(fn, x)
    graph.replay()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    names = {e.key for e in prof.key_averages()}
    assert "bcg.segment[0]" in names and "bcg.segment[1]" in names
    assert any(n.startswith("bcg.breakpoint:") and n.endswith("mid") for n in names)
    torch.testing.assert_close(graph.outputs, (x * 2 + 1).exp())


def test_dump_dot_writes_one_nonempty_file_per_segment(tmp_path) -> None:  # noqa: ANN001
    @bcg.breakpoint
    def mid(t: torch.Tensor) -> None:
        t.add_(1)

    x = torch.randn(64, device="cuda")
    graph = bcg.make_graph(lambda a: (mid(a * 2), a.sin())[1], x)
    paths = graph.dump_dot(tmp_path / "dots")
    assert len(paths) == graph.stats().segments == 2
    for p in paths:
        text = open(p).read()
        assert text.startswith("digraph") and len(text) > 50
    table = graph.describe()
    assert "segment[0]" in table and "mid" in table and "MiB" in table
