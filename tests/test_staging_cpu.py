"""Staged breakpoints without a GPU: the decorator's checks, StagingBuffer, and eager-mode semantics."""

from __future__ import annotations

import itertools

import pytest
import torch

import bcg

SLOTS = 3


class _Staging:
    def __init__(self) -> None:
        self.buffer = bcg.StagingBuffer(SLOTS + 1, dtype=torch.int64, device="cpu")
        self.prepared: list[tuple[int, ...]] = []

    def prepare(self, lengths: tuple[int, ...]) -> dict:
        self.prepared.append(lengths)
        offsets = list(itertools.accumulate(lengths, initial=0))
        self.buffer.write(offsets + [offsets[-1]] * (SLOTS + 1 - len(offsets)))
        return {"offsets": self.buffer.device, "staged": True}

    @staticmethod
    def fits(lengths: tuple[int, ...]) -> bool:
        return len(lengths) <= SLOTS


def _segment_sums(x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Per-request sums of ``x`` (rows split at ``offsets``), zero-padded to SLOTS rows."""
    ids = torch.searchsorted(offsets[1:], torch.arange(x.shape[0]), right=True).clamp(max=SLOTS - 1)
    return torch.zeros(SLOTS, x.shape[1], dtype=x.dtype).index_add_(0, ids, x)


def _make(staging: _Staging, seen: list[bool]):  # noqa: ANN202
    @bcg.breakpoint(name="sums", mutates=("out",), prepare=staging.prepare, fits=staging.fits)
    def sums(x: torch.Tensor, out: torch.Tensor) -> None:
        meta = bcg.live()
        staged = isinstance(meta, dict)
        seen.append(staged)
        if staged:
            out.copy_(_segment_sums(x, meta["offsets"]))
        else:  # the real metadata
            parts = torch.split(x, list(meta))
            out.zero_()
            for i, p in enumerate(parts[:SLOTS]):
                out[i] = p.sum(0)
            for p in parts[SLOTS:]:
                out[SLOTS - 1] += p.sum(0)

    def fn(x: torch.Tensor) -> torch.Tensor:
        out1 = torch.empty(SLOTS, x.shape[1])
        sums(x, out1)
        out2 = torch.empty(SLOTS, x.shape[1])
        sums(x * 2, out2)
        return out1 + out2

    return fn


def test_eager_mode_stages_once_per_run_when_it_fits_and_uses_the_real_metadata_otherwise() -> None:
    staging, seen = _Staging(), []
    fn = _make(staging, seen)
    x = torch.randn(12, 5)
    graph = bcg.make_graph(fn, x, mode="eager", live=(4, 8))
    assert staging.prepared == [(4, 8)] and seen == [True, True]
    assert graph.stats().breakpoints == 0  # inline: part of the segment
    for lengths in [(3, 3, 6), (12,), (2, 2, 2, 6), (1, 1, 1, 1, 8)]:
        x.copy_(torch.randn(12, 5))
        seen.clear()
        staging.prepared.clear()
        out = graph.replay(lengths)
        fits = len(lengths) <= SLOTS
        assert seen == [fits, fits]
        assert staging.prepared == ([lengths] if fits else [])
        expected = sum(_segment_sums(x * k, torch.tensor(list(itertools.accumulate(lengths, initial=0))[: SLOTS + 1]
                                                          + [12] * max(0, SLOTS + 1 - len(lengths) - 1)))
                       for k in (1, 2))
        if fits:
            torch.testing.assert_close(out, expected)
        with bcg.live_scope(lengths):
            torch.testing.assert_close(out, fn(x))  # the plain call: real metadata, no prepare


class _CheckedStaging(_Staging):
    """A ``fits`` that reads what ``prepare`` returned; a ``prepare`` that refuses too many requests."""

    def prepare(self, lengths: tuple[int, ...]) -> dict:
        if len(lengths) > SLOTS:
            raise ValueError(f"{len(lengths)} requests do not fit {SLOTS} slots")
        return {**super().prepare(lengths), "slots": SLOTS}

    @staticmethod
    def fits(lengths: tuple[int, ...], staged: dict) -> bool:  # type: ignore[override]
        return len(lengths) <= staged["slots"]


def test_a_fits_reading_the_staged_value_runs_inline_or_falls_back_like_a_plain_one() -> None:
    """``fits(live, staged)``: eager mode stages when it fits and, when it does not (the
    ``prepare`` refuses), runs the real metadata, as with ``fits(live)``."""
    staging, seen = _CheckedStaging(), []
    fn = _make(staging, seen)
    x = torch.randn(12, 5)
    graph = bcg.make_graph(fn, x, mode="eager", live=(4, 8))
    assert graph.stats().breakpoints == 0
    for lengths in [(3, 3, 6), (2, 2, 2, 6), (12,), (1, 1, 1, 1, 8)]:
        x.copy_(torch.randn(12, 5))
        seen.clear()
        out = graph.replay(lengths)
        fits = len(lengths) <= SLOTS
        assert seen == [fits, fits]
        with bcg.live_scope(lengths):
            torch.testing.assert_close(out, fn(x))
    graph = bcg.make_graph(fn, x, mode="eager", live=(1, 1, 1, 1, 8))  # recorded with metadata past the bound
    assert graph.stats().breakpoints == 2 and seen[-2:] == [False, False]


def test_fits_arity_counts_required_positional_arguments() -> None:
    def spec(fits):  # noqa: ANN001, ANN202
        return bcg.breakpoint(prepare=lambda live: live, fits=fits)(lambda: None).__bcg_breakpoint__

    assert not spec(lambda live: True).fits_reads_staged
    assert not spec(lambda live, strict=False: True).fits_reads_staged
    assert spec(lambda live, staged: True).fits_reads_staged


def test_staged_tiers_hold_their_values_and_copy_as_such() -> None:
    import copy
    import pickle

    tiers = bcg.StagedTiers((1,), (2, 2), (4, 4))
    assert tuple(tiers) == ((1,), (2, 2), (4, 4))
    assert tiers.breakable
    for other in (copy.copy(tiers), copy.deepcopy(tiers), pickle.loads(pickle.dumps(tiers))):
        assert isinstance(other, bcg.StagedTiers) and tuple(other) == tuple(tiers) and other.breakable
    lean = bcg.StagedTiers((1,), (4, 4), breakable=False)
    for other in (copy.copy(lean), copy.deepcopy(lean), pickle.loads(pickle.dumps(lean))):
        assert tuple(other) == ((1,), (4, 4)) and other.breakable is False
    with pytest.raises(ValueError, match="at least one"):
        bcg.StagedTiers()


def test_plain_calls_never_prepare() -> None:
    staging, seen = _Staging(), []
    fn = _make(staging, seen)
    with bcg.live_scope((2, 2)):
        fn(torch.randn(4, 3))
    assert staging.prepared == [] and seen == [False, False]


def test_the_decorator_wants_prepare_and_fits_together_and_no_stub() -> None:
    with pytest.raises(TypeError, match="together"):
        bcg.breakpoint(prepare=lambda live: live)(lambda x: x)
    with pytest.raises(TypeError, match="together"):
        bcg.breakpoint(fits=lambda live: True)(lambda x: x)
    with pytest.raises(TypeError, match="capture_stub"):
        bcg.breakpoint(prepare=lambda live: live, fits=lambda live: True, capture_stub=lambda x: x)(lambda x: x)
    spec = bcg.breakpoint(prepare=lambda live: live, fits=lambda live: True)(lambda x: x).__bcg_breakpoint__
    assert spec.staged


def test_a_staged_breakpoint_is_a_plain_call_outside_bcg_and_prepares_in_eager_mode() -> None:
    staging, seen = _Staging(), []
    sums = bcg.breakpoint(name="sums", mutates=("out",), prepare=staging.prepare,
                          fits=staging.fits)(lambda x, out: (seen.append(bcg.live()), out.copy_(x))[1])
    x, out = torch.randn(3, 2), torch.empty(3, 2)
    with bcg.live_scope((1, 2)):
        sums(x, out)  # a plain call: no prepare
    assert staging.prepared == [] and seen == [(1, 2)] and torch.equal(out, x)
    graph = bcg.make_graph(lambda x: sums(x, torch.empty_like(x)), x, mode="eager", live=(1, 2))
    staging.prepared.clear()
    graph.replay((3,))  # eager mode: prepared and uploaded before the work
    assert staging.prepared == [(3,)] and staging.buffer.device.tolist() == [0, 3, 3, 3]


def _record_copies(first: tuple[str, _Staging], second: tuple[str, _Staging]) -> None:
    """Record (eager mode) a function calling two staged copy breakpoints, each ``(name, staging)``,
    in that order."""
    copies = [bcg.breakpoint(name=name, mutates=("out",), prepare=staging.prepare,
                             fits=staging.fits)(lambda x, out: out.copy_(x))
              for name, staging in (first, second)]

    def fn(x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        for copy in copies:
            copy(x, out)
        return out

    bcg.make_graph(fn, torch.randn(3, 2), mode="eager", live=(1, 2))


def test_staging_buffer_takes_host_values_only() -> None:
    buf = bcg.StagingBuffer(4, dtype=torch.int32, device="cpu")
    with pytest.raises(TypeError, match="CPU tensor"):
        buf.write(torch.zeros(4, dtype=torch.int32, device="meta"))
    buf.write(torch.tensor([1, 2, 3, 4]))
    assert buf.host.tolist() == [1, 2, 3, 4]


def test_two_prepares_writing_one_buffer_are_refused_at_recording() -> None:
    staging = _Staging()
    other = _Staging()
    other.buffer = staging.buffer  # a second prepare function over the same buffer
    with pytest.raises(bcg.CaptureError, match="'first' and 'second' have different prepare functions"):
        _record_copies(("first", staging), ("second", other))


def test_staging_buffer_takes_exactly_its_size() -> None:
    buf = bcg.StagingBuffer(4, dtype=torch.int32, device="cpu")
    buf.write([0, 1, 3, 3])
    assert buf.host.tolist() == [0, 1, 3, 3]
    buf.write(torch.tensor([[5, 6], [7, 8]]))
    assert buf.host.tolist() == [5, 6, 7, 8]
    with pytest.raises(ValueError, match="every element"):
        buf.write([1, 2])
    assert buf.host.tolist() == [5, 6, 7, 8] and buf.device.tolist() == [0, 0, 0, 0]  # no upload by itself
    with pytest.raises(TypeError, match="int32 values"):
        buf.write([0, 1.5, 2, 3])  # not an integer
    with pytest.raises(TypeError, match="int32 values"):
        buf.write([0, 1, 2, 2**31])  # out of range
    flags = bcg.StagingBuffer(3, dtype=torch.bool, device="cpu")
    flags.write([True, 0, 1])
    halves = bcg.StagingBuffer(2, dtype=torch.float16, device="cpu")
    halves.write([0.5, -2])
    assert flags.host.tolist() == [True, False, True] and halves.host.tolist() == [0.5, -2.0]
    with pytest.raises(TypeError, match="bfloat16"):
        bcg.StagingBuffer(2, dtype=torch.bfloat16, device="cpu")


def test_a_tensor_of_the_buffers_dtype_is_copied_whole_and_still_collected_for_upload() -> None:
    """The memcpy route (large metadata such as block tables; a tensor or a NumPy array): the same
    checks of size, the buffer collected for upload like a packed write; another dtype is packed
    and range-checked."""
    from bcg.staged.staging import collecting

    table = bcg.StagingBuffer((3, 4), dtype=torch.int32, device="cpu")
    values = torch.randint(0, 1000, (3, 4), dtype=torch.int32)
    with collecting() as written:
        table.write(values)
    assert written == [table] and torch.equal(table.host, values)
    with pytest.raises(ValueError, match="every element"):
        table.write(torch.zeros(11, dtype=torch.int32))
    with pytest.raises(TypeError, match="int32 values"):
        table.write(torch.full((12,), 2**31, dtype=torch.int64))
    array = values.numpy() + 1  # a NumPy array: the same route
    with collecting() as written:
        table.write(array)
    assert written == [table] and table.host.tolist() == array.tolist()


def test_a_replay_asks_each_fits_and_runs_each_prepare_once_bound_methods_included() -> None:
    from bcg.core.breakpoint import recording
    from bcg.staged.staging import StagedWarmup

    staging = _Staging()
    calls = {"fits": 0}

    class Bounds:
        def fits(self, lengths: tuple[int, ...]) -> bool:
            calls["fits"] += 1
            return len(lengths) <= SLOTS

    bounds = Bounds()
    seen = []
    a = bcg.breakpoint(name="a", prepare=staging.prepare, fits=bounds.fits)(lambda x: seen.append(bcg.live()))
    b = bcg.breakpoint(name="b", prepare=staging.prepare, fits=bounds.fits)(lambda x: seen.append(bcg.live()))
    assert a.__bcg_breakpoint__.prepare is not b.__bcg_breakpoint__.prepare  # two bound-method objects
    warmup = StagedWarmup()
    with recording(warmup, (4, 4)):
        a(1), b(1), a(1)
    staged_breakpoints = warmup.staged_breakpoints
    assert staging.prepared == [(4, 4)] and seen[0] is seen[1] is seen[2] and seen[0]["staged"]
    assert staged_breakpoints.names == ["a", "b"]
    calls["fits"] = 0
    assert staged_breakpoints.misfit((1, 1)) is None and calls["fits"] == 1  # one fits function: asked once
    assert staged_breakpoints.misfit((1,) * (SLOTS + 1)) == "a does not fit"
    staged_breakpoints.prepare((2, 6))
    assert staging.prepared == [(4, 4), (2, 6)] and staging.buffer.host.tolist() == [0, 2, 8, 8]
    assert staged_breakpoints.value(b.__bcg_breakpoint__) is seen[0]


def test_metadata_that_does_not_fit_when_recorded_records_a_breakpoint(caplog: pytest.LogCaptureFixture) -> None:
    staging, seen = _Staging(), []
    fn = _make(staging, seen)
    x = torch.randn(12, 5)
    graph = bcg.make_graph(fn, x, mode="eager", live=(3, 3, 3, 3))
    assert graph.stats().breakpoints == 2 and graph.staged == () and staging.prepared == []
    assert caplog.text.count("recorded as a breakpoint") == 1  # once per name
    for lengths in [(6, 6), (2, 2, 2, 6)]:
        x.copy_(torch.randn(12, 5))
        with bcg.live_scope(lengths):
            expected = fn(x)
        torch.testing.assert_close(graph.replay(lengths), expected)
    assert staging.prepared == []


def test_a_staging_kernel_that_cannot_be_built_is_tried_and_logged_once_per_device(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the kernel cannot be built (here NVRTC refuses; on a CPU build, CUDA is missing), each
    size falls back to the copy, and the device is tried and the reason logged once."""
    from bcg.core import cudart
    from bcg.staged import kernel

    def refuse(*args: object, **kwargs: object) -> bytes:
        raise RuntimeError("no NVRTC here")

    monkeypatch.setattr(cudart, "compile_cubin", refuse)
    monkeypatch.setattr(kernel, "_UNBUILDABLE", {})
    kernel.stage_kernel.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="bcg"):
            assert kernel.stage_kernel(0, 1) is None and kernel.stage_kernel(0, 2) is None
    finally:
        kernel.stage_kernel.cache_clear()
    assert len([r for r in caplog.records if "staging kernel cannot be built" in r.getMessage()]) == 1


@pytest.mark.parametrize(("driver", "nvrtc", "expected"), [
    (12010, (12, 1), "PARAM_BYTES"), (13000, (13, 0), "PARAM_BYTES"), (12000, (12, 8), "CLASSIC_PARAM_BYTES"),
    (12080, (12, 0), "CLASSIC_PARAM_BYTES"), (None, (12, 8), "CLASSIC_PARAM_BYTES")])
def test_values_past_4_kib_travel_in_parameters_only_with_a_cuda_12_1_driver_and_nvrtc(
        monkeypatch: pytest.MonkeyPatch, driver: int | None, nvrtc: tuple[int, int], expected: str) -> None:
    """Kernel parameters past 4 KiB need a CUDA 12.1 driver and NVRTC: with an older one (or where the
    version cannot be read: None), a value travels in parameters only up to the classic limit."""
    from bcg.core import cudart
    from bcg.staged import kernel

    def driver_version() -> int:
        if driver is None:
            raise RuntimeError("no driver here")
        return driver

    monkeypatch.setattr(cudart, "driver_version", driver_version)
    monkeypatch.setattr(cudart, "nvrtc_version", lambda: nvrtc)
    kernel.param_bytes.cache_clear()
    try:
        assert kernel.param_bytes() == getattr(kernel, expected)
    finally:
        kernel.param_bytes.cache_clear()
    assert kernel.CLASSIC_PARAM_BYTES == 4088 and kernel.PARAM_BYTES == 8184


def test_a_large_staging_kernel_that_cannot_be_built_leaves_the_small_ones_to_try(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """A size past the classic 4 KiB that fails to build (say, a driver that refuses large parameters)
    is logged for its size and does not mark the device unbuildable: the next small size is still
    tried (and here, failing too, marks it)."""
    from bcg.core import cudart
    from bcg.staged import kernel

    def refuse(*args: object, **kwargs: object) -> bytes:
        raise RuntimeError("no NVRTC here")

    monkeypatch.setattr(cudart, "compile_cubin", refuse)
    monkeypatch.setattr(kernel, "_UNBUILDABLE", {})
    kernel.stage_kernel.cache_clear()
    large = kernel.CLASSIC_PARAM_BYTES // 8 + 1
    try:
        with caplog.at_level("WARNING", logger="bcg"):
            assert kernel.stage_kernel(0, large) is None
            assert kernel._UNBUILDABLE == {}
            assert kernel.stage_kernel(0, 1) is None
            assert 0 in kernel._UNBUILDABLE
    finally:
        kernel.stage_kernel.cache_clear()
    assert f"for {large * 8} bytes cannot be built" in caplog.text
