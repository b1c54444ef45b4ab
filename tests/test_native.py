"""The native replay loop (``bcg._native``, built from ``csrc/``): what can be checked without a GPU."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import sys
import weakref
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

import bcg
from bcg.core import native
from bcg.core.breakpoint import BreakpointSpec
from bcg.core.plan import BreakpointStep
from bcg.core.replay import NativeExecutor, PythonExecutor, StagedExecutor, make_executor
from bcg.errors import StaleTensorError


def _libcuda_loadable() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


@pytest.fixture
def _native():  # noqa: ANN202
    assert native.available(), native.why_unavailable()
    return native.module()


def _breakpoint_step(fn, name: str, index: int = 0) -> BreakpointStep:  # noqa: ANN001
    return BreakpointStep(spec=BreakpointSpec(fn=fn, name=name), args=(), kwargs={}, index=index)


# -- the build ----------------------------------------------------------------------------------


def test_extension_is_built_and_importable() -> None:
    assert native.available(), native.why_unavailable()
    assert native.why_unavailable() is None
    import bcg._native as mod

    assert mod is native.module()
    assert mod.DRIVER_LIBRARY == "libcuda.so.1"
    assert callable(mod.Plan) and callable(mod.load_driver)


# -- Plan construction --------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["segment", 1.5, None, True, b"\x00", object()])
def test_plan_rejects_invalid_step_types(_native, bad) -> None:  # noqa: ANN001
    with pytest.raises(TypeError, match=r"Plan step 1 must be an int .* a callable .* a call tuple .* or a parameter tuple"):
        _native.Plan((lambda: None, bad))


@pytest.mark.parametrize(
    "bad",
    [("f", (), None, None, False), (print, [1], None, None, False), (print, (), [], None, False),
     (print, (), None, "x", False)],
)
def test_plan_rejects_malformed_call_steps(_native, bad) -> None:  # noqa: ANN001
    with pytest.raises(TypeError, match=r"Plan step 0: a call step is"):
        _native.Plan((bad,))


def test_plan_rejects_a_non_iterable(_native) -> None:  # noqa: ANN001
    with pytest.raises(TypeError, match="iterable"):
        _native.Plan(5)


def test_plan_rejects_handles_that_do_not_fit_a_pointer(_native) -> None:  # noqa: ANN001
    with pytest.raises(OverflowError, match="Plan step 0"):
        _native.Plan((1 << 80,))


def test_plan_introspection(_native) -> None:  # noqa: ANN001
    f = lambda: None  # noqa: E731
    plan = _native.Plan([f, 0, 0xDEADBEEF, f])  # any iterable; handles are not touched until replay
    assert len(plan) == 4
    assert plan.launches == 2
    assert plan.steps == (f, 0, 0xDEADBEEF, f)
    assert plan.failed_step == -1
    assert "4 steps" in repr(plan) and "2 graph launches" in repr(plan)
    assert len(_native.Plan(())) == 0


# -- replay with callables only (no driver needed) ----------------------------------------------


def test_replay_calls_callables_in_order(_native) -> None:  # noqa: ANN001
    calls: list[int] = []
    plan = _native.Plan([lambda i=i: calls.append(i) for i in range(5)])
    for _ in range(3):
        assert plan.replay(0) is None
    assert calls == [0, 1, 2, 3, 4] * 3
    assert plan.failed_step == -1
    plan.replay(0, 3)  # an optional device ordinal is accepted
    _native.Plan(()).replay(0)


def test_call_steps_pass_arguments_and_hand_results_on(_native) -> None:  # noqa: ANN001
    seen: list[object] = []

    def fn(a: int, b: int, *, c: int = 0) -> object:
        seen.append(("fn", a, b, c))
        return None if a == 0 else a + b + c

    plan = _native.Plan([
        (fn, (1, 2), {"c": 3}, seen.append, False),  # a result: handed on
        (fn, (0, 2), None, seen.append, False),  # None and not always: not handed on
        (fn, (0, 5), {}, seen.append, True),  # None but always: handed on
        (fn, (4, 5), None, None, True),  # no on_result: ignored
    ])
    for _ in range(2):
        seen.clear()
        plan.replay(0)
        assert seen == [("fn", 1, 2, 3), 6, ("fn", 0, 2, 0), ("fn", 0, 5, 0), None, ("fn", 4, 5, 0)]
    assert plan.launches == 0


def test_an_on_result_exception_stops_the_replay_at_its_step(_native) -> None:  # noqa: ANN001
    after: list[int] = []

    def refuse(result: object) -> None:
        raise LookupError(f"refused {result}")

    plan = _native.Plan([(int, ("7",), None, refuse, False), lambda: after.append(1)])
    with pytest.raises(LookupError, match="refused 7"):
        plan.replay(0)
    assert plan.failed_step == 0 and after == []


def test_replay_ignores_what_callables_return(_native) -> None:  # noqa: ANN001
    calls: list[str] = []
    results: list[weakref.ref] = []

    class Result:
        pass

    def an_int() -> int:
        calls.append("int")
        return 42

    def a_str() -> str:
        calls.append("str")
        return "x"

    def an_exception() -> Exception:
        calls.append("exception")
        return ValueError("returned, not raised")

    def a_fresh_object() -> Result:
        calls.append("object")
        r = Result()
        results.append(weakref.ref(r))
        return r

    def false() -> bool:
        calls.append("false")
        return False

    plan = _native.Plan([an_int, a_str, an_exception, a_fresh_object, false])
    for _ in range(3):
        assert plan.replay(0) is None
        assert plan.failed_step == -1
    assert calls == ["int", "str", "exception", "object", "false"] * 3  # every callable ran, in order
    assert len(results) == 3 and all(r() is None for r in results)  # results were dropped, not kept


def test_replay_arguments_are_checked(_native) -> None:  # noqa: ANN001
    plan = _native.Plan([lambda: None])
    with pytest.raises(TypeError, match="stream must be an int"):
        plan.replay("stream")
    with pytest.raises(TypeError, match="1 or 2 positional"):
        plan.replay()
    with pytest.raises(TypeError, match="1 or 2 positional"):
        plan.replay(0, 0, 0)


def test_a_callables_exception_propagates_unchanged_with_its_index(_native) -> None:  # noqa: ANN001
    calls: list[str] = []
    boom = ValueError("boom")

    def fail() -> None:
        calls.append("fail")
        raise boom

    plan = _native.Plan([lambda: calls.append("a"), lambda: calls.append("b"), fail, lambda: calls.append("after")])
    with pytest.raises(ValueError) as info:
        plan.replay(0)
    assert info.value is boom
    assert not getattr(info.value, "__notes__", None)  # the C loop adds nothing: the executor does
    assert plan.failed_step == 2
    assert calls == ["a", "b", "fail"]
    calls.clear()
    plan.steps  # noqa: B018 - still usable
    # the next replay starts over and resets failed_step
    ok = _native.Plan([lambda: calls.append("a")])
    ok.replay(0)
    assert ok.failed_step == -1


def test_base_exceptions_propagate(_native) -> None:  # noqa: ANN001
    def interrupt() -> None:
        raise KeyboardInterrupt

    plan = _native.Plan([lambda: None, interrupt])
    with pytest.raises(KeyboardInterrupt):
        plan.replay(0)
    assert plan.failed_step == 1


def test_failed_step_is_reset_by_a_successful_replay(_native) -> None:  # noqa: ANN001
    state = {"fail": True}

    def maybe() -> None:
        if state["fail"]:
            raise RuntimeError("x")

    plan = _native.Plan([lambda: None, maybe])
    with pytest.raises(RuntimeError):
        plan.replay(0)
    assert plan.failed_step == 1
    state["fail"] = False
    plan.replay(0)
    assert plan.failed_step == -1


def test_replay_does_not_leak_references(_native) -> None:  # noqa: ANN001
    class Step:
        def __call__(self) -> object:
            return object()

    step = Step()
    plan = _native.Plan([step, step])
    before = sys.getrefcount(step)
    for _ in range(1000):
        plan.replay(0)
    assert sys.getrefcount(step) == before
    del plan
    assert sys.getrefcount(step) == before - 2


def test_a_callable_may_drop_the_last_reference_to_its_plan(_native) -> None:  # noqa: ANN001
    holder: dict[str, object] = {}
    calls: list[int] = []

    def drop() -> None:
        holder.clear()
        calls.append(1)

    holder["plan"] = _native.Plan([drop, lambda: calls.append(2)])
    replay = holder["plan"].replay  # type: ignore[attr-defined]
    replay(0)
    assert calls == [1, 2]


def test_reference_cycles_through_a_plan_are_collected(_native) -> None:  # noqa: ANN001
    class Owner:
        def step(self) -> None:
            pass

    owner = Owner()
    owner.plan = _native.Plan([owner.step])  # owner -> plan -> bound method -> owner
    ref = weakref.ref(owner)
    del owner
    gc.collect()
    assert ref() is None


# -- graph launches need the driver ------------------------------------------------------------


@pytest.mark.skipif(_libcuda_loadable(), reason="libcuda.so.1 is present on this machine")
def test_a_launch_without_the_driver_raises_a_clear_error_before_any_step_runs(_native) -> None:  # noqa: ANN001
    calls: list[str] = []
    plan = _native.Plan([lambda: calls.append("before"), 0, lambda: calls.append("after")])
    for _ in range(2):  # the failure is remembered, and reported the same way
        with pytest.raises(RuntimeError, match=r"the native replay path needs the NVIDIA driver \(libcuda\.so\.1\)"):
            plan.replay(0)
    assert calls == []  # refused before anything ran
    assert plan.failed_step == -1
    with pytest.raises(bcg.ReplayError, match="libcuda"):
        plan.replay(0)
    with pytest.raises(bcg.ReplayError, match="libcuda"):
        _native.load_driver()
    with pytest.raises(bcg.ReplayError, match="libcuda"):
        plan.upload(0)
    assert "libcuda.so.1" in (native.driver_error() or "")
    # a plan of callables still replays without the driver
    _native.Plan([lambda: calls.append("ok")]).replay(0)
    assert calls == ["ok"]


@pytest.mark.skipif(not _libcuda_loadable(), reason="needs libcuda.so.1")
def test_driver_loads_when_present(_native) -> None:  # noqa: ANN001
    _native.load_driver()
    assert native.driver_error() is None
    assert _native.error_name(1) == "CUDA_ERROR_INVALID_VALUE"


# -- executor selection ---------------------------------------------------------------------------


def _plan_of_breakpoints(calls: list[str]) -> list[BreakpointStep]:
    return [_breakpoint_step(lambda n=n: calls.append(n), n, i) for i, n in enumerate(("a", "b", "c"))]


def test_default_executor_is_native_when_built(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BCG_NATIVE", raising=False)
    calls: list[str] = []
    executor = make_executor(_plan_of_breakpoints(calls))
    assert isinstance(executor, NativeExecutor) and executor.name == "native"
    executor.run()
    assert calls == ["a", "b", "c"]
    monkeypatch.setenv("BCG_NATIVE", "1")
    assert make_executor(_plan_of_breakpoints(calls)).name == "native"


@pytest.mark.parametrize("value", ["0", "false", "OFF"])
def test_bcg_native_0_selects_the_python_executor(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("BCG_NATIVE", value)
    calls: list[str] = []
    executor = make_executor(_plan_of_breakpoints(calls))
    assert isinstance(executor, PythonExecutor) and executor.name == "python"
    # an explicit request still gets the native executor
    assert make_executor(_plan_of_breakpoints(calls), "native").name == "native"


@pytest.mark.parametrize("name", ["python", "native"])
def test_a_staged_executor_prepares_between_its_two_parts(name: str) -> None:
    """StagedExecutor: the steps before ``at``, then ``prepare(live)``, then the rest, on either
    executor; a prepare that raises stops the replay before the rest."""
    calls: list[str] = []
    executor = StagedExecutor(_plan_of_breakpoints(calls), 1, lambda live: calls.append(f"prepare {live}"), name)
    assert executor.name == name
    executor.run(7)
    executor.run(8)
    assert calls == ["a", "prepare 7", "b", "c", "a", "prepare 8", "b", "c"]

    def refuse(live: object) -> None:
        raise ValueError("no room")

    calls.clear()
    with pytest.raises(ValueError, match="no room"):
        StagedExecutor(_plan_of_breakpoints(calls), 2, refuse, name).run(0)
    assert calls == ["a", "b"]


def test_explicit_executor_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BCG_NATIVE", raising=False)
    plan = _plan_of_breakpoints([])
    assert make_executor(plan, "python").name == "python"
    assert make_executor(plan, "native").name == "native"
    with pytest.raises(ValueError, match="unknown executor 'cuda'"):
        make_executor(plan, "cuda")


def test_native_requested_but_not_built_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "_load", lambda: (None, "bcg._native is not built (test)"))
    monkeypatch.delenv("BCG_NATIVE", raising=False)
    plan = _plan_of_breakpoints([])
    assert not native.available()
    with pytest.raises(bcg.ReplayError, match=r"native executor is not available: bcg\._native is not built \(test\)"):
        make_executor(plan, "native")
    with pytest.raises(ImportError, match="not built"):
        native.module()
    assert make_executor(plan).name == "python"  # the default falls back quietly


def test_native_executor_adds_the_same_note_as_the_python_executor() -> None:
    calls: list[str] = []

    def fail() -> None:
        calls.append("fail")
        raise ValueError("backend unavailable")

    plan = [
        _breakpoint_step(lambda: calls.append("a"), "a", 0),
        _breakpoint_step(fail, "flaky", 1),
        _breakpoint_step(lambda: calls.append("c"), "c", 2),
    ]
    notes = {}
    for name in ("python", "native"):
        executor = make_executor(plan, name)
        with pytest.raises(ValueError, match="backend unavailable") as info:
            executor.run()
        notes[name] = info.value.__notes__
        assert calls == ["a", "fail"]
        calls.clear()
    assert notes["native"] == notes["python"]
    assert notes["native"] == [
        "bcg: raised by breakpoint 'flaky' during replay; the segments after it did not run "
        "and the graph stays replayable"
    ]


def test_native_executor_runs_bridged_breakpoints() -> None:
    seen: list[int] = []
    step = BreakpointStep(spec=BreakpointSpec(fn=lambda x, y=0: seen.append(x + y), name="f"), args=(1,), kwargs={"y": 2})
    executor = make_executor([step, step], "native")
    executor.run()
    assert seen == [3, 3]
    assert executor.launches == 0


# -- the launch loop against a fake driver ----------------------------------------------------------
#
# A tiny libcuda.so.1 stand-in (compiled here with the C compiler that built the
# extension) records launches, so the C loop's launches, their order relative to
# callables, the stream, the context fix-up for threads with no current context,
# and the CUDA error reporting are all checked without a GPU. It runs in a
# subprocess whose LD_LIBRARY_PATH finds the fake first.

_FAKE_DRIVER = r"""
#include <stdint.h>
#include <stddef.h>
typedef int CUresult;
static __thread void *current;
static uintptr_t launched[256];
static int n_launched, n_retains, n_uploads;
static void *last_stream;
CUresult cuCtxGetCurrent(void **c) { *c = current; return 0; }
CUresult cuCtxSetCurrent(void *c) { current = c; return 0; }
CUresult cuDeviceGet(int *d, int ordinal) { if (ordinal > 1) return 101; *d = ordinal; return 0; }
CUresult cuDevicePrimaryCtxRetain(void **c, int d) { n_retains++; *c = (void *)(uintptr_t)(0x1000 + d); return 0; }
CUresult cuGraphLaunch(void *exec, void *stream) {
    if (current == NULL) return 201;
    uintptr_t h = (uintptr_t)exec;
    if (h == 0) return 1;
    if (h == 400 || h == 999) return (CUresult)h;
    if (n_launched < 256) launched[n_launched++] = h;
    last_stream = stream;
    return 0;
}
CUresult cuStreamIsCapturing(void *stream, int *status) {
    if ((uintptr_t)stream == 0xBAD) return 400;
    *status = (uintptr_t)stream == 0xCA ? 1 : 0; return 0;
}
CUresult cuGraphUpload(void *exec, void *stream) { (void)exec; (void)stream; n_uploads++; return 0; }
static uintptr_t set_exec[64], set_params[64];
static int n_set;
CUresult cuGraphExecKernelNodeSetParams_v2(void *exec, void *node, const void *params) {
    if ((uintptr_t)node == 0xDEAD) return 400;
    if (n_launched < 256) launched[n_launched++] = (uintptr_t)node;  /* in the launch log, by node */
    if (n_set < 64) { set_exec[n_set] = (uintptr_t)exec; set_params[n_set] = (uintptr_t)params; n_set++; }
    return 0;
}
uintptr_t fake_set_exec(int i) { return set_exec[i]; }
uintptr_t fake_set_params(int i) { return set_params[i]; }
int fake_sets(void) { return n_set; }
static const char *name_of(CUresult e) {
    switch (e) { case 1: return "CUDA_ERROR_INVALID_VALUE"; case 101: return "CUDA_ERROR_INVALID_DEVICE";
                 case 201: return "CUDA_ERROR_INVALID_CONTEXT"; case 400: return "CUDA_ERROR_INVALID_HANDLE"; }
    return NULL;
}
CUresult cuGetErrorName(CUresult e, const char **s) { *s = name_of(e); return *s ? 0 : 1; }
CUresult cuGetErrorString(CUresult e, const char **s) {
    *s = e == 1 ? "invalid argument" : e == 400 ? "invalid resource handle" : NULL; return *s ? 0 : 1;
}
int fake_count(void) { return n_launched; }
uintptr_t fake_launched(int i) { return launched[i]; }
uintptr_t fake_stream(void) { return (uintptr_t)last_stream; }
int fake_retains(void) { return n_retains; }
int fake_uploads(void) { return n_uploads; }
void fake_reset(void) { n_launched = 0; last_stream = NULL; }
"""

_FAKE_DRIVER_CHECKS = r"""
import ctypes, threading
import pytest
import bcg
from bcg.core import native
from bcg.core import replay as replay_mod
from bcg.core.breakpoint import BreakpointSpec
from bcg.core.plan import BreakpointStep, SegmentStep

nat = native.module()
nat.load_driver()
fake = ctypes.CDLL("libcuda.so.1")
fake.fake_launched.restype = ctypes.c_size_t
fake.fake_stream.restype = ctypes.c_size_t
assert nat.error_name(400) == "CUDA_ERROR_INVALID_HANDLE"

def launched():
    return [fake.fake_launched(i) for i in range(fake.fake_count())]

# launches and calls interleave in plan order, on the given stream; the context is fixed once
seen = []
plan = nat.Plan([lambda: seen.append(fake.fake_count()), 0x10, lambda: seen.append(fake.fake_count()), 0x20])
assert plan.launches == 2
plan.replay(0x77, 0)
assert launched() == [0x10, 0x20] and seen == [0, 1] and fake.fake_stream() == 0x77
assert fake.fake_retains() == 1
fake.fake_reset()
plan.replay(0x78, 0)
assert launched() == [0x10, 0x20] and fake.fake_stream() == 0x78 and fake.fake_retains() == 1
plan.upload(0x77, 0)
assert fake.fake_uploads() == 2

# a thread with no current context: device -1 lets the driver say so; a device fixes it
errors = []
def in_thread(device):
    try:
        plan.replay(0x79, device)
    except Exception as exc:
        errors.append(exc)
t = threading.Thread(target=in_thread, args=(-1,)); t.start(); t.join()
assert len(errors) == 1 and isinstance(errors[0], bcg.ReplayError), errors
assert "cuGraphLaunch failed at step 1: CUDA_ERROR_INVALID_CONTEXT" in str(errors[0])
errors.clear()
t = threading.Thread(target=in_thread, args=(0,)); t.start(); t.join()
assert errors == [] and fake.fake_retains() == 1  # the retained primary context is reused
t = threading.Thread(target=in_thread, args=(5,)); t.start(); t.join()
assert len(errors) == 1 and "cuDeviceGet failed: CUDA_ERROR_INVALID_DEVICE" in str(errors[0]), errors

# a capturing stream (or one the driver rejects) refuses the whole replay
calls = []
for stream, message in ((0xCA, "stream that is capturing a CUDA graph"), (0xBAD, "cuStreamIsCapturing failed: CUDA_ERROR_INVALID_HANDLE")):
    fake.fake_reset()
    with pytest.raises(bcg.ReplayError, match=message):
        nat.Plan([lambda: calls.append("a"), 0x10]).replay(stream, 0)
    assert calls == [] and launched() == []

# a parameter step sets a kernel node of an executable (no launch), in plan order with the launches
fake.fake_set_exec.restype = fake.fake_set_params.restype = ctypes.c_size_t
fake.fake_reset()
calls = []
plan = nat.Plan([(0x10, 0x5E1, 0xABC), 0x10, lambda: calls.append(launched()), (0x20, 0x5E2, 0xDEF), 0x20])
assert plan.launches == 2
plan.replay(0x77, 0)
assert launched() == [0x5E1, 0x10, 0x5E2, 0x20] and calls == [[0x5E1, 0x10]]
assert [(fake.fake_set_exec(i), fake.fake_set_params(i)) for i in range(fake.fake_sets())] == [(0x10, 0xABC), (0x20, 0xDEF)]
fake.fake_reset()
with pytest.raises(bcg.ReplayError, match=r"^cuGraphExecKernelNodeSetParams failed at step 1: CUDA_ERROR_INVALID_HANDLE"):
    nat.Plan([0x10, (0x20, 0xDEAD, 0xDEF), 0x20]).replay(0, 0)
assert launched() == [0x10]  # the launch after the failed step does not run
for step in ((0x10, 0x5E1), (0x10, 0, 0xABC), (0x10, "node", 0xABC)):
    with pytest.raises((TypeError, ValueError), match="parameter step|must be"):
        nat.Plan([step])

# launch errors name the step and the CUDA error; the steps after it do not run
calls = []
bad = nat.Plan([lambda: calls.append("a"), 0x10, 0, lambda: calls.append("b")])
with pytest.raises(bcg.ReplayError, match=r"^cuGraphLaunch failed at step 2: CUDA_ERROR_INVALID_VALUE \(invalid argument\)$") as info:
    bad.replay(0, 0)
assert info.value.step == 2 and info.value.cuda_error == "CUDA_ERROR_INVALID_VALUE"
assert bad.failed_step == 2 and calls == ["a"]
with pytest.raises(RuntimeError, match="step 0: CUDA_ERROR_INVALID_HANDLE"):
    nat.Plan([400]).replay(0, 0)
with pytest.raises(RuntimeError, match="step 0: CUDA error 999$"):
    nat.Plan([999]).replay(0, 0)

# the executor: plain segments launch from C, RNG segments and breakpoints go through Python
class FakeGraph:
    def __init__(self, handle, log):
        self.handle, self.log = handle, log
    def raw_cuda_graph_exec(self):
        return self.handle
    def replay(self):
        self.log.append(("torch replay", self.handle, fake.fake_count()))

replay_mod.stream_readers = lambda: ((lambda: 0), (lambda device: 0x55))
log = []
plan = [
    SegmentStep(index=0, cuda_graph=FakeGraph(0x100, log), nodes=1, kernel_nodes=1),
    BreakpointStep(spec=BreakpointSpec(fn=lambda: log.append(("bp", fake.fake_count())), name="bp"), args=(), kwargs={}),
    SegmentStep(index=1, cuda_graph=FakeGraph(0x200, log), nodes=1, kernel_nodes=1, uses_rng=True),
    SegmentStep(index=2, cuda_graph=FakeGraph(0x300, log), nodes=1, kernel_nodes=1),
]
executor = replay_mod.make_executor(plan)
assert executor.name == "native" and executor.launches == 2
fake.fake_reset()
executor.run()
assert launched() == [0x100, 0x300] and fake.fake_stream() == 0x55
assert log == [("bp", 1), ("torch replay", 0x200, 1)], log
plan[3] = SegmentStep(index=2, cuda_graph=FakeGraph(0, log), nodes=1, kernel_nodes=1)
with pytest.raises(bcg.ReplayError, match="step 3: CUDA_ERROR_INVALID_VALUE") as info:
    replay_mod.make_executor(plan, "native").run()
assert info.value.__notes__ == [
    "bcg: segment 2 (plan step 3) failed to launch during a native replay; the steps before it ran "
    "and the ones after it did not"
]
# a segment carrying staged values: its kernel nodes are set in its own executable before its launch
class FakeStage:
    def __init__(self, address, log):
        self.params_address, self.log = address, log
    def set_in(self, graph_exec, node):
        self.log.append(("set", graph_exec, int(node)))

class FakeBuffer:
    def __init__(self, address, log):
        self.stage = FakeStage(address, log)

log = []
staged = SegmentStep(index=0, cuda_graph=FakeGraph(0x400, log), nodes=2, kernel_nodes=2,
                     staged=((0x5E1, FakeBuffer(0xAB0, log)), (0x5E2, FakeBuffer(0xAB8, log))))
fake.fake_reset()
replay_mod.make_executor([staged], "native").run()
assert launched() == [0x5E1, 0x5E2, 0x400]
assert [(fake.fake_set_exec(i), fake.fake_set_params(i)) for i in range(fake.fake_sets())][-2:] == [(0x400, 0xAB0), (0x400, 0xAB8)]
replay_mod.make_executor([staged], "python").run()
assert log == [("set", 0x400, 0x5E1), ("set", 0x400, 0x5E2), ("torch replay", 0x400, 3)], log

# a failure after a segment with parameter steps is named by its plan step, as the Python executor names it
def boom():
    raise ValueError("boom")

plan = [
    SegmentStep(index=0, cuda_graph=FakeGraph(0x500, log), nodes=3, kernel_nodes=3,
                staged=((0x5E1, FakeBuffer(0xAB0, log)), (0x5E2, FakeBuffer(0xAB8, log)))),
    BreakpointStep(spec=BreakpointSpec(fn=boom, name="a"), args=(), kwargs={}),
    SegmentStep(index=1, cuda_graph=FakeGraph(0x600, log), nodes=1, kernel_nodes=1),
    BreakpointStep(spec=BreakpointSpec(fn=lambda: None, name="b"), args=(), kwargs={}),
]
notes = {}
for name in ("native", "python"):
    with pytest.raises(ValueError) as info:
        replay_mod.make_executor(plan, name).run()
    notes[name] = info.value.__notes__
assert notes["native"] == notes["python"] and "'a'" in notes["native"][0], notes
plan[2] = SegmentStep(index=1, cuda_graph=FakeGraph(0, log), nodes=1, kernel_nodes=1)
plan[1] = BreakpointStep(spec=BreakpointSpec(fn=lambda: None, name="a"), args=(), kwargs={})
with pytest.raises(bcg.ReplayError) as info:
    replay_mod.make_executor(plan, "native").run()
assert info.value.__notes__ == [
    "bcg: segment 1 (plan step 2) failed to launch during a native replay; the steps before it ran "
    "and the ones after it did not"
], info.value.__notes__
print("FAKE DRIVER CHECKS OK")
"""


@pytest.mark.skipif(_libcuda_loadable(), reason="a real libcuda.so.1 is present: the GPU tests cover this")
def test_launch_loop_against_a_fake_driver(_native, tmp_path) -> None:  # noqa: ANN001
    import os
    import shutil
    import subprocess
    import sysconfig

    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    cc = cc.split()[0]
    if shutil.which(cc) is None:
        pytest.skip(f"no C compiler ({cc}) to build the fake driver")
    src = tmp_path / "fake_cuda.c"
    src.write_text(_FAKE_DRIVER)
    lib = tmp_path / "libcuda.so.1"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(lib), str(src)], check=True)
    script = tmp_path / "checks.py"
    script.write_text(_FAKE_DRIVER_CHECKS)
    env = dict(os.environ, LD_LIBRARY_PATH=f"{tmp_path}:{os.environ.get('LD_LIBRARY_PATH', '')}")
    env.pop("BCG_NATIVE", None)
    result = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "FAKE DRIVER CHECKS OK" in result.stdout


# -- Replay: a graph's replay in C -----------------------------------------------------------


class _Form:
    def __init__(self) -> None:
        self.replays = 0


def _replay_kit(_native, forms, *, device: int = 0, profiling: bool = False, suspects=None, log=None,  # noqa: ANN001,ANN202
                groups_off=None):
    """A Replay over plans of callables only (no driver), with every callback logged."""
    log = [] if log is None else log

    def slow(live, index, reason):  # noqa: ANN001,ANN202
        log.append(("slow", live, index, reason))
        return "slow result"

    def check(held):  # noqa: ANN001,ANN202
        log.append(("check", list(held)))
        if "stale" in held:
            raise StaleTensorError("a held tensor was replaced")

    from bcg.core.breakpoint import UNSET, live_variable

    replay = _native.Replay(forms, device, lambda: 0, lambda d: 0, slow, suspects if suspects is not None else [],
                            check, (SimpleNamespace(on=profiling), "on"), live_variable(), UNSET, "outputs", groups_off)
    return replay, log


def _tail_only(_native, fn):  # noqa: ANN001,ANN202
    """A form entry of a Replay with one plan (no staged checks, no head, no prepare): ``fn`` its one step."""
    return (None, None, _native.Plan([fn]), (), _Form(), None, None, None)


def _fits(log, name: str, answer: bool):  # noqa: ANN001,ANN202
    def fits(live, staged=None):  # noqa: ANN001,ANN202
        log.append((name, live, staged))
        return answer
    return fits


def test_replay_runs_the_first_form_that_fits_head_prepare_tail_with_live_set(_native) -> None:  # noqa: ANN001
    log: list = []
    seen = lambda name: (lambda: log.append((name, bcg.live())))  # noqa: E731
    tier, inline, breakable = _Form(), _Form(), _Form()
    forms = [
        ((( _fits(log, "tier fits", False), "tier bounds", True, "tier does not fit"),), _native.Plan([seen("tier")]),
         _native.Plan([seen("tier tail")]), (), tier, None, None, None),
        (((_fits(log, "fits", True), "bounds", True, "x"), (_fits(log, "fits1", True), None, False, "y")),
         _native.Plan([seen("head")]), _native.Plan([seen("tail")]), (lambda live: log.append(("prepare", live)),),
         inline, lambda: log.append("after"), None, None),
        (None, None, _native.Plan([seen("breakable")]), (), breakable, None, None, None),
    ]
    replay, _ = _replay_kit(_native, forms, log=log)
    live = object()
    assert replay.run(live) == "outputs"
    assert log == [("tier fits", live, "tier bounds"), ("fits", live, "bounds"), ("fits1", live, None),
                   ("head", live), ("prepare", live), ("tail", live), "after"]
    assert (tier.replays, inline.replays, breakable.replays) == (0, 1, 0)
    assert bcg.live(default=None) is None and replay.replaying == 0  # live reset after the replay


def test_replay_leaves_to_python_what_it_does_not_run(_native) -> None:  # noqa: ANN001
    log: list = []
    staged = ((( _fits(log, "fits", False), None, False, "attn does not fit"),), None, _native.Plan([]), (), _Form(),
              None, None, None)
    # nothing fits, and no form takes any live metadata: -1 with the reason
    replay, _ = _replay_kit(_native, [staged], log=log)
    assert replay.run(1) == "slow result" and log[-1] == ("slow", 1, -1, "attn does not fit")
    # the form chosen has no plan (the breakable form of a staged graph): its index, with the reason
    plain = (None, None, None, (), _Form(), None, None, None)
    replay, _ = _replay_kit(_native, [staged, plain], log=log)
    assert replay.run(2) == "slow result" and log[-1] == ("slow", 2, 1, "attn does not fit")
    # another current device: Python raises, naming the device
    ran: list = []
    only = _tail_only(_native, lambda: ran.append(1))
    replay, _ = _replay_kit(_native, [only], device=3, log=log)
    assert replay.run(3) == "slow result" and log[-1] == ("slow", 3, 0, None) and not ran
    # a profiler runs: all of it in Python, nothing asked first
    n = len(log)
    replay, _ = _replay_kit(_native, [staged, plain], profiling=True, log=log)
    assert replay.run(4) == "slow result" and log[n:] == [("slow", 4, None, None)]


def test_replay_checks_held_storages_before_anything_runs(_native) -> None:  # noqa: ANN001
    ran: list = []
    form = (None, None, _native.Plan([lambda: ran.append("tail")]), (lambda live: ran.append("prepare"),), _Form(),
            None, None, None)
    suspects: list = []
    replay, log = _replay_kit(_native, [form], suspects=suspects)
    replay.run(None)
    assert ran == ["prepare", "tail"] and log == []  # no suspect: not called
    suspects.append("stale")  # (the list the graph holds: read at every replay)
    with pytest.raises(StaleTensorError):
        replay.run(None)
    assert ran == ["prepare", "tail"] and log == [("check", ["stale"])]


def test_replay_errors_propagate_with_live_reset_and_notes_from_the_failing_plan(_native) -> None:  # noqa: ANN001
    notes: list = []

    def boom() -> None:
        assert bcg.live() == "meta"
        raise ValueError("breakpoint failed")

    form = _Form()
    entry = (None, _native.Plan([lambda: None]), _native.Plan([boom]), (), form, None,
             lambda exc: notes.append(("head", exc)), lambda exc: notes.append(("tail", repr(exc))))
    replay, _ = _replay_kit(_native, [entry])
    with pytest.raises(ValueError, match="breakpoint failed"):
        replay.run("meta")
    assert notes == [("tail", "ValueError('breakpoint failed')")]
    assert bcg.live(default=None) is None and replay.replaying == 0 and form.replays == 0

    def bad_prepare(live):  # noqa: ANN001,ANN202
        raise KeyError("prepare")

    tail_ran: list = []
    entry = (None, None, _native.Plan([lambda: tail_ran.append(1)]), (bad_prepare,), _Form(), None, None, None)
    replay, _ = _replay_kit(_native, [entry])
    with pytest.raises(KeyError):
        replay.run("meta")
    assert not tail_ran and bcg.live(default=None) is None

    def bad_fits(live):  # noqa: ANN001,ANN202
        raise RuntimeError("fits")

    entry = (((bad_fits, None, False, "r"),), None, _native.Plan([lambda: tail_ran.append(1)]), (), _Form(), None,
             None, None)
    replay, _ = _replay_kit(_native, [entry])
    with pytest.raises(RuntimeError, match="fits"):
        replay.run(0)
    assert not tail_ran


def test_replay_counts_itself_from_its_fits_to_its_output_copy(_native) -> None:  # noqa: ANN001
    seen: list = []
    holder: list = []
    count = lambda where: (lambda *a: seen.append((where, holder[0].replaying)) or True)  # noqa: E731
    entry = (((count("fits"), None, False, "r"),), None, _native.Plan([count("breakpoint")]), (), _Form(),
             count("after"), None, None)
    replay, _ = _replay_kit(_native, [entry])
    holder.append(replay)
    replay.run(None)
    assert seen == [("fits", 1), ("breakpoint", 1), ("after", 1)] and replay.replaying == 0


def test_reset_is_refused_from_a_fits_and_after_the_graph_dropped_its_running_native_replay(_native) -> None:  # noqa: ANN001
    """reset() frees the executables a replay launches: refused from a ``fits`` (or another thread
    meanwhile), and from a breakpoint after another made the graph build a new native replay
    (``use_executor``, ``set_enabled``, ``outputs =``) while this one ran; allowed after."""
    from bcg.graph import BreakableGraph

    outcomes: list = []

    def try_reset(graph: BreakableGraph, where: str) -> None:
        try:
            graph.reset()
            outcomes.append((where, "reset"))
        except bcg.ReplayError:
            outcomes.append((where, "refused"))

    chose = BreakableGraph()
    fits = lambda live, staged=None: try_reset(chose, "fits") or True  # noqa: E731
    chose._native, _ = _replay_kit(_native, [(((fits, None, False, "r"),), None, _native.Plan([lambda: None]), (),
                                              _Form(), None, None, None)])
    chose._native.run(None)
    dropped = BreakableGraph()
    steps = [lambda: dropped._stale(), lambda: try_reset(dropped, "breakpoint")]
    dropped._native, _ = _replay_kit(_native, [(None, None, _native.Plan(steps), (), _Form(), None, None, None)])
    dropped._native.run(None)
    try_reset(chose, "after")
    try_reset(dropped, "after")
    assert outcomes == [("fits", "refused"), ("breakpoint", "refused"), ("after", "reset"), ("after", "reset")]


@pytest.mark.parametrize("forms, error", [
    ([("not", "a", "form")], "form 0 must be a tuple"),
    ([(None, "head", None, (), None, None, None, None)], "head and tail must be bcg._native.Plan"),
    ([(None, None, None, [], None, None, None, None)], "prepares must be a tuple"),
    ([((("fits", None, False, "r"),), None, None, (), None, None, None, None)], "check 0 must be a tuple"),
    ([(((len, None, 1, "r"),), None, None, (), None, None, None, None)], "check 0 must be a tuple"),
])
def test_replay_rejects_malformed_forms(_native, forms, error) -> None:  # noqa: ANN001
    with pytest.raises(TypeError, match=error):
        _replay_kit(_native, forms)


def test_replay_does_not_leak_and_its_cycles_are_collected(_native) -> None:  # noqa: ANN001
    form = _Form()
    entry = (None, None, _native.Plan([lambda: None]), (lambda live: None,), form, None, None, None)
    replay, _ = _replay_kit(_native, [entry])
    live = object()
    before = sys.getrefcount(live)
    for _ in range(100):
        replay.run(live)
    assert sys.getrefcount(live) == before and form.replays == 100

    class Owner:
        pass

    owner = Owner()
    gone = weakref.ref(owner)
    owner.replay = _replay_kit(_native, [(None, None, _native.Plan([lambda held=owner: held]), (), _Form(), None,
                                          None, None)])[0]  # a cycle: owner -> replay -> plan -> owner
    del owner
    gc.collect()
    assert gone() is None


# -- Call: a runner call in C ----------------------------------------------------------------


class _Sanitizer:
    def __init__(self, log: list) -> None:
        self.log = log
        self.rows_written = None

    def set_rows(self, T: int, stream: int) -> None:
        self.log.append(("rows", T, stream))
        self.rows_written = T


class _Graph:
    def __init__(self, log: list, native: Any = None) -> None:
        self.log, self._native = log, native
        self._replaying = 0  # replays through Python in progress

    def set_enabled(self, label: str, enabled: bool) -> bool:
        self.log.append(("enabled", label, enabled))
        return True

    def replay(self, live: Any) -> None:
        self.log.append(("replay", live))


class _WatchedBucket:
    """A bucket whose attribute reads are logged into ``reads``."""

    def __init__(self, reads: list, **fields: Any) -> None:
        object.__setattr__(self, "_reads", reads)
        for name, value in fields.items():
            object.__setattr__(self, name, value)

    def __getattribute__(self, name: str) -> Any:
        if not name.startswith("_"):
            object.__getattribute__(self, "_reads").append(name)
        return object.__getattribute__(self, name)


def _call_kit(_native, T: int = 6, reads: list | None = None, **change):  # noqa: ANN001,ANN202
    """A Call over fake runner state: bucket 8 captured, input_buffers(T) handed out, views of T made
    (``reads``: the bucket logs its attribute reads there)."""
    import threading
    from types import SimpleNamespace

    log: list = []
    inputs = (object(), object())
    out = object()
    fields = dict(captured=True, single=True, failure=None, graph=_Graph(log), sliced={T: [out]}, replays=0)
    bucket = _WatchedBucket(reads, **fields) if reads is not None else SimpleNamespace(**fields)
    state = dict(background=0, kept=[], serving=True, device=0, stream=0x77, last=None, safe=True, ratio=-1.0)
    state.update(change)
    lock_state = SimpleNamespace(lock=threading.RLock(), background=state["background"], last_stream=state["last"],
                                 shared=False, first_caller=None)
    runner = SimpleNamespace(_real_rows=0)
    ladder = SimpleNamespace(kept_own_pools=state["kept"], sanitizer=_Sanitizer(log))
    kit = SimpleNamespace(log=log, inputs=inputs, out=out, bucket=bucket, runner=runner, lock_state=lock_state,
                          call_ladder=ladder)
    kit.call = _native.Call(runner, {id(inputs[1]): (T, 8, inputs)}, 1, {8: bucket}, ladder,
                            SimpleNamespace(serving=state["serving"]), lock_state, lambda: state["safe"], "padding",
                            0, lambda: state["device"], lambda d: state["stream"], state["ratio"])
    return kit


def test_call_serves_a_call_on_handed_buffers_under_the_call_lock(_native) -> None:  # noqa: ANN001
    kit = _call_kit(_native)
    assert kit.call.call(kit.inputs, "live") is kit.out
    assert kit.log == [("rows", 6, 0x77), ("enabled", "padding", True), ("replay", "live")]
    assert kit.bucket.replays == 1 and kit.runner._real_rows == 6 and kit.lock_state.last_stream == 0x77
    assert kit.lock_state.lock.acquire(blocking=False)  # released (an RLock: this thread may take it anyway)
    kit.lock_state.lock.release()


def test_call_replays_the_graphs_native_replay_when_it_has_one(_native) -> None:  # noqa: ANN001
    kit = _call_kit(_native)
    ran: list = []
    entry = _tail_only(_native, lambda: ran.append(bcg.live()))
    kit.bucket.graph._native = _replay_kit(_native, [entry])[0]
    assert kit.call.call(kit.inputs, "meta") is kit.out and ran == ["meta"]
    assert ("replay", "meta") not in kit.log  # not through the graph's Python replay


def test_call_skips_set_rows_when_the_sanitizer_wrote_that_count_last(_native) -> None:  # noqa: ANN001
    kit = _call_kit(_native)
    for _ in range(3):
        assert kit.call.call(kit.inputs, None) is kit.out
    assert [e for e in kit.log if e[0] == "rows"] == [("rows", 6, 0x77)]  # the count written once
    sanitizer = kit.call_ladder.sanitizer
    sanitizer.rows_written = 5  # another count written since (a call of another T): written again
    assert kit.call.call(kit.inputs, None) is kit.out
    assert [e for e in kit.log if e[0] == "rows"] == [("rows", 6, 0x77), ("rows", 6, 0x77)]


@pytest.mark.parametrize("T, groups_off, asks", [
    (6, None, True),  # the graph's replay does not know which groups its forms skip
    (6, frozenset({"padding"}), True),  # the zeroing is off, and T=6 of 8 rows needs it on
    (6, frozenset(), False),  # on already
    (6, frozenset({"other"}), False),
    (8, frozenset(), True),  # nothing padded: the zeroing is on and must go off
    (8, frozenset({"padding"}), False),  # off already
    (8, None, True),
])
def test_call_asks_set_enabled_only_when_the_native_replay_has_the_padding_group_otherwise(  # noqa: ANN001
        _native, T, groups_off, asks) -> None:
    kit = _call_kit(_native, T=T)
    entry = _tail_only(_native, lambda: None)
    replay = _replay_kit(_native, [entry], groups_off=groups_off)[0]
    assert replay.groups_off == groups_off
    kit.bucket.graph._native = replay
    assert kit.call.call(kit.inputs, None) is kit.out
    assert [e for e in kit.log if e[0] == "enabled"] == ([("enabled", "padding", T < 8)] if asks else [])


def test_call_during_a_replay_of_the_graph_asks_set_enabled_which_refuses_it(_native) -> None:  # noqa: ANN001
    """A runner call from a breakpoint of the graph it would replay (or while Python replays it)
    goes to set_enabled, which raises ReplayError there, as the Python call does."""
    from bcg.errors import ReplayError

    kit = _call_kit(_native)
    graph = kit.bucket.graph
    nested: list = []

    def set_enabled(label: str, enabled: bool) -> bool:
        if graph._replaying or graph._native.replaying:
            raise ReplayError("set_enabled was called during a replay of this graph")
        kit.log.append(("enabled", label, enabled))
        return True

    def breakpoint() -> None:
        with pytest.raises(ReplayError, match="during a replay"):
            kit.call.call(kit.inputs, None)
        nested.append(True)

    graph.set_enabled = set_enabled
    entry = _tail_only(_native, breakpoint)
    graph._native = _replay_kit(_native, [entry], groups_off=frozenset())[0]
    assert kit.call.call(kit.inputs, None) is kit.out and nested == [True]
    graph._replaying = 1  # a replay through Python (the breakable form) in progress
    graph._native = _replay_kit(_native, [_tail_only(_native, lambda: None)], groups_off=frozenset())[0]
    with pytest.raises(ReplayError, match="during a replay"):
        kit.call.call(kit.inputs, None)


def test_call_switches_to_the_native_replay_that_set_enabled_builds(_native) -> None:  # noqa: ANN001
    """set_enabled that changes the groups drops the graph's native replay; the call replays the
    one in place after it, not the one it read before."""
    kit = _call_kit(_native)
    ran: list = []
    old = _replay_kit(_native, [_tail_only(_native, lambda: ran.append("old"))], groups_off=frozenset({"padding"}))[0]
    new = _replay_kit(_native, [_tail_only(_native, lambda: ran.append("new"))], groups_off=frozenset())[0]
    graph = kit.bucket.graph
    graph._native = old

    def set_enabled(label: str, enabled: bool) -> bool:
        graph._native = new
        return True

    graph.set_enabled = set_enabled
    assert kit.call.call(kit.inputs, None) is kit.out and ran == ["new"]


def test_call_asks_views_safe_unless_the_lock_plainly_allows_views(_native) -> None:  # noqa: ANN001
    """With the runners' real lock: its first caller gets views without a Python call; a second
    thread asks views_safe, which says copies from then on (the Python call copies)."""
    import threading

    from bcg.runner.pool_lock import PoolCallLock

    kit = _call_kit(_native)
    lock = PoolCallLock()
    asked: list = []

    def views_safe() -> bool:
        asked.append(threading.get_ident())
        return lock.views_safe()

    call = _native.Call(kit.runner, {id(kit.inputs[1]): (6, 8, kit.inputs)}, 1, {8: kit.bucket}, kit.call_ladder,
                        SimpleNamespace(serving=True), lock, views_safe, "padding", 0, lambda: 0, lambda d: 0x77, -1.0)
    assert call.call(kit.inputs, None) is kit.out and asked == [threading.get_ident()]  # the first call records it
    assert call.call(kit.inputs, None) is kit.out and len(asked) == 1  # then plainly safe
    other: list = []
    thread = threading.Thread(target=lambda: other.append(call.call(kit.inputs, None)))
    thread.start()
    thread.join()
    assert other == [NotImplemented] and len(asked) == 2 and lock.shared
    assert call.call(kit.inputs, None) is NotImplemented and len(asked) == 3  # shared: copies from now on


def test_call_copies_the_outputs_when_a_breakpoint_began_a_background_capture(_native) -> None:  # noqa: ANN001
    """As the Python call, which asks views_safe() after the replay: a background capture of the
    pool begun during the replay (from a breakpoint) makes it return copies, not the pool's views."""
    kit = _call_kit(_native)
    asked: list = []

    def views_safe() -> bool:
        asked.append(kit.lock_state.background)
        return kit.lock_state.background == 0

    def replay(live: Any) -> None:
        kit.lock_state.background += begins  # what capture(background=True) does first

    kit.bucket.graph.replay = replay
    kit.bucket.leaves = ["leaf"]
    kit.bucket.slice = lambda leaves, T, copy, keep: ("copies", leaves, T, copy, keep)
    call = _native.Call(kit.runner, {id(kit.inputs[1]): (6, 8, kit.inputs)}, 1, {8: kit.bucket}, kit.call_ladder,
                        SimpleNamespace(serving=True), kit.lock_state, views_safe, "padding", 0, lambda: 0,
                        lambda d: 0x77, -1.0)
    begins = 0
    assert call.call(kit.inputs, None) is kit.out and asked == [0]
    begins = 1
    assert call.call(kit.inputs, None) == ("copies", ["leaf"], 6, True, True) and asked == [0, 0, 1]


def test_replay_refuses_a_bad_profiler_flag_or_groups(_native) -> None:  # noqa: ANN001
    from bcg.core.breakpoint import UNSET, live_variable

    args = ([], 0, lambda: 0, lambda d: 0, lambda *a: None, [], lambda held: None)
    with pytest.raises(TypeError, match="profiler"):
        _native.Replay(*args, (object(), 1), live_variable(), UNSET, None, None)
    with pytest.raises(TypeError, match="groups_off"):
        _native.Replay(*args, (object(), "x"), live_variable(), UNSET, None, {"padding"})


@pytest.mark.parametrize("change, why", [
    ({"background": 1}, "a background capture runs"),
    ({"kept": [1]}, "own pools to free first"),
    ({"serving": False}, "not set up"),
    ({"safe": False}, "outputs must be copied"),
    ({"device": 1}, "another device"),
    ({"last": 0x99}, "the last replay was on another stream"),
    ({"ratio": 0.2}, "too padded (2 of 8 rows)"),
])
def test_call_hands_back_what_it_does_not_serve_having_done_nothing(_native, change, why) -> None:  # noqa: ANN001
    kit = _call_kit(_native, **change)
    assert kit.call.call(kit.inputs, None) is NotImplemented, why
    assert kit.log == [] and kit.bucket.replays == 0 and kit.runner._real_rows == 0, why
    assert kit.lock_state.lock.acquire(blocking=False), why
    kit.lock_state.lock.release()


def test_call_hands_back_other_inputs_and_buckets_not_ready(_native) -> None:  # noqa: ANN001
    kit = _call_kit(_native)
    assert kit.call.call((object(), kit.inputs[1]), None) is NotImplemented  # not the inputs handed out
    assert kit.call.call((kit.inputs[0], object()), None) is NotImplemented
    assert kit.call.call(kit.inputs[:1], None) is NotImplemented
    for name, value in (("captured", False), ("failure", "capture failed"), ("graph", None), ("sliced", {}),
                        ("single", False)):
        kit = _call_kit(_native)
        setattr(kit.bucket, name, value)
        assert kit.call.call(kit.inputs, None) is NotImplemented, name
        assert kit.log == [], name
    kit = _call_kit(_native)
    with _held_elsewhere(kit.lock_state.lock):
        assert kit.call.call(kit.inputs, None) is NotImplemented  # another thread calls: Python waits
    assert kit.log == []


def test_call_reads_the_buckets_state_only_under_the_call_lock(_native) -> None:  # noqa: ANN001
    """Captures, lazy calls and reset() change a bucket under the call lock: a call that cannot take
    it reads none of its state (the Python call then waits for the lock); one that can reads it
    under the lock, and gives the lock back on every way out."""
    reads: list = []
    kit = _call_kit(_native, reads=reads)
    with _held_elsewhere(kit.lock_state.lock):
        assert kit.call.call(kit.inputs, None) is NotImplemented
        assert reads == []
    assert kit.call.call(kit.inputs, "live") is kit.out
    assert {"captured", "failure", "graph", "sliced"} <= set(reads) and _free_elsewhere(kit.lock_state.lock)
    for name, value in (("captured", False), ("failure", "capture failed"), ("graph", None), ("sliced", {})):
        kit = _call_kit(_native, reads=[])
        object.__setattr__(kit.bucket, name, value)
        assert kit.call.call(kit.inputs, None) is NotImplemented, name
        assert _free_elsewhere(kit.lock_state.lock), name


@contextlib.contextmanager
def _held_elsewhere(lock: Any) -> Iterator[None]:
    """Another thread holds ``lock`` for the block."""
    import threading

    held, done = threading.Event(), threading.Event()

    def hold() -> None:
        with lock:
            held.set()
            done.wait(5)

    thread = threading.Thread(target=hold)
    thread.start()
    held.wait(5)
    try:
        yield
    finally:
        done.set()
        thread.join()


def _free_elsewhere(lock: Any) -> bool:
    """Whether another thread can take ``lock`` now (an RLock: its owner always can)."""
    import threading

    got: list = []

    def take() -> None:
        if lock.acquire(blocking=False):
            got.append(True)
            lock.release()

    thread = threading.Thread(target=take)
    thread.start()
    thread.join()
    return bool(got)


def test_call_releases_the_lock_when_the_replay_raises(_native) -> None:  # noqa: ANN001
    kit = _call_kit(_native)

    def boom(live):  # noqa: ANN001,ANN202
        raise ValueError("replay failed")

    kit.bucket.graph.replay = boom
    with pytest.raises(ValueError, match="replay failed"):
        kit.call.call(kit.inputs, None)
    assert kit.bucket.replays == 0
    import threading

    got = []
    t = threading.Thread(target=lambda: got.append(kit.lock_state.lock.acquire(blocking=False)))
    t.start()
    t.join()
    assert got == [True]
