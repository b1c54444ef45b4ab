"""The native executor (``bcg._native``) on a GPU: the same results as the Python executor,
RNG bookkeeping, errors, streams, threads, and back-to-back replays (its speed: `bcg-bench --workload micro`)."""

from __future__ import annotations


import threading
import warnings

import pytest
import torch

import bcg
from bcg.core import native

pytestmark = pytest.mark.cuda

BREAKPOINT_NOTE = (
    "bcg: raised by breakpoint {!r} during replay; the segments after it did not run "
    "and the graph stays replayable"
)


@pytest.fixture(autouse=True)
def _native_ready(monkeypatch: pytest.MonkeyPatch) -> None:
    # On a GPU machine the extension and the driver must both be there: fail, not skip.
    assert native.available(), native.why_unavailable()
    assert native.driver_error() is None, native.driver_error()
    monkeypatch.delenv("BCG_NATIVE", raising=False)


def _capture(fn, *args, live=None):  # noqa: ANN001, ANN202
    graph = bcg.BreakableGraph()
    with bcg.capture(graph, live=live):
        out = fn(*args)
    return graph, out


def _assert_cuda_works() -> None:
    x = torch.randn(256, device="cuda")
    torch.testing.assert_close((x * 2).sum().item(), x.sum().item() * 2, rtol=1e-4, atol=1e-4)


# -- a small model with breakpoints: bit-identical to the Python executor -----------------------


@bcg.breakpoint
def host_gate(h: torch.Tensor) -> torch.Tensor:
    """Needs the host (``.item()``) and the live scale: cannot be captured."""
    sign = 1.0 if h.sum().item() >= 0 else -1.0
    return h * (sign * bcg.live())


@bcg.breakpoint
def clamp_in_place(h: torch.Tensor) -> None:
    h.clamp_(-3.0, 3.0)


class SmallModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = torch.nn.Linear(64, 128)
        self.l2 = torch.nn.Linear(128, 128)
        self.l3 = torch.nn.Linear(128, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.l1(x))
        h = host_gate(h)
        h = torch.tanh(self.l2(h)) * 4
        clamp_in_place(h)
        h = self.l3(h)
        bcg.graph_break()
        return h.softmax(-1)


@pytest.mark.cuda
def test_native_and_python_executors_are_bit_identical_on_a_small_model() -> None:
    torch.manual_seed(0)
    model = SmallModel().cuda().eval()
    x = torch.randn(16, 64, device="cuda")
    with torch.no_grad():
        graph = bcg.make_graph(model, x, live=1.0)
    assert graph.executor == "native"  # the default when the extension is built
    assert graph.stats().segments == 4 and graph.stats().breakpoints == 2
    assert graph.forms[0].executor.launches == 4  # no RNG: every segment launches from C
    gen = torch.Generator(device="cpu").manual_seed(1)
    for i in range(6):
        x.copy_(torch.randn(16, 64, generator=gen))
        scale = 0.5 + i
        graph.use_executor("python")
        out_py = graph.replay(live=scale).clone()
        graph.use_executor("native")
        assert graph.executor == "native"
        out_native = graph.replay(live=scale).clone()
        assert torch.equal(out_py, out_native), f"replay {i} differs"
        with torch.no_grad(), bcg.live_scope(scale):
            ref = model(x)
        torch.testing.assert_close(out_native, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.cuda
def test_bcg_native_0_makes_captures_replay_with_python(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BCG_NATIVE", "0")
    x = torch.randn(8, device="cuda")
    graph, out = _capture(lambda a: (a + 1) * 2, x)
    assert graph.executor == "python"
    graph.use_executor("native")  # an explicit request still works
    assert graph.executor == "native"
    graph.replay()
    torch.testing.assert_close(out, (x + 1) * 2, rtol=0, atol=0)
    graph.use_executor(None)
    assert graph.executor == "python"


# -- RNG: segments that use it go through torch's replay -----------------------------------------


@bcg.breakpoint
def noop(t: torch.Tensor) -> None:
    t.add_(0)


def _rng_fn(a: torch.Tensor) -> torch.Tensor:
    h = a * 3  # segment 0: no RNG
    noop(h)
    d = torch.nn.functional.dropout(h, p=0.5)  # segment 1: RNG
    noop(d)
    return d + 1  # segment 2: no RNG


@pytest.mark.cuda
def test_rng_segment_gives_fresh_numbers_and_advances_the_generator_like_python() -> None:
    x = torch.ones(1 << 14, device="cuda")
    graph, out = _capture(_rng_fn, x)
    assert [s.uses_rng for s in graph.forms[0].segments] == [False, True, False]
    assert graph.executor == "native"
    assert graph.forms[0].executor.launches == 2
    gen = torch.cuda.default_generators[torch.cuda.current_device()]

    seen = []
    for _ in range(4):
        graph.replay()
        seen.append(out.clone())
    for i, s in enumerate(seen):
        keep = (s != 1).float().mean().item()
        assert 0.4 < keep < 0.6
        assert set(s.unique().tolist()) <= {1.0, 7.0}  # 3 / (1 - p) + 1 where kept
        for j in range(i):
            assert not torch.equal(s, seen[j])

    deltas = {}
    for name in ("python", "native", "python", "native"):
        graph.use_executor(name)
        before = gen.get_offset()
        graph.replay()
        deltas.setdefault(name, set()).add(gen.get_offset() - before)
    assert deltas["native"] == deltas["python"]
    assert len(deltas["native"]) == 1 and next(iter(deltas["native"])) > 0

    outs = {}
    for name in ("python", "native"):
        graph.use_executor(name)
        torch.cuda.manual_seed(1234)
        graph.replay()
        outs[name] = out.clone()
    assert torch.equal(outs["python"], outs["native"])


# -- errors ------------------------------------------------------------------------------------


@pytest.mark.cuda
def test_breakpoint_raising_inside_the_native_loop_propagates_and_graph_stays_replayable() -> None:
    class BackendDown(Exception):
        pass

    @bcg.breakpoint
    def flaky(t: torch.Tensor) -> None:
        if bcg.live() == "fail":
            raise BackendDown("backend unavailable")
        t.mul_(2)

    x = torch.randn(64, device="cuda")

    def fn(a: torch.Tensor) -> torch.Tensor:
        h = a + 1
        flaky(h)
        return h - 1

    graph, out = _capture(fn, x, live="ok")
    assert graph.executor == "native"
    for _ in range(3):
        with pytest.raises(BackendDown, match="backend unavailable") as info:
            graph.replay(live="fail")
        assert info.value.__notes__ == [BREAKPOINT_NOTE.format(flaky.__bcg_breakpoint__.name)]
        x.copy_(torch.randn_like(x))
        graph.replay(live="ok")
        torch.testing.assert_close(out, (x + 1) * 2 - 1, rtol=0, atol=0)
    _assert_cuda_works()


@pytest.mark.cuda
def test_an_invalid_handle_is_a_clear_error_not_a_crash() -> None:
    mod = native.module()
    calls: list[str] = []
    plan = mod.Plan((lambda: calls.append("before"), 0, lambda: calls.append("after")))
    stream = torch.cuda.current_stream().cuda_stream
    with pytest.raises(bcg.ReplayError, match=r"cuGraphLaunch failed at step 1: CUDA_ERROR_[A-Z_]+") as info:
        plan.replay(stream, torch.cuda.current_device())
    assert isinstance(info.value, RuntimeError)
    assert info.value.step == 1 and info.value.cuda_error.startswith("CUDA_ERROR_")
    assert plan.failed_step == 1 and calls == ["before"]
    torch.cuda.synchronize()
    _assert_cuda_works()


@pytest.mark.cuda
def test_replaying_inside_another_capture_is_refused() -> None:
    x = torch.randn(64, device="cuda")
    graph, out = _capture(_rng_free_fn, x)
    assert graph.executor == "native"
    outer = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the outer graph ends up empty
        with pytest.raises(bcg.ReplayError, match="stream that is capturing a CUDA graph"):
            with torch.cuda.graph(outer, stream=side):
                graph.replay()
    torch.cuda.synchronize()
    graph.replay()
    torch.testing.assert_close(out, x.sin().cos(), rtol=0, atol=0)
    _assert_cuda_works()


# -- streams and threads ------------------------------------------------------------------------


@pytest.mark.cuda
def test_native_replay_runs_on_the_callers_current_stream() -> None:
    x = torch.randn(1 << 16, device="cuda")

    def fn(a: torch.Tensor) -> torch.Tensor:
        h = a * 2
        noop(h)
        return h + 1

    graph, out = _capture(fn, x)
    assert graph.executor == "native"
    side = torch.cuda.Stream()
    # Twice: the first round loads lazily loaded kernels (the side stream's fill, the sleep),
    # and loading a kernel module waits for the busy device, which would void the check.
    for _ in range(2):
        torch.cuda.synchronize()
        torch.cuda._sleep(1_000_000_000)  # keep the default stream busy (about half a second)
        with torch.cuda.stream(side):
            x2 = torch.full_like(x, 3.0)  # allocated and filled on the side stream
            x.copy_(x2)
            graph.replay()
            result = out.clone()
        side.synchronize()
        busy = not torch.cuda.default_stream().query()
        torch.cuda.synchronize()
    assert busy, "the default stream finished first: the check is inconclusive"
    # had a segment gone to the default stream it would still be queued behind the sleep
    assert torch.equal(result, torch.full_like(x, 7.0))


@pytest.mark.cuda
def test_native_replay_from_a_fresh_thread() -> None:
    x = torch.randn(1024, device="cuda")
    graph, out = _capture(_rng_free_fn, x)
    assert graph.executor == "native"
    graph.replay()
    expected = out.clone()
    result: dict[str, object] = {}

    def worker() -> None:
        try:
            for _ in range(3):
                graph.replay()
            torch.cuda.current_stream().synchronize()
            result["out"] = out.clone()
            torch.cuda.synchronize()
        except BaseException as exc:  # noqa: BLE001 - reported below
            result["error"] = exc

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert "error" not in result, result.get("error")
    assert torch.equal(result["out"], expected)


def _rng_free_fn(a: torch.Tensor) -> torch.Tensor:
    h = a.sin()
    noop(h)
    return h.cos()


# -- back-to-back replays ---------------------------------------------------------------------------
# (How fast each executor launches is a benchmark's question: `bcg-bench --workload micro --modes
# floor,bcg,bcg-python`, whose rows give the host time per segment; no timed test asserts it.)


@pytest.mark.cuda
def test_back_to_back_replays_run_every_segment_once_with_either_executor() -> None:
    """Replays queued back to back, with no synchronize between them, each launch every segment
    once, in order, whichever executor runs them: the native one launches one graph per segment."""
    from bcg.core.replay import PythonExecutor

    segments = 32
    x = torch.zeros(64, device="cuda")

    def fn(a: torch.Tensor) -> torch.Tensor:
        for i in range(segments):
            a.mul_(2.0 if i % 2 else 1.0).add_(1)  # not commutative: a segment run twice or out of order shows
            bcg.graph_break()
        return a

    graph, _ = _capture(fn, x)
    assert graph.stats().segments == segments and graph.stats().breakpoints == 0
    graph.use_executor("native")
    assert graph.executor == "native" and graph.forms[0].executor.launches == segments
    start = torch.rand(64, device="cuda")
    expected = start.clone()
    for _ in range(3):
        fn(expected)
    for run in (graph.replay, PythonExecutor(graph.plan).run):
        x.copy_(start)
        for _ in range(3):
            run()
        torch.cuda.synchronize()
        torch.testing.assert_close(x, expected, rtol=0, atol=0)
