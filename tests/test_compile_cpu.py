"""Breakpoints inside torch.compile'd code: a Dynamo graph break, run eagerly, never traced."""

from __future__ import annotations

import pytest
import torch

import bcg


def test_breakpoint_under_torch_compile_graph_breaks_and_runs_eagerly() -> None:
    torch._dynamo.reset()
    seen: list[bool] = []

    def helper(t: torch.Tensor) -> torch.Tensor:
        seen.append(torch.compiler.is_compiling())
        return t * 2

    @bcg.breakpoint
    def bp(t: torch.Tensor) -> torch.Tensor:
        seen.append(torch.compiler.is_compiling())
        return helper(t) + bcg.live()

    def f(x: torch.Tensor) -> torch.Tensor:
        return bp(x.sin()).cos()

    x = torch.randn(16)
    with bcg.live_scope(1.5):
        expected = f(x)
        seen.clear()
        out = torch.compile(f, backend="eager")(x)
        explanation = torch._dynamo.explain(f)(x)
    assert torch.equal(out, expected)
    assert seen and not any(seen)  # the breakpoint and what it calls were never traced
    assert explanation.graph_break_count == 1
    assert explanation.graph_count == 2  # before and after the breakpoint


def test_breakpoint_in_compiled_code_still_records_structure_in_eager_mode() -> None:
    torch._dynamo.reset()

    @bcg.breakpoint
    def bp(t: torch.Tensor) -> None:
        t.add_(1)

    def f(x: torch.Tensor) -> torch.Tensor:
        h = x * 2
        bp(h)
        return h.exp()

    compiled = torch.compile(f, backend="eager")
    x = torch.randn(8)
    graph = bcg.make_graph(compiled, x, mode="eager")
    assert graph.stats().breakpoints == 1 and graph.stats().segments == 2
    x.copy_(torch.randn(8))
    torch.testing.assert_close(graph.replay(), (x * 2 + 1).exp())


def test_compile_watch_counts_graphs_compiled_inside_it() -> None:
    from bcg.core.compiled import CompileWatch, dynamo_graphs

    torch._dynamo.reset()

    def f(x: torch.Tensor) -> torch.Tensor:
        return x.sin() + 1

    compiled = torch.compile(f, backend="eager")
    x = torch.randn(8)
    compiled(x)  # compiled before the watch: not counted
    with CompileWatch() as watch:
        compiled(x)
        assert watch.compiled == 0 and watch.message() is None
        before = dynamo_graphs()
        compiled(torch.randn(3, 5))  # a new rank: Dynamo compiles again
        assert dynamo_graphs() == before + 1
        assert watch.compiled == 1
        assert "torch.compile compiled 1 graph(s) during this capture" in (watch.message() or "")


def test_compile_watch_switches_inductors_cuda_graphs_off_and_back() -> None:
    import torch._inductor.config as inductor_config

    from bcg.core.compiled import CompileWatch

    before = inductor_config.triton.cudagraph_capture_sizes
    with CompileWatch():
        assert inductor_config.triton.cudagraph_capture_sizes == ()  # no size is graphed by Inductor
    assert inductor_config.triton.cudagraph_capture_sizes == before
    with pytest.raises(ValueError), CompileWatch():  # restored when the capture fails too
        raise ValueError("capture failed")
    assert inductor_config.triton.cudagraph_capture_sizes == before
