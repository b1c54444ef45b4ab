"""Every public entry point checks its arguments where they are given (issue 51, item 3).

Each bad input raises ``TypeError`` (a wrong type) or ``ValueError`` (a value out
of range) whose message names the argument and what it got; good arguments,
NumPy numbers included, still construct.
"""

from __future__ import annotations

import math
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch

import bcg
from bcg.core import args

X = torch.zeros(2, 3)


def f(a: torch.Tensor) -> torch.Tensor:
    return a * 2


def _runner(*positional: Any, **kwargs: Any) -> bcg.GraphRunner:
    options: dict[str, Any] = {"example_inputs": (X,), "mode": "eager", "progress": False}
    options.update(kwargs)
    return bcg.GraphRunner(*positional, **options)


def _stage(**kwargs: Any) -> Callable[..., Any]:
    """``@bcg.breakpoint(**kwargs)`` applied to a small function."""
    def fn(x: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(x)

    return bcg.breakpoint(**kwargs)(fn)


def _verify(*positional: Any, **kwargs: Any) -> Any:
    return bcg.verify(*positional, mode="eager", **kwargs)


@dataclass(frozen=True)
class Case:
    id: str
    call: Callable[[], Any]
    error: type[Exception]
    name: str  # the argument the message must name
    got: str  # what the message must say it got
    where: str = ""  # the entry point the message starts with ("" for the older messages)


def _case(id: str, call: Callable[[], Any], error: type[Exception], name: str, got: str, where: str = "") -> Any:
    return pytest.param(Case(id, call, error, name, got, where), id=id)


_B, _MG, _C, _R, _SB, _VP, _D, _V = ("bcg.breakpoint", "bcg.make_graph", "bcg.capture", "bcg.GraphRunner",
                                     "bcg.StagingBuffer", "bcg.VariantPolicy", "bcg.Debug", "bcg.verify")
_G = bcg.BreakableGraph

CASES = [
    # -- bcg.breakpoint ----------------------------------------------------------------------------
    _case("breakpoint-fn-int", lambda: bcg.breakpoint(42), TypeError, "fn", "42 (int)", _B),
    _case("breakpoint-fn-str", lambda: bcg.breakpoint("attn"), TypeError, "fn", "'attn' (str)", _B),
    _case("breakpoint-decorates-tensor", lambda: bcg.breakpoint(name="b")(X), TypeError, "fn", "a Tensor", _B),
    _case("breakpoint-enabled-str", lambda: _stage(enabled="yes"), TypeError, "enabled", "'yes' (str)", _B),
    _case("breakpoint-enabled-none", lambda: _stage(enabled=None), TypeError, "enabled", "None", _B),
    _case("breakpoint-capture_stub", lambda: _stage(capture_stub=1), TypeError, "capture_stub", "1 (int)", _B),
    _case("breakpoint-name", lambda: _stage(name=3), TypeError, "name", "3 (int)", _B),
    _case("breakpoint-mutates-int", lambda: _stage(mutates=3), TypeError, "mutates", "3 (int)", _B),
    _case("breakpoint-mutates-entry", lambda: _stage(mutates=("out", 1)), TypeError, "mutates[1]", "1 (int)", _B),
    _case("breakpoint-mutates-unknown", lambda: _stage(mutates="nope"), TypeError, "mutates", "'nope'"),
    _case("breakpoint-prepare", lambda: _stage(prepare=1, fits=lambda live: True), TypeError, "prepare",
          "1 (int)", _B),
    _case("breakpoint-fits", lambda: _stage(prepare=lambda live: live, fits=True), TypeError, "fits",
          "True (bool)", _B),
    _case("breakpoint-prepare-alone", lambda: _stage(prepare=lambda live: live), TypeError, "fits",
          "prepare=a function and fits=None"),
    _case("breakpoint-staged-stub", lambda: _stage(prepare=lambda live: live, fits=lambda live: True,
                                                   capture_stub=lambda x, out: None),
          TypeError, "capture_stub", "a function", _B),
    _case("breakpoint-key", lambda: _stage(key=(1, 2)), TypeError, "key", "(1, 2) (tuple)", _B),
    _case("breakpoint-fake", lambda: _stage(fake="f"), TypeError, "fake", "'f' (str)", _B),
    # -- bcg.make_graph ---------------------------------------------------------------------------
    _case("make_graph-swapped", lambda: bcg.make_graph(X, f), TypeError, "fn", "a Tensor of shape (2, 3)", _MG),
    _case("make_graph-fn-none", lambda: bcg.make_graph(None), TypeError, "fn", "None", _MG),
    _case("make_graph-warmup-negative", lambda: bcg.make_graph(f, X, warmup=-1), ValueError, "warmup",
          "-1 (int)", _MG),
    _case("make_graph-warmup-bool", lambda: bcg.make_graph(f, X, warmup=True), TypeError, "warmup",
          "True (bool)", _MG),
    _case("make_graph-warmup-float", lambda: bcg.make_graph(f, X, warmup=1.5), TypeError, "warmup",
          "1.5 (float)", _MG),
    _case("make_graph-mode", lambda: bcg.make_graph(f, X, mode="fast"), ValueError, "mode", "'fast' (str)", _MG),
    _case("make_graph-mode-type", lambda: bcg.make_graph(f, X, mode=None), TypeError, "mode", "None", _MG),
    _case("make_graph-pool", lambda: bcg.make_graph(f, X, pool=3), TypeError, "pool", "3 (int)", _MG),
    _case("make_graph-pool-triple", lambda: bcg.make_graph(f, X, pool=(1, 2, 3)), TypeError, "pool",
          "(1, 2, 3) (tuple)", _MG),
    _case("make_graph-stream", lambda: bcg.make_graph(f, X, stream="s"), TypeError, "stream", "'s' (str)", _MG),
    _case("make_graph-capture_error_mode", lambda: bcg.make_graph(f, X, capture_error_mode="loose"), ValueError,
          "capture_error_mode", "'loose' (str)", _MG),
    _case("make_graph-variants", lambda: bcg.make_graph(f, X, variants={}), TypeError, "variants", "{} (dict)",
          _MG),
    _case("make_graph-variants-class", lambda: bcg.make_graph(f, X, variants=bcg.VariantPolicy), TypeError,
          "variants", "the class VariantPolicy", _MG),
    _case("make_graph-debug", lambda: bcg.make_graph(f, X, debug=True), TypeError, "debug", "True (bool)", _MG),
    # -- bcg.capture ------------------------------------------------------------------------------
    _case("capture-graph-function", lambda: bcg.capture(f), TypeError, "graph", "a function", _C),
    _case("capture-graph-none", lambda: bcg.capture(None), TypeError, "graph", "None", _C),
    _case("capture-pool-list", lambda: bcg.capture(_G(), pool=[1, 2]), TypeError, "pool", "[1, 2] (list)", _C),
    _case("capture-stream", lambda: bcg.capture(_G(), stream=0), TypeError, "stream", "0 (int)", _C),
    _case("capture-capture_error_mode", lambda: bcg.capture(_G(), capture_error_mode="loose"), ValueError,
          "capture_error_mode", "'loose' (str)", _C),
    _case("capture-capture_error_mode-type", lambda: bcg.capture(_G(), capture_error_mode=None), TypeError,
          "capture_error_mode", "None", _C),
    _case("capture-variants", lambda: bcg.capture(_G(), variants=64), TypeError, "variants", "64 (int)", _C),
    _case("capture-debug-class", lambda: bcg.capture(_G(), debug=bcg.Debug), TypeError, "debug",
          "the class Debug", _C),
    # -- bcg.GraphRunner --------------------------------------------------------------------------
    _case("runner-forward", lambda: _runner(X, [4]), TypeError, "forward", "a Tensor", _R),
    _case("runner-buckets-int", lambda: _runner(f, 64), TypeError, "buckets", "64 (int)", _R),
    _case("runner-buckets-str", lambda: _runner(f, "64"), TypeError, "buckets", "'64' (str)", _R),
    _case("runner-buckets-empty", lambda: _runner(f, []), ValueError, "buckets", "[] (list)", _R),
    _case("runner-buckets-zero", lambda: _runner(f, [0, 4]), ValueError, "buckets[0]", "0 (int)", _R),
    _case("runner-buckets-float", lambda: _runner(f, [4, 8.0]), TypeError, "buckets[1]", "8.0 (float)", _R),
    _case("runner-buckets-bool", lambda: _runner(f, [True]), TypeError, "buckets[0]", "True (bool)", _R),
    _case("runner-example_inputs-tensor", lambda: _runner(f, [4], example_inputs=X), TypeError, "example_inputs",
          "a Tensor", _R),
    _case("runner-example_inputs-none", lambda: _runner(f, [4], example_inputs=None), TypeError,
          "example_inputs", "None", _R),
    _case("runner-pad_dim-str", lambda: _runner(f, [4], pad_dim="0"), TypeError, "pad_dim", "'0' (str)", _R),
    _case("runner-pad_dim-bool", lambda: _runner(f, [4], pad_dim=True), TypeError, "pad_dim", "True (bool)", _R),
    _case("runner-pad_dim-entry", lambda: _runner(f, [4], pad_dim=[0.5]), TypeError, "pad_dim[0]",
          "0.5 (float)", _R),
    _case("runner-pad_dim-count", lambda: _runner(f, [4], pad_dim=[0, None]), ValueError, "pad_dim",
          "2 entries"),
    _case("runner-pad_dim-range", lambda: _runner(f, [4], pad_dim=5), ValueError, "pad_dim", "no dim 5"),
    _case("runner-mode", lambda: _runner(f, [4], mode="fast"), ValueError, "mode", "'fast' (str)", _R),
    _case("runner-max_padding_ratio", lambda: _runner(f, [4], max_padding_ratio=1.5), ValueError,
          "max_padding_ratio", "1.5 (float)", _R),
    _case("runner-max_padding_ratio-negative", lambda: _runner(f, [4], max_padding_ratio=-0.1), ValueError,
          "max_padding_ratio", "-0.1 (float)", _R),
    _case("runner-max_padding_ratio-str", lambda: _runner(f, [4], max_padding_ratio="half"), TypeError,
          "max_padding_ratio", "'half' (str)", _R),
    _case("runner-copy_outputs", lambda: _runner(f, [4], copy_outputs="yes"), TypeError, "copy_outputs",
          "'yes' (str)", _R),
    _case("runner-sanitize", lambda: _runner(f, [4], sanitize=None), TypeError, "sanitize", "None", _R),
    _case("runner-pool", lambda: _runner(f, [4], pool=1), TypeError, "pool", "1 (int)", _R),
    _case("runner-stream", lambda: _runner(f, [4], stream="s"), TypeError, "stream", "'s' (str)", _R),
    _case("runner-capture_error_mode", lambda: _runner(f, [4], capture_error_mode="loose"), ValueError,
          "capture_error_mode", "'loose' (str)", _R),
    _case("runner-progress", lambda: _runner(f, [4], progress="no"), TypeError, "progress", "'no' (str)", _R),
    _case("runner-name", lambda: _runner(f, [4], name=1), TypeError, "name", "1 (int)", _R),
    _case("runner-variants", lambda: _runner(f, [4], variants=1), TypeError, "variants", "1 (int)", _R),
    _case("runner-ranks", lambda: _runner(f, [4], ranks=2), TypeError, "ranks", "2 (int)", _R),
    _case("runner-lazy", lambda: _runner(f, [4], lazy="yes"), TypeError, "lazy", "'yes' (str)", _R),
    _case("runner-lazy-zero", lambda: _runner(f, [4], lazy=0), ValueError, "lazy", "0 (int)", _R),
    _case("runner-lazy-float", lambda: _runner(f, [4], lazy=2.0), TypeError, "lazy", "2.0 (float)", _R),
    # -- bcg.StagingBuffer ------------------------------------------------------------------------
    _case("staging-shape-str", lambda: bcg.StagingBuffer("4"), TypeError, "shape", "'4' (str)", _SB),
    _case("staging-shape-none", lambda: bcg.StagingBuffer(None), TypeError, "shape", "None", _SB),
    _case("staging-shape-negative", lambda: bcg.StagingBuffer(-1, device="cpu"), ValueError, "shape",
          "-1 (int)", _SB),
    _case("staging-shape-bool", lambda: bcg.StagingBuffer(True), TypeError, "shape", "True (bool)", _SB),
    _case("staging-shape-entry", lambda: bcg.StagingBuffer((2, 1.5)), TypeError, "shape[1]", "1.5 (float)", _SB),
    _case("staging-dtype", lambda: bcg.StagingBuffer(2, dtype=torch.bfloat16), TypeError, "dtype",
          "torch.bfloat16", _SB),
    _case("staging-dtype-str", lambda: bcg.StagingBuffer(2, dtype="int32"), TypeError, "dtype", "'int32' (str)",
          _SB),
    _case("staging-dtype-numpy", lambda: bcg.StagingBuffer(2, dtype=np.int32), TypeError, "dtype",
          "the class int32", _SB),
    _case("staging-device", lambda: bcg.StagingBuffer(2, device="gpu"), ValueError, "device", "'gpu' (str)", _SB),
    _case("staging-device-float", lambda: bcg.StagingBuffer(2, device=1.5), TypeError, "device", "1.5 (float)",
          _SB),
    # -- bcg.VariantPolicy ------------------------------------------------------------------------
    _case("policy-max_variants", lambda: bcg.VariantPolicy(max_variants=0), ValueError, "max_variants", "0 (int)",
          _VP),
    _case("policy-max_variants-bool", lambda: bcg.VariantPolicy(max_variants=True), TypeError, "max_variants",
          "True (bool)", _VP),
    _case("policy-max_variants-float", lambda: bcg.VariantPolicy(max_variants=2.5), TypeError, "max_variants",
          "2.5 (float)", _VP),
    _case("policy-max_variant_bytes", lambda: bcg.VariantPolicy(max_variant_bytes=-1), ValueError,
          "max_variant_bytes", "-1 (int)", _VP),
    _case("policy-max_variant_bytes-str", lambda: bcg.VariantPolicy(max_variant_bytes="8G"), TypeError,
          "max_variant_bytes", "'8G' (str)", _VP),
    _case("policy-max_stitched", lambda: bcg.VariantPolicy(max_stitched=0), ValueError, "max_stitched", "0 (int)",
          _VP),
    _case("policy-max_stitched_bytes", lambda: bcg.VariantPolicy(max_stitched_bytes=-5), ValueError,
          "max_stitched_bytes", "-5 (int)", _VP),
    _case("policy-window", lambda: bcg.VariantPolicy(window=0), ValueError, "window", "0 (int)", _VP),
    _case("policy-min_hit_rate", lambda: bcg.VariantPolicy(min_hit_rate=1.5), ValueError, "min_hit_rate",
          "1.5 (float)", _VP),
    _case("policy-min_hit_rate-nan", lambda: bcg.VariantPolicy(min_hit_rate=math.nan), ValueError,
          "min_hit_rate", "nan (float)", _VP),
    _case("policy-min_hit_rate-str", lambda: bcg.VariantPolicy(min_hit_rate="high"), TypeError, "min_hit_rate",
          "'high' (str)", _VP),
    _case("policy-audit_every", lambda: bcg.VariantPolicy(audit_every=-1), ValueError, "audit_every", "-1 (int)",
          _VP),
    _case("policy-stitch", lambda: bcg.VariantPolicy(stitch="yes"), TypeError, "stitch", "'yes' (str)", _VP),
    # -- bcg.Debug --------------------------------------------------------------------------------
    _case("debug-guards", lambda: bcg.Debug(guards="yes"), TypeError, "guards", "'yes' (str)", _D),
    _case("debug-poison", lambda: bcg.Debug(poison=1), TypeError, "poison", "1 (int)", _D),
    # -- bcg.verify -------------------------------------------------------------------------------
    _case("verify-fn", lambda: _verify(42, lambda: (X,), [None]), TypeError, "fn", "42 (int)", _V),
    _case("verify-make_inputs", lambda: _verify(f, (X,), [None]), TypeError, "make_inputs", "(tensor(", _V),
    _case("verify-live_samples-none", lambda: _verify(f, lambda: (X,), None), TypeError, "live_samples", "None",
          _V),
    _case("verify-live_samples-str", lambda: _verify(f, lambda: (X,), "abc"), TypeError, "live_samples",
          "'abc' (str)", _V),
    _case("verify-live_samples-empty", lambda: _verify(f, lambda: (X,), []), ValueError, "live_samples",
          "[] (list)", _V),
    _case("verify-rtol", lambda: _verify(f, lambda: (X,), [None], rtol=-1.0), ValueError, "rtol", "-1.0 (float)",
          _V),
    _case("verify-atol", lambda: _verify(f, lambda: (X,), [None], atol="0"), TypeError, "atol", "'0' (str)", _V),
    _case("verify-raise_on_mismatch", lambda: _verify(f, lambda: (X,), [None], raise_on_mismatch="no"), TypeError,
          "raise_on_mismatch", "'no' (str)", _V),
]


@pytest.mark.parametrize("case", CASES)
def test_a_bad_argument_is_named_with_what_it_got(case: Case) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (make_graph's and the runner's fallback to eager mode without CUDA)
        with pytest.raises((TypeError, ValueError)) as info:
            case.call()
    assert type(info.value) is case.error, f"{type(info.value).__name__}: {info.value}"
    message = str(info.value)
    assert case.name in message, message
    assert case.got in message, message
    if case.where:
        assert message.startswith(f"{case.where}: {case.name} must be "), message


def _raised_in(error: BaseException) -> str:
    return traceback.extract_tb(error.__traceback__)[-1].filename


def test_the_four_cases_of_the_issue() -> None:
    """bcg.breakpoint(42) fails at decoration; make_graph(x, f) before bcg/core/plan.py; GraphRunner(f, 64)
    says what buckets are; make_graph(..., warmup=-1) is refused."""
    with pytest.raises(TypeError, match=r"bcg\.breakpoint: fn must be a function to decorate, got 42 \(int\)"):
        bcg.breakpoint(42)
    with pytest.raises(TypeError, match="did you swap fn and the static arguments") as info:
        bcg.make_graph(X, f)
    assert "plan.py" not in _raised_in(info.value)
    assert "not callable" not in str(info.value)
    with pytest.raises(TypeError, match=r"buckets must be .* got 64 \(int\); .*default_buckets\(64\)") as info:
        bcg.GraphRunner(f, 64, example_inputs=(X,), mode="eager")
    assert "not iterable" not in str(info.value)
    with pytest.raises(ValueError, match=r"warmup must be an int >= 0, got -1"):
        bcg.make_graph(f, X, warmup=-1, mode="eager")


def _stream() -> Any:
    """A ``torch.cuda.Stream`` (on a machine without CUDA, a stand-in that is one to ``isinstance``)."""
    return torch.cuda.Stream() if torch.cuda.is_available() else mock.MagicMock(spec=torch.cuda.Stream)


def test_good_arguments_still_construct() -> None:
    """The checks are not over-strict: NumPy numbers, tuples or lists, None defaults, streams and pools."""
    stream, pool = _stream(), (0, 7)
    # bcg.breakpoint
    for options in ({}, {"enabled": np.bool_(True)}, {"enabled": lambda: False}, {"mutates": "out"},
                    {"mutates": ["out"]}, {"mutates": ("x", "out")}, {"name": "copy"}, {"key": lambda live: live},
                    {"capture_stub": lambda x, out: None}, {"fake": lambda x, out: None},
                    {"prepare": lambda live: live, "fits": lambda live: True}):
        assert _stage(**options).__bcg_breakpoint__ is not None
    # bcg.capture (constructing it captures nothing)
    bcg.capture(_G(), pool=pool, stream=stream, capture_error_mode="thread_local", live=3,
                variants=bcg.VariantPolicy(), debug=bcg.Debug())
    bcg.capture(_G(), pool=None, stream=None, capture_error_mode="relaxed", variants=None, debug=None)
    # bcg.make_graph
    for warmup in (0, 1, np.int64(2)):
        graph = bcg.make_graph(f, X, mode="eager", warmup=warmup, capture_error_mode="relaxed",
                               variants=bcg.VariantPolicy(), debug=bcg.Debug())
        assert torch.equal(graph.outputs, X * 2)
    # bcg.GraphRunner
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for buckets in (None, (4, 8), [8, 4], np.array([4, 8]), range(4, 9, 4), {4, 8}, iter([4, 8])):
            _runner(f, buckets)
        for pad_dim in (0, -2, np.int64(0), [0], (np.int64(0),)):
            _runner(f, [4], pad_dim=pad_dim)
        _runner(f, [4], example_inputs=[X], max_padding_ratio=np.float32(0.5), copy_outputs=np.bool_(True),
                sanitize=np.bool_(False), pool=pool, stream=stream, capture_error_mode="thread_local",
                progress=True, name="mine", variants=bcg.VariantPolicy(window=4), lazy=True)
        _runner(f, [4], max_padding_ratio=0, copy_outputs=None)
        runner = _runner(f, [4, 8], mode="graph")  # graph mode without CUDA: eager, with a warning
    runner.capture()
    assert torch.equal(runner(torch.ones(3, 3)), torch.full((3, 3), 2.0))
    # bcg.StagingBuffer
    for shape in (4, np.int64(4), (2, 3), [2, 3], torch.Size([2, 3]), 0):
        bcg.StagingBuffer(shape, device="cpu")
    for dtype in (torch.int32, torch.int64, torch.uint8, torch.bool, torch.float16, torch.float64):
        bcg.StagingBuffer(2, dtype=dtype, device=torch.device("cpu"))
    assert bcg.StagingBuffer(2).device.shape == (2,)
    # bcg.VariantPolicy, bcg.Debug
    bcg.VariantPolicy(max_variants=np.int64(3), max_variant_bytes=0, max_stitched=1, max_stitched_bytes=np.int32(0),
                      window=1, min_hit_rate=0, audit_every=0, stitch=np.bool_(False))
    bcg.VariantPolicy(min_hit_rate=1, max_variant_bytes=8 << 30)
    bcg.Debug(guards=True, poison=np.bool_(False))
    # bcg.verify
    report = bcg.verify(f, lambda: (torch.randn(2, 3),), (None, None), rtol=0, atol=np.float64(1e-6),
                        raise_on_mismatch=True, mode="eager")
    assert report.ok


def test_capture_takes_torch_cuda_graphs_leading_arguments_in_its_order() -> None:
    """``torch.cuda.graph(g, pool, stream, capture_error_mode)`` is legal torch: the same call on
    ``bcg.capture`` is accepted, and each argument lands where torch's would."""
    import inspect

    theirs = list(inspect.signature(torch.cuda.graph).parameters.values())[1:4]
    ours = list(inspect.signature(bcg.capture).parameters.values())[1:4]
    assert [p.name for p in ours] == [p.name for p in theirs] == ["pool", "stream", "capture_error_mode"]
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in ours)
    stream = _stream()
    bcg.capture(_G(), (0, 7), stream, "thread_local")
    with pytest.raises(TypeError, match="pool"):  # the second positional argument is checked as the pool
        bcg.capture(_G(), stream)
    with pytest.raises(ValueError, match="capture_error_mode"):
        bcg.capture(_G(), None, None, "loud")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here: a CUDA device is valid")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", torch.device("cuda"), 0], ids=["str", "str-index", "device", "index"])
def test_a_cuda_staging_buffer_without_cuda_names_the_device_argument(device: Any) -> None:
    """Code ported from a GPU machine: ``device="cuda"`` without CUDA is a ValueError naming the
    argument and the fix, not torch's bare assertion."""
    with pytest.raises(ValueError, match=r"bcg.StagingBuffer: device must be .*omit device="):
        bcg.StagingBuffer(4, device=device)


def test_a_graph_asked_of_an_eager_runner_says_why_there_is_none() -> None:
    runner = _runner(f, [4, 8], mode="eager")
    runner.capture()
    with pytest.raises(KeyError, match="eager mode"):
        runner.graph(8)
    with pytest.raises(KeyError, match="not a bucket"):
        _runner(f, [4], mode="graph" if torch.cuda.is_available() else "eager").graph(5)


def test_register_generator_state_takes_only_cuda_generators() -> None:
    """As ``CUDAGraph.register_generator_state``: a CPU generator or another object is a TypeError
    saying what it got (torch would dereference a CUDA generator it is not), and nothing is
    registered."""
    graph = bcg.BreakableGraph()
    with pytest.raises(TypeError, match=r"expected a CUDA torch.Generator, got a generator on cpu"):
        graph.register_generator_state(torch.Generator())
    with pytest.raises(TypeError, match=r"expected a CUDA torch.Generator, got 7"):
        graph.register_generator_state(7)  # type: ignore[arg-type]
    assert graph.generator_states == ()


def test_describe_says_what_a_value_is() -> None:
    assert args.describe(None) == "None"
    assert args.describe(42) == "42 (int)"
    assert args.describe("x") == "'x' (str)"
    assert args.describe(np.int64(3)) == "3 (int64)" or args.describe(np.int64(3)) == "np.int64(3) (int64)"
    assert args.describe(torch.zeros(2, 3)) == "a Tensor of shape (2, 3)"
    assert args.describe(f) == "a function"
    assert args.describe(bcg.Debug) == "the class Debug"
    assert args.describe(object()) == "an object"
    assert args.describe(list(range(100))) == "a list"  # a long repr: the type alone
    assert args.is_int(np.int32(1)) and not args.is_int(True) and not args.is_int(np.bool_(True))
    assert not args.is_int(1.0)
