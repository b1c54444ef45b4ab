"""Breakpoints inside torch.compile'd code: one opaque op where their signature allows
(fullgraph=True keeps them), else a Dynamo graph break; never traced either way."""

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


# -- breakpoints as opaque ops: whole-model compiles with fullgraph=True ---------------------------


def _scaled_model() -> tuple[object, object]:
    calls: list[float] = []

    @bcg.breakpoint(mutates="h")
    def scale(h: torch.Tensor, bias: float = 0.0) -> None:
        s = float(bcg.live())
        calls.append(s)
        h.mul_(s).add_(bias)

    def f(x: torch.Tensor) -> torch.Tensor:
        h = x.sin() * 2
        scale(h, bias=0.5)
        h = h.cos() + 1
        scale(h)
        return h.exp()

    return f, calls


def _scaled_reference(x: torch.Tensor, s: float) -> torch.Tensor:
    h = (x.sin() * 2) * s + 0.5
    return ((h.cos() + 1) * s).exp()


def test_an_annotated_breakpoint_is_one_op_under_fullgraph_and_runs_at_every_call() -> None:
    torch._dynamo.reset()
    f, calls = _scaled_model()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    x = torch.randn(16)
    for s in (1.5, -0.25):  # a new live value per call: read at run time, not traced
        calls.clear()
        with bcg.live_scope(s):
            out = compiled(x)
        assert calls == [s, s]
        torch.testing.assert_close(out, _scaled_reference(x, s))
    with bcg.live_scope(1.0):
        explanation = torch._dynamo.explain(f)(x)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1


@pytest.mark.skipif(not hasattr(torch.Tag, "cudagraph_unsafe"), reason="this torch has no cudagraph_unsafe tag")
def test_a_breakpoint_op_is_kept_out_of_inductors_cuda_graphs() -> None:
    """The op is tagged cudagraph_unsafe: Inductor partitions its CUDA graphs around it
    (reduce-overhead), so a breakpoint never runs inside a graph Inductor records."""
    torch._dynamo.reset()
    f, _ = _scaled_model()
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> object:
        graphs.append(gm)
        return gm.forward

    with bcg.live_scope(2.0):
        torch.compile(f, fullgraph=True, backend=backend)(torch.randn(8))
    ops = [n.target for gm in graphs for n in gm.graph.nodes
           if n.op == "call_function" and getattr(n.target, "namespace", None) == "bcg"]
    assert len(ops) == 2
    assert all(torch.Tag.cudagraph_unsafe in op.tags for op in ops)


def test_a_breakpoint_returning_tensors_is_an_op_with_fake() -> None:
    torch._dynamo.reset()

    def fake(t: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(t)

    @bcg.breakpoint(fake=fake)
    def shifted(t: torch.Tensor) -> torch.Tensor:
        return t + float(bcg.live())

    def f(x: torch.Tensor) -> torch.Tensor:
        return shifted(x.sin()).cos()

    x = torch.randn(8)
    with bcg.live_scope(3.0):
        out = torch.compile(f, fullgraph=True, backend="aot_eager")(x)
        assert torch._dynamo.explain(f)(x).graph_break_count == 0
    torch.testing.assert_close(out, (x.sin() + 3.0).cos())


@pytest.mark.parametrize("kind", ["untyped", "tensor result without fake"])
def test_a_breakpoint_that_cannot_be_an_op_is_a_graph_break(kind: str) -> None:
    torch._dynamo.reset()
    if kind == "untyped":
        @bcg.breakpoint
        def bp(t):  # type: ignore[no-untyped-def]
            return t * 2
    else:
        @bcg.breakpoint
        def bp(t: torch.Tensor) -> torch.Tensor:
            return t * 2

    def f(x: torch.Tensor) -> torch.Tensor:
        return bp(x.sin()).cos()

    x = torch.randn(8)
    torch.testing.assert_close(torch.compile(f, backend="aot_eager")(x), (x.sin() * 2).cos())
    assert torch._dynamo.explain(f)(x).graph_break_count == 1
    torch._dynamo.reset()
    with pytest.raises(Exception):  # Dynamo refuses the break under fullgraph=True
        torch.compile(f, fullgraph=True, backend="aot_eager")(x)


def test_breakpoints_of_one_name_get_ops_of_their_own() -> None:
    torch._dynamo.reset()
    made = []
    for k in range(3):
        @bcg.breakpoint(name="attention", mutates="h")
        def bp(h: torch.Tensor, k: int = k) -> None:
            h.add_(k)

        made.append(bp)

    def f(x: torch.Tensor) -> torch.Tensor:
        h = x * 1
        for bp in made:
            bp(h)
        return h

    x = torch.randn(4)
    torch.testing.assert_close(torch.compile(f, fullgraph=True, backend="aot_eager")(x), x + 3)


def test_a_fullgraph_compile_records_its_breakpoints_in_eager_mode() -> None:
    torch._dynamo.reset()
    f, calls = _scaled_model()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    x = torch.randn(16)
    with bcg.live_scope(1.0):
        compiled(x)  # compiles outside the recording
    graph = bcg.make_graph(compiled, x, mode="eager", live=1.0)
    assert graph.stats().breakpoints == 2 and graph.stats().segments == 3
    x.copy_(torch.randn(16))
    torch.testing.assert_close(graph.replay(live=0.75), _scaled_reference(x, 0.75))


def test_the_storage_watch_sees_through_a_compiled_graph_with_breakpoint_ops() -> None:
    """The capture's watch (an infra mode) runs compiled code compiled, passes the breakpoints'
    ops (higher-order operators in the compiled graph) through, and sees the weights it reads."""
    from bcg.core.storages import StorageWatch

    torch._dynamo.reset()
    f, calls = _scaled_model()
    w = torch.randn(16)

    def g(x: torch.Tensor) -> torch.Tensor:
        return f(x * w)

    compiled = torch.compile(g, fullgraph=True, backend="aot_eager")
    x = torch.randn(16)
    asked: list[int] = []
    with bcg.live_scope(2.0):
        compiled(x)
        calls.clear()
        with StorageWatch(lambda op, t, ptr: asked.append(ptr) or False, recording=lambda: True):
            out = compiled(x)
    assert calls == [2.0, 2.0]
    torch.testing.assert_close(out, _scaled_reference(x * w, 2.0))
    assert w.untyped_storage().data_ptr() in asked
