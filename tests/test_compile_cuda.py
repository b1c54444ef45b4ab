"""torch.compile'd code captured by bcg on a GPU: Inductor kernels inside segments.

"Compiled eager" is the compiled model called normally; bcg must replay exactly
its kernels, so outputs are compared bitwise.
"""

from __future__ import annotations

import logging
import random

import pytest
import torch

import bcg

from .models import TinyLlama, positions_for, random_lengths

pytestmark = pytest.mark.cuda

HIDDEN = 128
T = 48


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _graphs_compiled() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _inputs(gen: torch.Generator, total: int = T) -> tuple[torch.Tensor, torch.Tensor, dict]:
    lengths = random_lengths(total, 1 + int(torch.randint(0, 4, (1,), generator=gen)), gen)
    x = torch.randn(total, HIDDEN, generator=gen).to("cuda", torch.bfloat16)
    return x, positions_for(lengths, total, "cuda"), {"lengths": lengths}


def _compiled_eager(fn, x: torch.Tensor, pos: torch.Tensor, live: dict) -> torch.Tensor:  # noqa: ANN001
    with bcg.live_scope(live), torch.no_grad():
        return fn(x, pos).clone()


def _replays_match_compiled_eager(compiled, samples: int) -> bcg.BreakableGraph:  # noqa: ANN001
    gen = torch.Generator().manual_seed(1)
    x, pos, live = _inputs(gen)
    with torch.no_grad():
        graph = bcg.make_graph(compiled, x, pos, live=live)
    assert graph.stats().breakpoints == 2 and graph.stats().segments == 3
    assert all(k > 0 for k in graph.stats().nodes)  # Inductor's kernels are in the segments
    for _ in range(samples):
        fx, fpos, flive = _inputs(gen)
        x.copy_(fx)
        pos.copy_(fpos)
        out = graph.replay(live=flive)
        torch.cuda.synchronize()
        assert torch.equal(out, _compiled_eager(compiled, fx, fpos, flive))
    return graph


def test_compiled_model_replays_its_inductor_kernels_bit_identically() -> None:
    model = TinyLlama(layers=2, hidden=HIDDEN, heads=4, kv_heads=2, intermediate=256)
    compiled = torch.compile(model)
    graph = _replays_match_compiled_eager(compiled, samples=20)
    graph.reset()


def test_reduce_overhead_is_switched_off_during_the_capture() -> None:
    """Inductor's own CUDA graphs do not run inside a bcg capture; they do again after it."""
    import torch._inductor.config as inductor_config

    model = TinyLlama(layers=2, hidden=HIDDEN, heads=4, kv_heads=2, intermediate=256)
    compiled = torch.compile(model, mode="reduce-overhead")
    gen = torch.Generator().manual_seed(3)
    x, pos, live = _inputs(gen)
    before = inductor_config.triton.cudagraph_capture_sizes
    for _ in range(3):  # Inductor warms up, then records its own graphs, outside bcg
        _compiled_eager(compiled, x, pos, live)
    graph = _replays_match_compiled_eager(compiled, samples=5)
    assert inductor_config.triton.cudagraph_capture_sizes == before  # restored after the capture
    graph.reset()


def test_runner_recompiles_per_bucket_outside_the_capture(caplog: pytest.LogCaptureFixture) -> None:
    """A static compile: each new bucket recompiles during its warm-up, never inside a capture."""
    model = TinyLlama(layers=2, hidden=HIDDEN, heads=4, kv_heads=2, intermediate=256)
    compiled = torch.compile(model, dynamic=False)
    buckets = [16, 32, 64]
    example = (torch.randn(8, HIDDEN, device="cuda", dtype=torch.bfloat16), torch.arange(8, device="cuda"))
    graphs0 = _graphs_compiled()
    with caplog.at_level(logging.WARNING, logger="bcg"):
        runner = bcg.GraphRunner(compiled, buckets, example_inputs=example,
                                 live=lambda n: {"lengths": [n]}, progress=False).capture()
    assert _graphs_compiled() - graphs0 >= len(buckets)  # one static compile (at least) per bucket
    assert not [r for r in caplog.records if "compiled" in r.getMessage()]  # none during a capture
    assert runner.stats()["failed_buckets"] == {}
    gen = torch.Generator().manual_seed(5)
    for n in buckets:
        x, pos, live = _inputs(gen, n)
        out = runner(x, pos, live=live)
        torch.cuda.synchronize()
        assert torch.equal(out, _compiled_eager(compiled, x, pos, live)), n
    runner.reset()


def test_dynamic_compile_serves_every_bucket_from_one_compile() -> None:
    model = TinyLlama(layers=2, hidden=HIDDEN, heads=4, kv_heads=2, intermediate=256)
    compiled = torch.compile(model, dynamic=True)
    buckets = [16, 32, 48, 64, 96]
    example = (torch.randn(8, HIDDEN, device="cuda", dtype=torch.bfloat16), torch.arange(8, device="cuda"))
    gen = torch.Generator().manual_seed(7)
    _compiled_eager(compiled, *_inputs(gen, 24))  # the one compile
    graphs0 = _graphs_compiled()
    runner = bcg.GraphRunner(compiled, buckets, example_inputs=example,
                             live=lambda n: {"lengths": [n]}, progress=False).capture()
    assert _graphs_compiled() == graphs0  # no bucket needed a new compile
    for n in random.Random(0).sample(buckets, len(buckets)):
        x, pos, live = _inputs(gen, n)
        out = runner(x, pos, live=live)
        torch.cuda.synchronize()
        assert torch.equal(out, _compiled_eager(compiled, x, pos, live)), n
    runner.reset()


def test_a_compile_inside_the_capture_is_reported(caplog: pytest.LogCaptureFixture) -> None:
    """No warm-up: Dynamo compiles during the capture; bcg says so, whether or not it broke the capture."""

    def f(x: torch.Tensor) -> torch.Tensor:
        return (x.sin() * 2).cos()

    compiled = torch.compile(f)
    x = torch.randn(64, device="cuda")
    with caplog.at_level(logging.WARNING, logger="bcg"):
        try:
            graph = bcg.make_graph(compiled, x, warmup=0)
        except Exception as exc:  # the compile broke the capture: the error says why
            notes = "\n".join(getattr(exc, "__notes__", []))
            assert "torch.compile compiled" in notes, exc
            assert not torch.cuda.is_current_stream_capturing()
        else:
            assert any("torch.compile compiled" in r.getMessage() for r in caplog.records)
            x.copy_(torch.randn(64, device="cuda"))
            assert torch.equal(graph.replay(), compiled(x))
            graph.reset()
    after = torch.randn(64, device="cuda")  # the next capture works
    graph = bcg.make_graph(compiled, after)
    torch.testing.assert_close(graph.replay(), f(after))
    graph.reset()


@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
def test_a_fullgraph_compile_keeps_its_breakpoints_as_segment_ends(backend: str) -> None:
    """A whole forward compiled with fullgraph=True: each breakpoint is one op in the compiled
    graph, and bcg captures a segment per region around them; replays equal compiled eager
    bitwise, with new live values."""
    gen = torch.Generator().manual_seed(7)
    weights = [(torch.randn(HIDDEN, HIDDEN, generator=gen) / 12).to("cuda") for _ in range(4)]

    @bcg.breakpoint(mutates="h")
    def scale(h: torch.Tensor, bias: float = 0.0) -> None:
        h.mul_(float(bcg.live())).add_(bias)

    def forward(x: torch.Tensor) -> torch.Tensor:
        h = x
        for i, w in enumerate(weights):
            h = torch.tanh(h @ w) + 0.5 * h
            scale(h, bias=0.1 * i)
        return h.sum(dim=-1, keepdim=True) * h

    compiled = torch.compile(forward, fullgraph=True, backend=backend)
    x = torch.randn(T, HIDDEN, generator=gen).to("cuda")
    with bcg.live_scope(1.0):
        compiled(x)  # compiles before the capture
    graph = bcg.make_graph(compiled, x, live=1.0)
    stats = graph.stats()
    assert (stats.breakpoints, stats.segments) == (4, 5)
    for s in (0.5, -1.25, 2.0):
        x.copy_(torch.randn(T, HIDDEN, generator=gen))
        with bcg.live_scope(s):
            expected = compiled(x).clone()
        assert torch.equal(graph.replay(live=s), expected)
    graph.reset()


def test_a_staged_breakpoint_returning_its_result_in_a_whole_compiled_forward() -> None:
    """A staged breakpoint that returns its result (``fake=``), in a forward compiled whole with
    fullgraph=True, through a runner: batches that fit replay it inline, reading the kernel's
    output where it lies; one that does not replays the breakable form, its result copied into
    the bridge. Every replay equals the compiled forward run eagerly, bitwise."""
    gen = torch.Generator().manual_seed(11)
    weights = [(torch.randn(HIDDEN, HIDDEN, generator=gen) / 12).to("cuda") for _ in range(3)]
    scale = bcg.StagingBuffer(1, dtype=torch.float32)

    def prepare(s: float) -> torch.Tensor:
        scale.write([s])
        return scale.device

    def fits(s: float) -> bool:
        return s >= 0  # negative scales: the breakable form

    def fake(h: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(h)

    @bcg.breakpoint(prepare=prepare, fits=fits, fake=fake)
    def scaled(h: torch.Tensor) -> torch.Tensor:
        s = bcg.live()  # inline: the staged device scalar; eager: the host number
        return h * s

    def forward(x: torch.Tensor) -> torch.Tensor:
        h = x
        for w in weights:
            h = scaled(torch.tanh(h @ w) + 0.5 * h)
        return h.sum(dim=-1, keepdim=True) * h

    compiled = torch.compile(forward, fullgraph=True)
    x = torch.randn(T, HIDDEN, generator=gen).to("cuda")
    runner = bcg.GraphRunner(compiled, [T], example_inputs=(x,), live=1.0, progress=False).capture()
    assert runner.graph(T).stats().breakpoints == 0  # inline: one segment
    for s in (0.5, -1.25, 2.0):
        x = torch.randn(T, HIDDEN, generator=gen).to("cuda")
        # (under no_grad, as the runner runs it: the same compiled graph and kernels; with grad on,
        # Dynamo compiles another graph, whose kernels autotune apart and may round otherwise)
        with bcg.live_scope(s), torch.no_grad():
            expected = compiled(x).clone()
        assert torch.equal(runner(x, live=s), expected), s
    stats = runner.stats()
    assert stats["graph_calls"] == 3 and stats["inline_replays"] == 2
    runner.reset()
