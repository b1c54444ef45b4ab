"""Lifetime rules that need no GPU: frees deferred while a capture runs (bcg.core.process), and the
storages a capture read, held and checked at replay (bcg.core.storages)."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from bcg.errors import StaleTensorError
from bcg.core.process import CaptureLock, on_release
from bcg.core.storages import StorageWatch, check_suspects


# -- frees that wait for captures ------------------------------------------------------------------


def test_a_free_runs_at_once_when_no_capture_runs() -> None:
    lock, ran = CaptureLock(), []
    lock.release_when_safe(lambda: ran.append(1))
    assert ran == [1] and lock.deferred == 0


def test_a_free_asked_for_inside_this_threads_capture_runs_when_it_ends() -> None:
    lock, ran = CaptureLock(), []
    with lock:
        lock.capturing += 1
        with lock:  # nested holds (the runner's, make_graph's)
            lock.release_when_safe(lambda: ran.append("a"))
            lock.release_when_safe(lambda: ran.append("b"))
        assert ran == [] and lock.deferred == 2
        lock.capturing -= 1
        assert ran == []  # still held: runs at the outermost release
    assert ran == ["a", "b"] and lock.deferred == 0


def test_a_free_from_another_thread_waits_for_the_holder_and_runs_on_its_thread() -> None:
    lock = CaptureLock()
    ran: list[str] = []
    held, asked = threading.Event(), threading.Event()

    def holder() -> None:
        with lock:
            lock.capturing += 1
            held.set()
            asked.wait(10)
            assert ran == []
            lock.capturing -= 1
        ran.append("released")

    t = threading.Thread(target=holder)
    t.start()
    held.wait(10)
    lock.release_when_safe(lambda: ran.append(threading.current_thread().name))
    asked.set()
    t.join(10)
    assert ran == [t.name, "released"]


def test_a_free_that_raises_is_logged_and_the_others_still_run(caplog: pytest.LogCaptureFixture) -> None:
    lock, ran = CaptureLock(), []

    def boom() -> None:
        raise RuntimeError("sticky CUDA error")

    with lock:
        lock.capturing += 1
        lock.release_when_safe(boom)
        lock.release_when_safe(lambda: ran.append(1))
        lock.capturing -= 1
    assert ran == [1]
    assert "deferred free" in caplog.text


def test_every_deferred_free_runs_once_under_contention() -> None:
    lock = CaptureLock()
    counts = [0] * 400
    stop = threading.Event()

    def capturer() -> None:
        while not stop.is_set():
            with lock:
                lock.capturing += 1
                lock.capturing -= 1

    def dropper(base: int) -> None:
        for i in range(100):
            lock.release_when_safe(lambda k=base + i: counts.__setitem__(k, counts[k] + 1))

    threads = [threading.Thread(target=capturer) for _ in range(2)]
    for t in threads:
        t.start()
    droppers = [threading.Thread(target=dropper, args=(100 * j,)) for j in range(4)]
    for t in droppers:
        t.start()
    for t in droppers:
        t.join(30)
    stop.set()
    for t in threads:
        t.join(30)
    with lock:
        pass  # the last queued frees, if a holder left before they were queued
    assert counts == [1] * 400


def test_on_release_frees_a_collected_owner_once_and_explicitly_once() -> None:
    freed: list[str] = []

    class Owner:
        pass

    a, b = Owner(), Owner()
    fa = on_release(a, lambda: freed.append("a"))
    on_release(b, lambda: freed.append("b"))
    fa()
    fa()
    del a
    gc.collect()
    assert freed == ["a"]
    b.cycle = b  # type: ignore[attr-defined]
    del b
    gc.collect()
    assert freed == ["a", "b"]


# -- held storages ----------------------------------------------------------------------------------


def _watch() -> StorageWatch:
    return StorageWatch(lambda op, t, ptr: True, recording=lambda: True)


def _capture(fn, *args):  # type: ignore[no-untyped-def]
    """Run ``fn`` under a watch as a capture would; return the held storages and their suspects."""
    watch = _watch()
    with watch:
        out = fn(*args)
    suspects: list = []
    return watch.held("the test's segments", suspects), suspects, out


def test_a_rebound_tensor_is_reported_with_its_shape_dtype_and_first_use() -> None:
    weights = {"w": torch.randn(16, 8)}
    x = torch.randn(4, 16)
    held, suspects, _ = _capture(lambda a: a @ weights["w"], x)
    assert len(held) == 2  # x and the weight
    check_suspects(suspects)  # nothing replaced yet
    weights["w"].copy_(torch.randn(16, 8))  # in place: the graph stays right
    check_suspects(suspects)
    weights["w"] = torch.randn(16, 8)  # rebound: only the graph holds the old storage
    with pytest.raises(StaleTensorError) as err:
        check_suspects(suspects)
    text = str(err.value)
    assert "torch.float32 tensor of shape (16, 8)" in text and "aten.mm" in text
    assert "test_lifetime_cpu.py" in text and "copy_" in text and "reset()" in text


def test_a_storage_still_held_elsewhere_is_not_reported() -> None:
    base = torch.randn(32)
    view = base[:16].view(4, 4)
    x = torch.randn(2, 4)
    keep = {"base": base}
    held, suspects, _ = _capture(lambda a, v: a @ v, x, view)
    del base
    view = None  # noqa: F841 - the only watched objects go; the storage lives on in `keep`
    gc.collect()
    check_suspects(suspects)  # posted, but the base still holds the storage
    keep.clear()
    with pytest.raises(StaleTensorError):
        check_suspects(suspects)


def test_tensors_bcg_holds_itself_do_not_count_as_holders() -> None:
    cache = {"k": torch.randn(8, 8)}
    x = torch.randn(8, 8)
    held, suspects, _ = _capture(lambda a: a + cache["k"], x)
    storage = cache["k"].untyped_storage()
    alias = torch.empty(0).set_(storage, 0, (4, 8), (8, 1))  # held as a breakpoint step holds an argument
    del storage
    held.set_bcg_tensors(lambda: [alias])
    cache.clear()
    gc.collect()
    with pytest.raises(StaleTensorError):
        check_suspects(suspects)


def test_nothing_is_held_while_not_recording_and_release_stops_the_checks() -> None:
    w = {"w": torch.randn(4, 4)}
    watch = StorageWatch(lambda op, t, ptr: True, recording=lambda: False)
    with watch:
        torch.randn(2, 4) @ w["w"]
    assert len(watch.held("x", [])) == 0
    held, suspects, _ = _capture(lambda: torch.ones(2, 4) @ w["w"])
    w.clear()
    gc.collect()
    assert suspects
    held.release()
    assert not suspects
    check_suspects(suspects)


def test_compiled_code_stays_compiled_under_the_watch_and_its_inputs_are_found() -> None:
    from torch._dynamo.utils import counters

    lin = torch.nn.Linear(32, 32, bias=False)
    compiled = torch.compile(lambda a: torch.nn.functional.linear(a, lin.weight).relu())
    x = torch.randn(4, 32)
    with torch.no_grad():
        expected = compiled(x)
        graphs = counters["stats"]["unique_graphs"]
        held, suspects, out = _capture(compiled, x)
    assert counters["stats"]["unique_graphs"] == graphs  # no recompilation
    torch.testing.assert_close(out, expected)
    check_suspects(suspects)  # the weight, reached through Inductor's view, is watched through the module
    lin.weight = torch.nn.Parameter(torch.randn(32, 32))
    with pytest.raises(StaleTensorError):
        check_suspects(suspects)


def test_a_paused_watch_sees_nothing_and_watches_again_after() -> None:
    """A breakpoint's eager call runs with the watch paused: its operations bypass the mode."""
    outside = torch.randn(8)
    seen: list[int] = []
    watch = StorageWatch(lambda op, t, ptr: seen.append(ptr) or True, recording=lambda: True)
    with watch:
        with watch.paused():
            (outside * 2).sum()
        assert seen == []
        (outside * 2).sum()
    assert outside.untyped_storage().data_ptr() in seen


def test_pausing_a_watch_under_another_mode_leaves_both_in_place() -> None:
    """Only the innermost mode can be paused: under another one, the watch keeps watching."""
    from bcg.core.torch_internals import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    outside = torch.randn(8)
    seen: list[int] = []
    watch = StorageWatch(lambda op, t, ptr: seen.append(ptr) or True, recording=lambda: True)
    with watch, Count():
        with watch.paused():
            outside * 2
    assert Count.ops == 1 and outside.untyped_storage().data_ptr() in seen


# -- storages no replay reads old values from ----------------------------------------------------


@pytest.mark.parametrize(
    "overwrite",
    [
        lambda b: b.fill_(2.0),
        lambda b: b.zero_(),
        lambda b: b.copy_(torch.randn(b.shape)),
        lambda b: b.uniform_(),
        lambda b: torch.add(torch.randn(b.shape), 1.0, out=b),
        lambda b: b.t().copy_(torch.randn(b.shape[::-1])),  # a permuted view covers it too
    ],
    ids=["fill_", "zero_", "copy_", "uniform_", "out=", "transposed copy_"],
)
def test_a_dropped_tensor_the_capture_first_overwrites_whole_is_scratch_not_stale(overwrite) -> None:  # type: ignore[no-untyped-def]
    """torch's reset-and-recapture pattern: the graph's own first write makes the old values
    irrelevant, so dropping the tensor is legal; the graph still holds its memory."""
    state = {"b": torch.randn(8, 4)}
    ptr = state["b"].untyped_storage().data_ptr()

    def fn() -> None:
        overwrite(state["b"])
        for _ in range(3):
            state["b"] = state["b"] + 2  # rebinds the name: the first tensor is the graph's alone

    watch = StorageWatch(lambda op, t, p: p == ptr, recording=lambda: True)  # (the rest is the pool's)
    with watch:
        fn()
    suspects: list = []
    held = watch.held("the test's segments", suspects)
    gc.collect()
    assert len(held) == 1 and held.nbytes == 8 * 4 * 4  # held: replays write there
    assert suspects == []
    check_suspects(suspects)


@pytest.mark.parametrize(
    "access",
    [
        lambda b: b.add_(1.0),  # reads before writing
        lambda b: b[:4].fill_(0.0),  # writes part of it: the rest is read later
        lambda b: b.copy_(b.flip(0)),  # its own old values are the source
        lambda b: torch.add(b, 1.0, out=b),  # an out= argument the operation also reads
        lambda b: b[:, ::2].zero_(),  # a strided view: every other column is left
    ],
    ids=["add_", "partial fill_", "copy_ from itself", "out= also read", "strided zero_"],
)
def test_a_dropped_tensor_whose_old_values_a_replay_reads_is_still_refused(access) -> None:  # type: ignore[no-untyped-def]
    state = {"b": torch.randn(8, 4)}
    ptr = state["b"].untyped_storage().data_ptr()
    watch = StorageWatch(lambda op, t, p: p == ptr, recording=lambda: True)  # (the rest is the pool's)
    with watch:
        access(state["b"])
        state["b"].sum(0)
    suspects: list = []
    held = watch.held("the test's segments", suspects)
    assert len(held) == 1
    check_suspects(suspects)
    state.clear()
    gc.collect()
    with pytest.raises(StaleTensorError, match="replaced tensor"):
        check_suspects(suspects)


class _Writers:
    """Stands in for another graph's pool (bcg.core.pool.PoolWriters)."""

    name = "the bcg graph captured at producer.py:7"

    def __init__(self) -> None:
        self.live = True

    def alive(self) -> bool:
        return self.live


def test_another_graphs_output_is_not_stale_while_that_graph_lives_and_named_after() -> None:
    """Chained graphs: what g1 reads lives in g0's pool and g0's replay rewrites it. Dropping the
    user's name for it is legal while g0 holds its capture; once g0 is reset, a replay says so."""
    writers = _Writers()
    produced = {"b": torch.randn(16)}
    weight = {"w": torch.randn(16)}
    pools = {produced["b"].untyped_storage().data_ptr(): writers}
    watch = StorageWatch(lambda op, t, ptr: True, recording=lambda: True, writers=pools.get)
    with watch:
        produced["b"] * weight["w"]
    suspects: list = []
    held = watch.held("g1's segments", suspects)
    assert len(held) == 2
    produced.clear()
    gc.collect()
    assert suspects  # posted: only the graph holds it now
    check_suspects(suspects)  # g0 rewrites it at every replay
    check_suspects(suspects)
    writers.live = False  # g0 reset or freed
    with pytest.raises(StaleTensorError, match=r"reset or freed \(the bcg graph captured at producer.py:7\)") as err:
        check_suspects(suspects)
    assert "torch.float32 tensor of shape (16,)" in str(err.value)
    weight.clear()  # the weight in the global pool: refused as ever
    writers.live = True
    gc.collect()
    with pytest.raises(StaleTensorError, match="replaced tensor"):
        check_suspects(suspects)
