"""Contracts under misuse and concurrency, on a GPU: results that view their arguments,
``bcg.live()`` in segment code, padded rows of allocations nobody dispatched, the capture
stream and cuBLAS workspaces, concurrent captures, side streams forked across a breakpoint,
runner outputs read by several threads, ``reset()`` during a replay, and the GIL during
blocking launches."""

from __future__ import annotations

import gc
import threading
import time

import pytest
import torch

import bcg

from .models import TinyLlama, positions_for, random_lengths
from .threads import run_in_threads
from .test_runner_cuda import DTYPE, HIDDEN, _poison_default_allocator, _poison_pool

pytestmark = pytest.mark.cuda

EXECUTORS = ["python", "native"]


def _capture(fn, *args, live=None, **kw):  # noqa: ANN001, ANN202
    graph = bcg.BreakableGraph()
    with bcg.capture(graph, live=live, **kw):
        out = fn(*args)
    return graph, out


def _capture_works() -> None:
    x = torch.randn(16, device="cuda")
    graph, out = _capture(lambda a: a * 3 + 1, x)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert torch.equal(out, x * 3 + 1)
    graph.reset()


# -- 1. a returned view of an argument is never written back into the argument -----------------


def test_a_returned_window_of_an_argument_is_bridged_not_written_into_it() -> None:
    @bcg.breakpoint
    def window(b: torch.Tensor) -> torch.Tensor:
        s = bcg.live()
        return b[s : s + 10]

    x = torch.randn(100, device="cuda")

    def fn(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b = a * 2
        w = window(b)
        return w + 1, b

    graph, (out, b) = _capture(fn, x, live=0)
    for start in (50, 0, 90, 7):
        x.copy_(torch.randn_like(x))
        graph.replay(live=start)
        assert torch.equal(b, x * 2), "the argument was overwritten by its own window"
        assert torch.equal(out, (x * 2)[start : start + 10] + 1)


def test_a_pass_through_that_stops_passing_through_raises_and_leaves_the_argument() -> None:
    @bcg.breakpoint
    def maybe_scale(t: torch.Tensor) -> torch.Tensor:
        return t if bcg.live() == "off" else t * 3

    x = torch.randn(64, device="cuda")

    def fn(a: torch.Tensor) -> torch.Tensor:
        h = a + 1
        y = maybe_scale(h)
        return y + h  # reads the argument after the breakpoint too

    graph, out = _capture(fn, x, live="off")
    x.copy_(torch.randn_like(x))
    with pytest.raises(bcg.errors.BreakpointOutputMismatch, match="itself at capture"):
        graph.replay(live="on")
    graph.replay(live="off")  # still replayable, and right
    assert torch.equal(out, (x + 1) * 2)


# -- 2. bcg.live() read by segment code is refused at capture ---------------------------------------


def test_live_read_by_segment_code_raises_naming_the_line_and_leaves_cuda_clean() -> None:
    x = torch.randn(32, device="cuda")
    graph = bcg.BreakableGraph()
    with pytest.raises(bcg.errors.LiveReadInSegmentError, match=r"test_contracts_cuda.py:\d+: x \* bcg.live\(\)"):
        with bcg.capture(graph, live=2.0):
            x * bcg.live()
    assert not graph.is_captured and gc.isenabled()
    _capture_works()


def test_live_with_static_ok_is_frozen_into_the_graph_as_declared() -> None:
    x = torch.randn(32, device="cuda")
    graph, out = _capture(lambda a: a * bcg.live(static_ok=True), x, live=2.0)
    graph.replay(live=3.0)
    assert torch.equal(out, x * 2.0)  # the documented meaning of static_ok


# -- 3. padded rows of tensors allocated where no dispatch mode looks --------------------------------


def _undispatched_empty_like(t: torch.Tensor) -> torch.Tensor:
    """An allocation no TorchDispatchMode sees, as an extension's or compiled code's would be."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        return torch.empty_like(t)


@bcg.breakpoint(mutates=("out",))
def _write_real_rows(h: torch.Tensor, out: torch.Tensor) -> None:
    T = sum(bcg.live()["lengths"])
    out[:T] = h[:T] * 0.5


@bcg.breakpoint
def _undispatched_result(h: torch.Tensor) -> torch.Tensor:
    T = sum(bcg.live()["lengths"])
    with torch.utils._python_dispatch._disable_current_modes():
        out = torch.full_like(h, float("nan"))
    out[:T] = torch.tanh(h[:T])
    return out


class _Undispatched(torch.nn.Module):
    """Each breakpoint leaves padded rows unwritten in memory nobody dispatched; sums over
    tokens follow, so a padded row that is not zero changes the real rows."""

    def __init__(self, compiled: bool) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.a = torch.nn.Linear(HIDDEN, HIDDEN, device="cuda", dtype=DTYPE)
        self.b = torch.nn.Linear(HIDDEN, HIDDEN, device="cuda", dtype=DTYPE)
        self.region = torch.compile(self._region, dynamic=True) if compiled else self._region_hidden

    def _region(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.a(x))
        return h, torch.empty_like(h)  # allocated inside compiled code

    def _region_hidden(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.a(x))
        return h, _undispatched_empty_like(h)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, zero_padding: bool = False) -> torch.Tensor:
        h, o = self.region(x)
        _write_real_rows(h, o)
        r = _undispatched_result(h)
        if zero_padding:  # the reference: what the runner must make of the padded rows
            T = sum(bcg.live()["lengths"])
            o[T:] = 0
            r[T:] = 0
        mixed = o + r
        return self.b(mixed + mixed.sum(0, keepdim=True) / 1024)


@pytest.mark.parametrize("compiled", [False, True], ids=["extension-like", "torch.compile"])
def test_padded_rows_are_zeroed_whoever_allocated_the_tensor(compiled: bool) -> None:
    model = _Undispatched(compiled)
    stream = torch.cuda.Stream()
    pool = bcg.graph_pool_handle()
    poison = _poison_pool(pool, stream)
    example = (torch.randn(8, HIDDEN, device="cuda", dtype=DTYPE), torch.arange(8, device="cuda"))
    runner = bcg.GraphRunner(model, [64, 256], example_inputs=example, live=lambda n: {"lengths": [n]},
                             pool=pool, stream=stream, progress=False).capture()
    assert runner.captured_buckets == [64, 256]
    gen = torch.Generator().manual_seed(9)
    for T in (1, 5, 63, 65, 200):
        lengths = random_lengths(T, min(T, 3), gen) if T > 2 else [T]
        x = torch.randn(T, HIDDEN, generator=gen).to("cuda", DTYPE)
        live = {"lengths": lengths}
        _poison_default_allocator()
        y = runner(x, positions_for(lengths, T, "cuda"), live=live)
        n = runner.bucket_for(T)
        full = runner.bucket_outputs(n)
        assert torch.isfinite(full).all(), f"NaN/inf in the padded rows of bucket {n} at T={T}"
        xp = torch.zeros(n, HIDDEN, device="cuda", dtype=DTYPE)
        xp[:T] = x
        with bcg.live_scope(live), torch.no_grad():  # the same kernels on the padded input, padding zeroed
            expected = model(xp, positions_for(lengths, n, "cuda"), zero_padding=True)[:T]
        assert torch.equal(y, expected), f"T={T}: padded rows that were not zero reached the real rows"
    runner.reset()
    del poison


# -- 4. one capture stream: cuBLAS's per-stream workspace does not leak -------------------------------


def test_twenty_captures_with_a_matmul_keep_reserved_memory_flat() -> None:
    w = torch.randn(512, 512, device="cuda")
    x = torch.randn(64, 512, device="cuda")

    @bcg.breakpoint
    def bump(t: torch.Tensor) -> None:
        t.add_(1)

    def fn(a: torch.Tensor) -> torch.Tensor:
        h = a @ w  # the first GEMM of each capture runs inside a segment
        bump(h)
        return h @ w

    reserved = []
    for cycle in range(20):
        graph, out = _capture(fn, x) if cycle % 2 else (bcg.make_graph(fn, x), None)
        out = graph.outputs if out is None else out
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.testing.assert_close(out, ((x @ w) + 1) @ w)
        del out
        graph.reset()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        reserved.append(torch.cuda.memory_reserved())
    assert max(reserved[1:]) <= reserved[1], [r >> 20 for r in reserved]


# -- 5. captures on two threads at once --------------------------------------------------------------


def test_two_threads_capturing_at_once_both_succeed() -> None:
    """In global mode one thread's capture is invalidated by another's device synchronize
    (which every capture begins with): captures are serialized, so both threads succeed.
    The threads do nothing but capture while the other may be capturing."""
    start = threading.Barrier(2)
    made: dict[int, tuple] = {}
    T = 64

    def work(seed: int) -> None:
        torch.manual_seed(seed)
        model = TinyLlama(layers=4, hidden=128, heads=4, kv_heads=2, intermediate=256)
        x = torch.randn(T, 128, device="cuda", dtype=torch.bfloat16)
        pos = positions_for([T], T, "cuda")
        with bcg.live_scope({"lengths": [T]}):
            model(x, pos)
        torch.cuda.synchronize()
        start.wait()
        graphs = [bcg.make_graph(model, x, pos, live={"lengths": [T]}) for _ in range(4)]
        made[seed] = (model, x, pos, graphs)

    errors = run_in_threads(work, (1, 2))
    assert not errors, errors
    assert gc.isenabled()
    gen = torch.Generator().manual_seed(0)
    for model, x, pos, graphs in made.values():
        for graph in graphs:
            lengths = random_lengths(T, 3, gen)
            x.copy_(torch.randn(T, 128, generator=gen).to("cuda", torch.bfloat16))
            pos.copy_(positions_for(lengths, T, "cuda"))
            out = graph.replay(live={"lengths": lengths})
            with bcg.live_scope({"lengths": lengths}):
                assert torch.equal(out, model(x, pos))
            graph.reset()


def test_two_runners_capturing_on_two_threads() -> None:
    runners: dict[int, tuple[bcg.GraphRunner, TinyLlama]] = {}
    start = threading.Barrier(2)

    def work(seed: int) -> None:
        torch.manual_seed(seed)
        model = TinyLlama(layers=2, hidden=HIDDEN, heads=8, kv_heads=2, intermediate=512)
        example = (torch.randn(8, HIDDEN, device="cuda", dtype=DTYPE), torch.arange(8, device="cuda"))
        runner = bcg.GraphRunner(model, [16, 32, 64, 128], example_inputs=example,
                                 live=lambda n: {"lengths": [n]}, progress=False)
        torch.cuda.synchronize()
        start.wait()
        runner.capture()
        runners[seed] = (runner, model)

    errors = run_in_threads(work, (1, 2))
    assert not errors, errors
    T, n = 40, 64
    for runner, model in runners.values():
        assert runner.failed_buckets == {} and runner.captured_buckets == [16, 32, 64, 128]
        x = torch.randn(T, HIDDEN, device="cuda", dtype=DTYPE)
        xp = torch.zeros(n, HIDDEN, device="cuda", dtype=DTYPE)
        xp[:T] = x
        with bcg.live_scope({"lengths": [T]}), torch.no_grad():
            expected = model(xp, positions_for([T], n, "cuda"))[:T]  # the same kernels as bucket 64
        assert torch.equal(runner(x, positions_for([T], T, "cuda"), live={"lengths": [T]}), expected)
        runner.reset()


# -- 6. a side stream forked across a breakpoint -------------------------------------------------------


def test_a_fork_joined_after_a_breakpoint_is_named_not_called_a_host_sync() -> None:
    side = torch.cuda.Stream()

    @bcg.breakpoint
    def bp(t: torch.Tensor) -> None:
        t.add_(1)

    x = torch.randn(1 << 16, device="cuda")

    def fn(a: torch.Tensor) -> torch.Tensor:
        main = torch.cuda.current_stream()
        h = a * 2
        side.wait_stream(main)
        with torch.cuda.stream(side):
            prefetch = a.exp()  # overlapped with the breakpoint, the user hopes
        bp(h)
        main.wait_stream(side)  # joined after the breakpoint
        return h + prefetch

    fn(x)  # warm up
    with pytest.raises(bcg.errors.StreamForkError) as info:
        _capture(fn, x)
    message = str(info.value)
    assert "Segment 0 forked work to a side stream" in message
    assert "breakpoint" in message and "bp" in message
    assert f"{int(side.cuda_stream):#x}" in message  # names the stream
    assert "test_contracts_cuda.py" in message and "wait_stream(side)" in message
    assert not isinstance(info.value, bcg.errors.HostSyncInCaptureError)
    _capture_works()


# -- 7. runner outputs and threads ------------------------------------------------------------------------


def _threaded_runner() -> tuple[bcg.GraphRunner, list[tuple[torch.Tensor, torch.Tensor, dict, torch.Tensor]]]:
    torch.manual_seed(0)
    model = TinyLlama(layers=4, hidden=HIDDEN, heads=8, kv_heads=2, intermediate=1024)
    example = (torch.randn(8, HIDDEN, device="cuda", dtype=DTYPE), torch.arange(8, device="cuda"))
    runner = bcg.GraphRunner(model, [64, 128], example_inputs=example,
                             live=lambda n: {"lengths": [n]}, progress=False).capture()
    gen = torch.Generator().manual_seed(1)
    cases = []
    for T in (20, 64, 100, 128):
        lengths = random_lengths(T, 2, gen)
        x = torch.randn(T, HIDDEN, generator=gen).to("cuda", DTYPE)
        pos = positions_for(lengths, T, "cuda")
        cases.append((x, pos, {"lengths": lengths}, runner(x, pos, live={"lengths": lengths}).clone()))
    return runner, cases


def test_four_threads_get_their_own_results_in_graph_mode() -> None:
    """Each thread on its own stream, as a server's workers are: a result read after the call
    returns must be this call's, not a later call's from another thread."""
    runner, cases = _threaded_runner()
    wrong = []

    def work(i: int) -> None:
        x, pos, live, expected = cases[i]
        with torch.cuda.stream(torch.cuda.Stream()):
            for k in range(300):
                y = runner(x, pos, live=live)
                time.sleep(0.001)  # this thread's host work (another thread's call may run meanwhile)
                torch.cuda._sleep(100_000)  # and its GPU work, before it reads the result
                if not torch.equal(y.clone(), expected):  # read after the lock is released
                    wrong.append((i, k))

    assert not run_in_threads(work, range(4))
    assert wrong == [], f"{len(wrong)} of 1200 results were another thread's"


def test_locked_block_returns_views_that_no_other_thread_overwrites() -> None:
    runner, cases = _threaded_runner()
    static = {runner.bucket_outputs(n).data_ptr() for n in (64, 128)}
    wrong, views = [], []

    def work(i: int) -> None:
        x, pos, live, expected = cases[i]
        with torch.cuda.stream(torch.cuda.Stream()):
            for k in range(150):
                with runner.locked():
                    y = runner(x, pos, live=live)
                    time.sleep(0.001)
                    torch.cuda._sleep(100_000)
                    views.append(y.data_ptr() in static)
                    if not torch.equal(y, expected):
                        wrong.append((i, k))

    assert not run_in_threads(work, range(4))
    assert wrong == [] and all(views)


@pytest.mark.parametrize("first", ["default", "side"])
def test_a_call_on_another_stream_runs_after_the_last_call_whichever_stream_that_was(first: str) -> None:
    """The first call's replay is held up on its stream (a busy GPU); a call on another stream
    must still run after it, so its view holds its own result, not the first call's. torch's
    default stream has a null raw handle, which ``torch.cuda.ExternalStream`` does not accept."""
    runner, cases = _threaded_runner()
    (xa, pa, la, _), (xb, pb, lb, expected_b) = cases[2], cases[3]  # both in bucket 128
    streams = {"default": torch.cuda.default_stream(), "side": torch.cuda.Stream()}
    first_stream, second_stream = streams[first], streams["side" if first == "default" else "default"]
    torch.cuda.synchronize()
    with torch.cuda.stream(first_stream):
        torch.cuda._sleep(50_000_000)  # tens of ms: the second call is queued long before this ends
        runner(xa, pa, live=la)
    with torch.cuda.stream(second_stream):
        y = runner(xb, pb, live=lb)
    torch.cuda.synchronize()
    assert torch.equal(y, expected_b)


# -- 8. reset() during a replay is refused ----------------------------------------------------------


@pytest.mark.parametrize("executor", EXECUTORS)
def test_reset_from_a_breakpoint_is_refused_and_the_graph_stays_usable(executor: str) -> None:
    holder: dict[str, bcg.BreakableGraph] = {}
    refused: list[BaseException] = []

    @bcg.breakpoint
    def meddle(t: torch.Tensor) -> None:
        t.mul_(2)
        if bcg.live() == "reset":
            try:
                holder["graph"].reset()
            except bcg.ReplayError as exc:
                refused.append(exc)

    x = torch.randn(256, device="cuda")

    def fn(a: torch.Tensor) -> torch.Tensor:
        h = a + 1
        meddle(h)
        return h.sin()

    graph, out = _capture(fn, x, live="no")
    graph.use_executor(executor)
    holder["graph"] = graph
    graph.replay(live="reset")
    assert len(refused) == 1 and "while this graph is replaying" in str(refused[0])
    x.copy_(torch.randn_like(x))
    graph.replay(live="no")
    assert torch.equal(out, ((x + 1) * 2).sin())
    graph.reset()  # after the replay: fine


@pytest.mark.parametrize("executor", EXECUTORS)
def test_reset_from_another_thread_during_a_replay_is_refused(executor: str) -> None:
    entered, done = threading.Event(), threading.Event()
    outcome: list[object] = []

    @bcg.breakpoint
    def slow(t: torch.Tensor) -> None:
        t.add_(1)
        if bcg.live():
            entered.set()
            done.wait(10)  # releases the GIL, as a breakpoint waiting on I/O would

    x = torch.randn(64, device="cuda")
    graph, out = _capture(lambda a: slow(a * 2) or a.cos(), x, live=False)
    graph.use_executor(executor)

    def meddler() -> None:
        entered.wait(10)
        try:
            graph.reset()
            outcome.append("reset")
        except bcg.ReplayError as exc:
            outcome.append(exc)
        done.set()

    thread = threading.Thread(target=meddler)
    thread.start()
    graph.replay(live=True)
    thread.join()
    assert len(outcome) == 1 and isinstance(outcome[0], bcg.ReplayError)
    graph.replay(live=False)
    torch.testing.assert_close(out, x.cos(), rtol=0, atol=0)


# -- 9. the GIL is released while a launch blocks --------------------------------------------------------


@pytest.mark.parametrize("executor", EXECUTORS)
def test_other_threads_run_while_a_replay_blocks_on_a_full_launch_queue(executor: str) -> None:
    x = torch.zeros(16, device="cuda")

    def fn(a: torch.Tensor) -> torch.Tensor:
        for _ in range(8):
            a.add_(1)
            bcg.graph_break()
        return a

    graph, _ = _capture(fn, x)
    graph.use_executor(executor)
    stop = threading.Event()
    gaps: list[float] = []

    def ticker() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
            time.sleep(0.001)

    torch.cuda.synchronize()
    thread = threading.Thread(target=ticker)
    thread.start()
    time.sleep(0.05)
    torch.cuda._sleep(int(3e9))  # ~1.5 s of GPU spin: the launch queue fills behind it
    t0 = time.perf_counter()
    for _ in range(3000):  # 24,000 launches
        graph.replay()
    blocked = time.perf_counter() - t0
    stop.set()
    thread.join()
    torch.cuda.synchronize()
    assert blocked > 0.5, f"the launches never blocked ({blocked:.2f} s): the test proves nothing"
    assert max(gaps) < 0.25, f"another thread was stalled for {max(gaps):.2f} s while launches blocked"


# -- 7b. Captures are ordered after the last replay, on whatever stream -----------------------------

_SLEEP_BEFORE_READ = 200_000_000  # cycles: about 100 ms, far longer than the host's way to a capture


def _sleeps_at_8(x: torch.Tensor) -> torch.Tensor:
    if x.shape[0] == 8:  # only bucket 8's graph sleeps, before it reads its input
        torch.cuda._sleep(_SLEEP_BEFORE_READ)
    return x * 2 + 1


def _lazy_runner_with_bucket_8() -> bcg.GraphRunner:
    """Buckets 4 and 8, lazy; 8 captured. Bucket 4's capture loads the example (-5) into the
    static inputs that bucket 8's graph reads."""
    runner = bcg.GraphRunner(_sleeps_at_8, [4, 8], example_inputs=(torch.full((8, 16), -5.0, device="cuda"),),
                             lazy=True, copy_outputs=True, progress=False)
    x = torch.randn(8, 16, device="cuda")
    runner(x)  # eager, then bucket 8 captured
    assert runner.captured_buckets == [8] and torch.equal(runner(x), x * 2 + 1)
    torch.cuda.synchronize()
    return runner


@pytest.mark.parametrize("driver", ["lazy, replay on the default stream", "lazy, replay on a side stream",
                                    "capture()", "capture(background=True)"])
def test_a_capture_waits_for_the_last_replay_on_another_stream(driver: str) -> None:
    """The replay of bucket 8 reads its static input about 100 ms after its call returns; a
    capture of bucket 4 meanwhile, from a call or ``capture()`` on another stream, must not load
    its example into that input before the replay has read it."""
    runner = _lazy_runner_with_bucket_8()
    side, default = torch.cuda.Stream(), torch.cuda.default_stream()
    replay_on, capture_on = (side, default) if "default stream" not in driver else (default, side)
    x8, x3 = torch.randn(8, 16, device="cuda"), torch.randn(3, 16, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(replay_on):
        y = runner(x8)
    with torch.cuda.stream(capture_on):
        if driver.startswith("lazy"):
            assert torch.equal(runner(x3), x3 * 2 + 1)  # bucket 4: eager, then captured
        else:
            runner.capture(background=driver.endswith("True)"))
            assert runner.wait_captured(60)
    torch.cuda.synchronize()
    assert runner.captured_buckets == [4, 8]
    wrong = (~(y == x8 * 2 + 1).all(dim=1)).nonzero().flatten().tolist()
    assert wrong == [], f"rows {wrong} of the replay read the capture's example"


def test_an_eager_mode_call_on_another_stream_waits_for_the_last_call() -> None:
    """``mode="eager"`` runs ``forward`` on the same static inputs: the first call's run reads
    them about 100 ms late (a busy GPU); the second call, on another stream, must not write
    them before."""
    runner = bcg.GraphRunner(_sleeps_at_8, [4, 8], example_inputs=(torch.zeros(8, 16, device="cuda"),),
                             mode="eager", copy_outputs=True, progress=False).capture()
    xa, xb = torch.randn(8, 16, device="cuda"), torch.randn(8, 16, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(torch.cuda.Stream()):
        ya = runner(xa)
    yb = runner(xb)
    torch.cuda.synchronize()
    assert torch.equal(ya, xa * 2 + 1) and torch.equal(yb, xb * 2 + 1)
