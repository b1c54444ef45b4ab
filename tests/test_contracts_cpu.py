"""Contracts enforced without a GPU: environment flags, ``mutates`` validation, ``bcg.live()``
in segment code, and eager mode holding every replay to graph mode's output contract."""

from __future__ import annotations

import warnings

import pytest
import torch

import bcg
from bcg.core import native
from bcg.core.env import env_flag


def _eager(fn, *args, live=None):  # noqa: ANN001, ANN202
    return bcg.make_graph(fn, *args, mode="eager", live=live)


# -- environment flags ------------------------------------------------------------------------


@pytest.mark.parametrize("raw", ["1", "true", "TRUE", "Yes", "on", " ON "])
def test_env_flag_reads_every_spelling_of_on(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv("BCG_TEST_FLAG", raw)
    assert env_flag("BCG_TEST_FLAG") is True


@pytest.mark.parametrize("raw", ["0", "false", "False", "NO", "off", "Off"])
def test_env_flag_reads_every_spelling_of_off(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv("BCG_TEST_FLAG", raw)
    assert env_flag("BCG_TEST_FLAG", default=True) is False


def test_env_flag_unset_or_empty_gives_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BCG_TEST_FLAG", raising=False)
    assert env_flag("BCG_TEST_FLAG") is False and env_flag("BCG_TEST_FLAG", default=True) is True
    monkeypatch.setenv("BCG_TEST_FLAG", "  ")
    assert env_flag("BCG_TEST_FLAG", default=True) is True


@pytest.mark.parametrize("raw", ["2", "maybe", "enable", "tru"])
def test_env_flag_rejects_anything_else_naming_the_variable(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv("BCG_TEST_FLAG", raw)
    with pytest.raises(ValueError, match=f"BCG_TEST_FLAG={raw!r} is not a flag"):
        env_flag("BCG_TEST_FLAG")


@pytest.mark.parametrize("name", ["BCG_POISON", "BCG_GUARDS"])
@pytest.mark.parametrize("raw, on", [("off", False), ("no", False), ("FALSE", False), ("On", True)])
def test_capture_reads_poison_and_guards_with_the_same_parser(
    monkeypatch: pytest.MonkeyPatch, name: str, raw: str, on: bool
) -> None:
    monkeypatch.setenv(name, raw)
    assert env_flag(name) is on  # "off"/"no"/"FALSE" used to turn poison on
    bcg.capture(bcg.BreakableGraph())  # the constructor reads both flags
    monkeypatch.setenv(name, "sometimes")
    with pytest.raises(ValueError, match=name):
        bcg.capture(bcg.BreakableGraph())


def test_native_switch_uses_the_same_parser(monkeypatch: pytest.MonkeyPatch) -> None:
    for raw, on in [("0", False), ("Off", False), ("no", False), ("1", True), ("yes", True)]:
        monkeypatch.setenv("BCG_NATIVE", raw)
        assert native.enabled_by_env() is on
    monkeypatch.delenv("BCG_NATIVE")
    assert native.enabled_by_env() is True
    monkeypatch.setenv("BCG_NATIVE", "fast")
    with pytest.raises(ValueError, match="BCG_NATIVE"):
        native.enabled_by_env()


# -- mutates= is checked when the function is decorated -------------------------------------------


def test_mutates_given_as_one_string_is_one_name() -> None:
    @bcg.breakpoint(mutates="out")
    def f(a: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(a)

    a, out = torch.randn(3), torch.empty(3)
    spec = f.__bcg_breakpoint__
    assert spec.mutates == ("out",)
    assert spec.mutated_tensors((a, out), {}) == [out]


def test_mutates_naming_no_parameter_raises_type_error_naming_it() -> None:
    with pytest.raises(TypeError, match=r"'nope', which is not a parameter of .*f\(a, out\)"):

        @bcg.breakpoint(mutates=("out", "nope"))
        def f(a: torch.Tensor, out: torch.Tensor) -> None:
            pass

    with pytest.raises(TypeError, match="strings"):

        @bcg.breakpoint(mutates=(1,))
        def g(a: torch.Tensor) -> None:
            pass


def test_mutates_of_a_function_taking_kwargs_accepts_any_name() -> None:
    @bcg.breakpoint(mutates=("out",))
    def f(a: torch.Tensor, **kw: torch.Tensor) -> None:
        kw["out"].copy_(a)

    a, out = torch.randn(3), torch.empty(3)
    assert f.__bcg_breakpoint__.mutated_tensors((a,), {"out": out}) == [out]


# -- bcg.live() read by segment code ----------------------------------------------------------------


def test_live_read_between_breakpoints_raises_naming_the_line() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return x * bcg.live()  # baked into a graph: must be refused

    with pytest.raises(bcg.errors.LiveReadInSegmentError, match=r"test_contracts_cpu.py:\d+: return x \* bcg.live\(\)"):
        _eager(fn, torch.randn(4), live=2.0)


def test_live_read_inside_breakpoints_and_with_static_ok_is_allowed() -> None:
    @bcg.breakpoint
    def scale(t: torch.Tensor) -> torch.Tensor:
        return t * bcg.live()["scale"]

    @bcg.breakpoint
    def outer(t: torch.Tensor) -> torch.Tensor:
        return scale(t) + 1  # a breakpoint called from a breakpoint is plain code

    def fn(x: torch.Tensor) -> torch.Tensor:
        width = bcg.live(static_ok=True)["width"]  # declared static: allowed, frozen at capture
        return outer(x[:width]) * 2

    x = torch.randn(6)
    graph = _eager(fn, x, live={"scale": 2.0, "width": 4})
    assert graph.stats().breakpoints == 1
    out = graph.replay(live={"scale": 3.0, "width": 4})
    assert torch.equal(out, (x[:4] * 3.0 + 1) * 2)
    assert bcg.live("unset") == "unset"  # outside any recording: a plain read


def test_disabled_breakpoint_is_segment_code_for_live_reads() -> None:
    @bcg.breakpoint(enabled=False)
    def inline(t: torch.Tensor) -> torch.Tensor:
        return t * bcg.live()

    with pytest.raises(bcg.errors.LiveReadInSegmentError):
        _eager(lambda x: inline(x) + 1, torch.randn(3), live=1.0)


# -- eager mode is at least as strict as graph mode ------------------------------------------------


def test_eager_replay_rejects_another_output_shape() -> None:
    @bcg.breakpoint
    def head(t: torch.Tensor) -> torch.Tensor:
        return t[: bcg.live()] * 2

    x = torch.randn(8)
    graph = _eager(lambda a: head(a + 1).sum(), x, live=8)
    graph.replay(live=8)
    with pytest.raises(bcg.errors.BreakpointOutputMismatch, match="shapes and dtypes are fixed"):
        graph.replay(live=4)
    assert torch.equal(graph.replay(live=8), ((x + 1) * 2).sum())  # still replayable


def test_eager_replay_rejects_another_structure_or_frozen_value() -> None:
    @bcg.breakpoint
    def pair(t: torch.Tensor) -> object:
        mode = bcg.live()
        if mode == "tuple":
            return t * 2, 1
        if mode == "list":
            return [t * 2, 1]
        return t * 2, 2

    graph = _eager(lambda a: pair(a)[0] + 1, torch.randn(4), live="tuple")
    graph.replay(live="tuple")
    with pytest.raises(bcg.errors.BreakpointOutputMismatch, match="same structure"):
        graph.replay(live="list")
    with pytest.raises(bcg.errors.BreakpointOutputMismatch, match="frozen at capture"):
        graph.replay(live="value")


def test_eager_replay_rejects_a_pass_through_that_stops_passing_through() -> None:
    @bcg.breakpoint
    def maybe_scale(t: torch.Tensor) -> torch.Tensor:
        return t if bcg.live() == "off" else t * 2

    def fn(a: torch.Tensor) -> torch.Tensor:
        h = a + 1
        y = maybe_scale(h)
        return y + h

    graph = _eager(fn, torch.randn(4), live="off")
    with pytest.raises(bcg.errors.BreakpointOutputMismatch, match="itself at capture"):
        graph.replay(live="on")
    graph.replay(live="off")


def test_eager_replay_rejects_changed_breakpoint_control_flow() -> None:
    @bcg.breakpoint
    def a_bp(t: torch.Tensor) -> None:
        t.add_(1)

    @bcg.breakpoint
    def b_bp(t: torch.Tensor) -> None:
        t.mul_(2)

    flags = {"swap": False, "skip": False}

    def fn(x: torch.Tensor) -> torch.Tensor:
        h = x * 1
        first, second = (b_bp, a_bp) if flags["swap"] else (a_bp, b_bp)
        first(h)
        if not flags["skip"]:
            second(h)
        return h

    graph = _eager(fn, torch.randn(4))
    flags["swap"] = True
    with pytest.raises(bcg.errors.BreakpointOutputMismatch, match="control flow"):
        graph.replay()
    flags.update(swap=False, skip=True)
    with pytest.raises(bcg.errors.BreakpointOutputMismatch, match="called 1 breakpoint"):
        graph.replay()
    flags["skip"] = False
    graph.replay()


def test_eager_replay_rejects_another_output_shape_of_the_function() -> None:
    box = {"n": 4}
    graph = _eager(lambda x: x[: box["n"]] * 2, torch.randn(8))
    box["n"] = 3
    with pytest.raises(bcg.ReplayError, match="output 0 is \\(3,\\)"):
        graph.replay()


def test_make_graph_without_cuda_still_falls_back_to_eager_with_the_checks() -> None:
    if torch.cuda.is_available():
        pytest.skip("checks the CPU fallback")

    @bcg.breakpoint
    def head(t: torch.Tensor) -> torch.Tensor:
        return t[: bcg.live()]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        graph = bcg.make_graph(lambda a: head(a) + 1, torch.randn(5), live=5)
    with pytest.raises(bcg.errors.BreakpointOutputMismatch):
        graph.replay(live=2)
