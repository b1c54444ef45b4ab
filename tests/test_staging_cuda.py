"""Staged breakpoints on a GPU: attention captured inline, bit-identical to eager, with a breakable fallback."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

import pytest
import torch

import bcg
from bcg.capture import capture_into
from bcg.core.plan import BreakpointStep
from bcg.core.session import CaptureOptions
from bcg.errors import StreamForkError

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("every_tier_kept")]  # (tests of what tiers do)

if not torch.cuda.is_available():  # pragma: no cover - collected on CPU machines
    pytest.skip("needs an NVIDIA GPU (CUDA not available)", allow_module_level=True)

SLOTS = 4
HEADS, KV_HEADS, HEAD_DIM, HIDDEN = 8, 2, 64, 512
DTYPE = torch.bfloat16
FLASH = torch.ops.aten._flash_attention_forward.default


@dataclass(frozen=True)
class Meta:
    """Live metadata: request lengths; ``cu``/``max_len`` set only in the staged form."""

    lengths: tuple[int, ...]
    cu: torch.Tensor | None = None
    bound: int | None = None
    slots: int | None = None  # a staged tier's capture: the slots it is captured for

    @property
    def max_len(self) -> int:
        return self.bound if self.bound is not None else max(self.lengths)


class Staging:
    """cu_seqlens for SLOTS requests; unused slots repeat the last offset (zero-length requests)."""

    def __init__(self, forget_last: bool = False) -> None:
        self.buffer = bcg.StagingBuffer(SLOTS + 1, dtype=torch.int32)
        self.forget_last = forget_last  # a deliberately incomplete prepare, for verify
        self.calls = 0

    def prepare(self, meta: Meta) -> Meta:
        self.calls += 1
        lengths = meta.lengths[:-1] if self.forget_last and len(meta.lengths) > 1 else meta.lengths
        offsets = list(itertools.accumulate(lengths, initial=0))
        offsets += [offsets[-1]] * (SLOTS + 1 - len(offsets))
        self.buffer.write(offsets)
        return Meta(meta.lengths, self.buffer.device, bound=sum(meta.lengths))

    @staticmethod
    def fits(meta: Meta) -> bool:
        return len(meta.lengths) <= SLOTS


def _attention_body(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
    meta = bcg.live()
    cu = meta.cu
    if cu is None:  # the real metadata (eager, or the breakable form): exact offsets
        cu = torch.tensor(list(itertools.accumulate(meta.lengths, initial=0)), dtype=torch.int32, device=q.device)
    out.copy_(FLASH(q, k, v, cu, cu, meta.max_len, meta.max_len, 0.0, True, False)[0])


def _make_attention(staging: Staging):  # noqa: ANN202
    return bcg.breakpoint(name="attn", mutates=("out",), prepare=staging.prepare, fits=staging.fits)(_attention_body)


class Block(torch.nn.Module):
    def __init__(self, attention, layers: int = 2, compiled: bool = False) -> None:  # noqa: ANN001
        super().__init__()
        g = torch.Generator(device="cuda").manual_seed(0)
        qkv = (HEADS + 2 * KV_HEADS) * HEAD_DIM
        self.w_qkv = [torch.randn(HIDDEN, qkv, device="cuda", dtype=DTYPE, generator=g) * 0.04 for _ in range(layers)]
        self.w_o = [torch.randn(HEADS * HEAD_DIM, HIDDEN, device="cuda", dtype=DTYPE, generator=g) * 0.04 for _ in range(layers)]
        self.attention = attention
        self.mlp = torch.compile(self._mlp, dynamic=True) if compiled else self._mlp

    @staticmethod
    def _mlp(x: torch.Tensor, o: torch.Tensor, w_o: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.rms_norm(x + o @ w_o, (x.shape[-1],))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T = x.shape[0]
        for w_qkv, w_o in zip(self.w_qkv, self.w_o):
            q, k, v = (x @ w_qkv).split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
            out = torch.empty(T, HEADS, HEAD_DIM, device=x.device, dtype=x.dtype)
            self.attention(q.reshape(T, HEADS, HEAD_DIM), k.reshape(T, KV_HEADS, HEAD_DIM),
                           v.reshape(T, KV_HEADS, HEAD_DIM), out)
            x = self.mlp(x, out.reshape(T, HEADS * HEAD_DIM), w_o)
        return x


def _lengths(rng: random.Random, T: int, requests: int) -> tuple[int, ...]:
    cuts = sorted(rng.sample(range(1, T), requests - 1)) if requests > 1 else []
    return tuple(b - a for a, b in zip([0, *cuts], [*cuts, T]))


def _capture_meta(n: int) -> Meta:
    return Meta(_lengths(random.Random(n), n, min(SLOTS, n)))


def _runner(block: Block, buckets: list[int], live=_capture_meta) -> bcg.GraphRunner:  # noqa: ANN001
    x = torch.randn(buckets[-1], HIDDEN, device="cuda", dtype=DTYPE)
    return bcg.GraphRunner(block, buckets=buckets, example_inputs=(x,), live=live, progress=False).capture()


def _eager(block: Block, x: torch.Tensor, meta: Meta) -> torch.Tensor:
    with bcg.live_scope(meta), torch.no_grad():
        return block(x)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager-regions", "torch.compile"])
def test_inline_replays_are_bit_identical_to_eager_and_misfits_fall_back(compiled: bool) -> None:
    staging = Staging()
    block = Block(_make_attention(staging), compiled=compiled)
    buckets = [64, 256]
    for n in buckets:  # compile (and autotune) every shape before capturing
        _eager(block, torch.randn(n, HIDDEN, device="cuda", dtype=DTYPE), _capture_meta(n))
    runner = _runner(block, buckets)
    rng = random.Random(1)
    assert runner.graph(256).staged == ("attn",)
    expected_inline = 0
    expected_fallback = 0
    for i in range(120 if not compiled else 40):
        T = rng.randint(SLOTS + 1, 256)
        requests = rng.randint(1, SLOTS + 1)  # SLOTS + 1 does not fit: the breakable form runs
        meta = Meta(_lengths(rng, T, requests))
        x = torch.randn(T, HIDDEN, device="cuda", dtype=DTYPE)
        calls = staging.calls
        y = runner(x, live=meta)
        ref = _eager(block, x, meta)
        assert torch.equal(y, ref), f"call {i}: T={T}, lengths={meta.lengths}"
        if requests <= SLOTS:
            expected_inline += 1
            assert staging.calls == calls + 1  # one prepare per forward, shared by both layers
        else:
            expected_fallback += 1
            assert staging.calls == calls
    stats = runner.stats()
    assert stats["inline_replays"] == expected_inline and expected_inline > 0
    assert stats["staged_fallbacks"] == {"attn does not fit": expected_fallback} and expected_fallback > 0
    runner.reset()


def test_fifty_length_sets_per_bucket_from_one_to_all_slots() -> None:
    staging = Staging()
    block = Block(_make_attention(staging), layers=3)
    buckets = [32, 128, 512]
    runner = _runner(block, buckets)
    rng = random.Random(7)
    for n in buckets:
        for requests in itertools.islice(itertools.cycle(range(1, SLOTS + 1)), 50):
            T = rng.randint(max(requests, n // 2 + 1), n)
            meta = Meta(_lengths(rng, T, requests))
            x = torch.randn(T, HIDDEN, device="cuda", dtype=DTYPE)
            assert torch.equal(runner(x, live=meta), _eager(block, x, meta)), (n, meta.lengths)
    assert runner.stats()["inline_replays"] == 150 and runner.stats()["staged_fallbacks"] == {}
    runner.reset()


class TieredStaging(Staging):
    """The same offsets; a capture for fewer slots (``meta.slots``) reads their prefix, and
    ``fits`` checks the slots of the capture it is asked for (``fits_calls``: how often)."""

    fits_calls = 0

    def prepare(self, meta: Meta) -> Meta:
        staged = super().prepare(meta)
        slots = meta.slots or SLOTS
        return Meta(meta.lengths, staged.cu[: slots + 1], bound=staged.bound)  # type: ignore[index]

    def fits(self, meta: Meta, staged: Meta) -> bool:  # type: ignore[override]
        assert staged.cu is not None
        self.fits_calls += 1
        return len(meta.lengths) <= staged.cu.shape[0] - 1


def test_a_lazy_runners_first_bucket_gets_its_tiers_with_the_next_capture() -> None:
    """lazy=True with staged tiers: the first bucket is captured without its tiers (its inline and
    breakable forms serve every call, bit-identical to eager); the next bucket's capture captures it
    again with them. Calls before and after replay bit-identically."""
    staging = TieredStaging()
    block = Block(_make_attention(staging), layers=2)

    def tiers(n: int) -> bcg.StagedTiers:
        rng = random.Random(n)
        return bcg.StagedTiers(*(Meta(_lengths(rng, n, min(k, n)), slots=k) for k in (1, 2)), _capture_meta(n))

    x0 = torch.randn(128, HIDDEN, device="cuda", dtype=DTYPE)
    runner = bcg.GraphRunner(block, buckets=[32, 128], example_inputs=(x0,), live=tiers, progress=False,
                             lazy=True)
    rng = random.Random(5)

    def call(T: int, requests: int) -> None:
        meta = Meta(_lengths(rng, T, requests))
        x = torch.randn(T, HIDDEN, device="cuda", dtype=DTYPE)
        assert torch.equal(runner(x, live=meta), _eager(block, x, meta)), (T, meta.lengths)

    all_forms = ["tier 0", "tier 1", "inline", "breakable"]
    call(30, 3)  # eager; bucket 32 captured without its tiers
    assert [f.name for f in runner.graph(32).forms] == ["inline", "breakable"]
    for requests in (1, 2, 4, 5):
        call(rng.randint(20, 32), requests)
    assert runner.stats()["tier_replays"] == 0 and runner.stats()["inline_replays"] == 3
    call(100, 2)  # eager; bucket 128 captured, and bucket 32 again, with its tiers
    assert [f.name for f in runner.graph(32).forms] == all_forms == [f.name for f in runner.graph(128).forms]
    for n in (32, 128):
        for requests in (1, 2, 4, 5):
            call(rng.randint(n - 10, n), requests)
    stats = runner.stats()
    assert stats["tier_replays"] == 4 and stats["fallbacks"]["not_captured_yet"] == 2
    runner.reset()


def test_staged_tiers_run_the_fewest_slots_that_fit_and_stay_bit_identical() -> None:
    """Per bucket, tiers of 1 and 2 slots before the bucket's own 4: a call runs the first that
    holds its requests (1, 2, 4 slots, or the breakable form past 4), each bit-identical to eager,
    all returning the bucket's own output tensors. Each tier tried asks ``fits`` once, and the
    one that runs is not asked again."""
    staging = TieredStaging()
    block = Block(_make_attention(staging), layers=2)
    buckets = [32, 128]
    asked: dict[int, int] = {}

    def tiers(n: int) -> bcg.StagedTiers:
        asked[n] = asked.get(n, 0) + 1
        rng = random.Random(n)
        return bcg.StagedTiers(*(Meta(_lengths(rng, n, min(k, n)), slots=k) for k in (1, 2)), _capture_meta(n))

    runner = _runner(block, buckets, live=tiers)
    for n in buckets:
        assert [f.name for f in runner.graph(n).forms] == ["tier 0", "tier 1", "inline", "breakable"]
    # a bucket's capture (warm-up, forms, tiers) asks live once; 32 is also the probe run's size
    assert asked == {32: 2, 128: 1}, asked
    rng = random.Random(3)
    ran = {1: 0, 2: 0}
    for i in range(60):
        n = buckets[i % 2]
        requests = [1, 2, 3, 4, 5][i % 5]
        T = n if i % 3 == 0 else rng.randint(max(requests, n // 2), n)  # T = bucket: no zeroing
        meta = Meta(_lengths(rng, T, requests))
        x = torch.randn(T, HIDDEN, device="cuda", dtype=DTYPE)
        before = [f.replays for f in runner.graph(n).forms[:2]]
        asked = staging.fits_calls
        y = runner(x, live=meta)
        # tiers tried in order, then (none fits) the bucket's own graph asks once
        assert staging.fits_calls - asked == {1: 1, 2: 2}.get(requests, 3), (i, requests)
        assert torch.equal(y, _eager(block, x, meta)), f"call {i}: T={T}, lengths={meta.lengths}"
        after = [f.replays for f in runner.graph(n).forms[:2]]
        expected = [int(requests == 1), int(requests == 2)]
        assert [b - a for a, b in zip(before, after)] == expected, (i, requests)
        if requests <= 2:
            ran[requests] += 1
    for n in buckets:  # the zeroing skipped: trimmed executables inline, disabled nodes in the breakable form
        *staged_forms, breakable = runner.graph(n).forms
        assert all(s.in_place is not None for s in breakable.segments)
        assert sum(len(s.trimmed) for f in staged_forms for s in f.segments) >= 1
        assert sum(len(s.trimmed) for s in breakable.segments) == 0
    stats = runner.stats()
    assert stats["tier_replays"] == ran[1] + ran[2] == 24
    assert stats["inline_replays"] == 48 and stats["staged_fallbacks"] == {"attn does not fit": 12}
    graphs = [runner.graph(32), runner.graph(128)]
    runner.reset()
    assert not any(g.is_captured for g in graphs)  # freed with the runner


@pytest.mark.parametrize("native", ["1", "0"], ids=["native", "python"])
def test_without_a_breakable_form_a_call_that_fits_no_form_runs_eagerly(monkeypatch: pytest.MonkeyPatch,
                                                                        native: str) -> None:
    """StagedTiers(breakable=False): each bucket holds its tier and inline form only; a call with
    more requests than any form holds runs forward eagerly (fallback "staged_unfit", nothing
    launched, no prepare), equal to eager; the calls that fit still replay inline."""
    monkeypatch.setenv("BCG_NATIVE", native)
    staging = TieredStaging()
    block = Block(_make_attention(staging), layers=2)
    buckets = [32, 128]

    def tiers(n: int) -> bcg.StagedTiers:
        return bcg.StagedTiers(Meta(_lengths(random.Random(n), n, 1), slots=1), _capture_meta(n), breakable=False)

    runner = _runner(block, buckets, live=tiers)
    for n in buckets:
        assert [f.name for f in runner.graph(n).forms] == ["tier 0", "inline"]
    rng = random.Random(5)
    unfit = 0
    for i in range(30):
        n = buckets[i % 2]
        requests = [1, 3, 5][i % 3]  # 5 > SLOTS: no form holds it
        T = rng.randint(max(requests, n // 2), n)
        meta = Meta(_lengths(rng, T, requests))
        x = torch.randn(T, HIDDEN, device="cuda", dtype=DTYPE)
        prepared = staging.calls
        y = runner(x, live=meta)
        assert torch.equal(y, _eager(block, x, meta)), f"call {i}: T={T}, lengths={meta.lengths}"
        assert staging.calls - prepared == int(requests <= SLOTS)
        unfit += requests > SLOTS
    stats = runner.stats()
    assert stats["fallbacks"]["staged_unfit"] == unfit == 10
    assert stats["inline_replays"] == 20 and stats["tier_replays"] > 0 and stats["staged_fallbacks"] == {}
    runner.reset()


def test_padded_rows_carry_no_nan_under_poison(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BCG_POISON", "1")
    staging = Staging()
    block = Block(_make_attention(staging))
    runner = _runner(block, [256])
    rng = random.Random(3)
    for T in (1, 5, 100, 255):
        meta = Meta(_lengths(rng, T, min(T, SLOTS)))
        x = torch.randn(T, HIDDEN, device="cuda", dtype=DTYPE)
        y = runner(x, live=meta)
        assert torch.equal(y, _eager(block, x, meta))
        assert not torch.isnan(runner.bucket_outputs(256)).any(), f"T={T}: NaN in the bucket's rows"
    runner.reset()


def test_make_graph_holds_both_forms_and_outputs_are_the_same_tensors() -> None:
    staging = Staging()
    block = Block(_make_attention(staging))
    x = torch.randn(128, HIDDEN, device="cuda", dtype=DTYPE)
    graph = bcg.make_graph(block, x, live=Meta((50, 78)))
    out = graph.outputs
    inline, breakable = graph.forms
    assert (inline.name, breakable.name) == ("inline", "breakable") and graph.stats().breakpoints == 0
    assert sum(isinstance(s, BreakpointStep) for s in breakable.plan) == 2
    rng = random.Random(5)
    for requests in (1, 4, 6, 2, 5):
        meta = Meta(_lengths(rng, 128, requests))
        x.copy_(torch.randn_like(x))
        y = graph.replay(meta)
        assert y is out
        assert torch.equal(out, _eager(block, x, meta))
    staged = graph.stats().staged
    assert staged.inline_replays == 3 and staged.breakable_replays == {"attn does not fit": 2}
    graph.reset()


def test_the_host_prepares_while_the_gpu_runs_the_work_before_the_first_staged_copy() -> None:
    """A staged form launches its work up to the first staged copy, then runs ``prepare``, then
    launches the rest: ``prepare`` finds the stream busy with a long prelude, every replay prepares
    once, and the results stay bit-identical to eager, in the inline form and in the breakable one."""
    busy: list[bool] = []

    class Watching(Staging):
        def prepare(self, meta: Meta) -> Meta:
            if not torch.cuda.is_current_stream_capturing():  # (a capture runs prepare too; no query then)
                busy.append(not torch.cuda.current_stream().query())
            return super().prepare(meta)

    staging = Watching()
    block = Block(_make_attention(staging))
    w = torch.randn(2048, 2048, device="cuda", dtype=DTYPE) / 2048**0.5

    def forward(x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        for _ in range(40):  # (milliseconds of GPU work before the first attention)
            h = torch.tanh(h @ w)
        return block(x + h[: x.shape[0], :HIDDEN]), h

    x = torch.randn(128, HIDDEN, device="cuda", dtype=DTYPE)
    h = torch.randn(2048, 2048, device="cuda", dtype=DTYPE)
    graph = bcg.make_graph(forward, x, h, live=Meta((50, 78)))
    inline = graph.forms[0]
    assert inline.name == "inline" and inline.recording.stage_at == 1  # the prelude's segment comes first
    rng = random.Random(9)
    for requests in (1, 4, 6, 3, 2, 5):
        meta = Meta(_lengths(rng, 128, requests))
        x.copy_(torch.randn_like(x))
        h.copy_(torch.randn_like(h))
        with bcg.live_scope(meta), torch.no_grad():
            expected = forward(x, h)
        torch.cuda.synchronize()
        busy.clear()
        calls = staging.calls
        y = graph.replay(meta)
        assert all(torch.equal(a, b) for a, b in zip(y, expected)), (requests, meta.lengths)
        if requests <= SLOTS:  # inline: one prepare, after the prelude was launched
            assert staging.calls == calls + 1 and busy == [True], (requests, busy)
        else:  # the breakable form: the attention's eager run reads the real metadata
            assert staging.calls == calls
    graph.reset()


def test_side_stream_work_across_a_staged_breakpoint_captures_with_bcg_capture_only() -> None:
    """Work forked to a side stream before a staged breakpoint (a prefetch overlapped with
    attention), joined after it, or joined before it and waited on again after it.
    ``bcg.capture`` (the inline form only) does not end the segment at the staged copy: it captures
    one segment, ``prepare`` runs once before the launch, and replays stay bit-identical to eager.
    ``make_graph`` ends segments there (its inline form at the first staged copy, its breakable form
    at the breakpoint): it raises :class:`bcg.errors.StreamForkError` and leaves CUDA clean."""
    staging = Staging()
    block = Block(_make_attention(staging), layers=1)
    side = torch.cuda.Stream()
    w = torch.randn(HIDDEN, HIDDEN, device="cuda", dtype=DTYPE) / HIDDEN**0.5

    def forward(x: torch.Tensor, join_first: bool) -> torch.Tensor:
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            prefetch = torch.tanh(x @ w)
        if join_first:
            main.wait_stream(side)
        y = block(x)
        main.wait_stream(side)
        return y + prefetch

    x = torch.randn(128, HIDDEN, device="cuda", dtype=DTYPE)
    rng = random.Random(11)
    for join_first in (False, True):
        with torch.no_grad(), pytest.raises(StreamForkError):
            bcg.make_graph(forward, x, join_first, live=Meta((50, 78)))
        assert not torch.cuda.is_current_stream_capturing()
        torch.cuda.synchronize()  # (no sticky error; the capture below works)
        graph = bcg.BreakableGraph()
        with bcg.capture(graph, live=Meta((50, 78))), torch.no_grad():
            out = forward(x, join_first)
        assert graph.forms[0].recording.stage_at is None and graph.stats().segments == 1
        for requests in (1, 3, 4, 2):
            meta = Meta(_lengths(rng, 128, requests))
            x.copy_(torch.randn_like(x))
            with bcg.live_scope(meta), torch.no_grad():
                expected = forward(x, join_first)
            torch.cuda.synchronize()
            calls = staging.calls
            graph.replay(meta)
            assert torch.equal(out, expected), (join_first, meta.lengths)
            assert staging.calls == calls + 1  # inline: prepared once
        graph.reset()


def test_a_skipped_group_is_skipped_in_the_fallback_from_its_next_replay() -> None:
    """set_enabled switches the inline form at once and the breakable form right before it next
    replays (nodes disabled in place: no executable built for it); each form skips the group's
    work while it is off and runs it again once it is back on."""
    staging = Staging()
    block = Block(_make_attention(staging))
    counter = torch.zeros(4, device="cuda")

    def fn(x: torch.Tensor) -> torch.Tensor:
        y = block(x)
        with bcg.core.session.node_group("count"):
            counter.add_(1)
        return y

    x = torch.randn(128, HIDDEN, device="cuda", dtype=DTYPE)
    graph = bcg.make_graph(fn, x, live=Meta((50, 78)))
    fallback = graph.forms[-1]
    assert fallback.breakable and all(s.in_place is not None for s in fallback.segments)
    rng = random.Random(11)

    def replay(requests: int, counted: int) -> None:
        meta = Meta(_lengths(rng, 128, requests))
        x.copy_(torch.randn_like(x))
        before = counter.clone()
        y = graph.replay(meta)
        assert torch.equal(counter, before + counted), (requests, counted)
        with bcg.live_scope(meta), torch.no_grad():
            assert torch.equal(y, block(x))

    assert graph.set_enabled("count", False)
    assert graph.forms[0].disabled == {"count"} and fallback.disabled == frozenset()  # not switched yet
    replay(2, 0)  # inline
    replay(6, 0)  # the fallback, switched first
    assert fallback.disabled == {"count"} and sum(len(s.trimmed) for s in fallback.segments) == 0
    assert graph.set_enabled("count", True)
    replay(5, 1)
    replay(3, 1)
    assert fallback.disabled == frozenset() and graph.stats().staged.breakable_replays == {"attn does not fit": 2}
    graph.reset()


def test_a_graph_with_no_breakable_form_refuses_metadata_that_does_not_fit() -> None:
    block = Block(_make_attention(Staging()))
    x = torch.randn(64, HIDDEN, device="cuda", dtype=DTYPE)
    _eager(block, x, Meta((64,)))
    graph = bcg.BreakableGraph()
    with bcg.capture(graph, live=Meta((64,))):
        out = block(x)
    assert graph.replay(Meta((30, 34))) is None
    assert torch.equal(out, _eager(block, x, Meta((30, 34))))
    with pytest.raises(bcg.ReplayError, match="does not fit"):
        graph.replay(Meta((10,) * 5 + (14,)))
    # its breakable form added as make_graph adds it: captured into its pool, after its outputs are set
    graph.outputs = out
    capture_into(graph, lambda: block(x), CaptureOptions(live=Meta((64,))), form="breakable")
    too_many = Meta((10,) * 5 + (14,))
    assert graph.replay(too_many) is out
    assert torch.equal(out, _eager(block, x, too_many))
    graph.reset()


def test_verify_covers_inline_and_fallback_and_catches_an_incomplete_prepare() -> None:
    def make_inputs() -> tuple[torch.Tensor]:
        return (torch.randn(96, HIDDEN, device="cuda", dtype=DTYPE),)

    rng = random.Random(11)
    samples = [Meta(_lengths(rng, 96, r)) for r in (1, 2, 3, 4, 5, 6)]
    report = bcg.verify(Block(_make_attention(Staging())), make_inputs, samples)
    assert report.ok and report.samples == 6
    with pytest.raises(bcg.errors.VerificationError, match="output"):
        bcg.verify(Block(_make_attention(Staging(forget_last=True))), make_inputs, samples)


def test_capture_metadata_that_does_not_fit_gives_the_breakable_form(caplog: pytest.LogCaptureFixture) -> None:
    block = Block(_make_attention(Staging()))
    x = torch.randn(120, HIDDEN, device="cuda", dtype=DTYPE)
    too_many = Meta((20,) * 6)
    graph = bcg.make_graph(block, x, live=too_many)
    assert "recorded as a breakpoint" in caplog.text
    assert graph.staged == () and graph.stats().breakpoints == 2 and len(graph.forms) == 1
    for meta in (Meta((60, 60)), too_many):
        x.copy_(torch.randn_like(x))
        assert torch.equal(graph.replay(meta), _eager(block, x, meta))
    graph.reset()


def test_a_max_seqlen_over_the_bound_falls_back_and_stays_exact() -> None:
    bound = 48

    class Tight(Staging):
        def prepare(self, meta: Meta) -> Meta:
            staged = super().prepare(meta)
            return Meta(staged.lengths, staged.cu, bound=bound)  # max_seqlen: 48, not the bucket

        @staticmethod
        def fits(meta: Meta) -> bool:
            return len(meta.lengths) <= SLOTS and max(meta.lengths) <= bound

    staging = Tight()
    block = Block(_make_attention(staging))
    runner = _runner(block, [128], live=lambda n: Meta((n // SLOTS,) * SLOTS))  # each request <= bound
    assert runner.graph(128).staged == ("attn",)
    rng = random.Random(13)
    expected = {"attn does not fit": 0}
    for _ in range(30):
        T = rng.randint(60, 128)
        meta = Meta(_lengths(rng, T, rng.randint(2, SLOTS)))
        expected["attn does not fit"] += max(meta.lengths) > bound
        x = torch.randn(T, HIDDEN, device="cuda", dtype=DTYPE)
        assert torch.equal(runner(x, live=meta), _eager(block, x, meta)), meta.lengths
    stats = runner.stats()
    assert 0 < expected["attn does not fit"] < 30
    assert stats["staged_fallbacks"] == expected and stats["inline_replays"] == 30 - expected["attn does not fit"]
    runner.reset()


def test_verify_with_capture_metadata_that_does_not_fit() -> None:
    def make_inputs() -> tuple[torch.Tensor]:
        return (torch.randn(96, HIDDEN, device="cuda", dtype=DTYPE),)

    rng = random.Random(17)
    samples = [Meta(_lengths(rng, 96, r)) for r in (6, 2, 5)]  # the capture's (the first) does not fit
    report = bcg.verify(Block(_make_attention(Staging())), make_inputs, samples)
    assert report.ok and report.graph.staged == () and report.graph.stats().breakpoints == 2


def test_reset_from_a_breakpoint_of_the_fallback_is_refused_and_frees_nothing() -> None:
    holder: dict[str, bcg.BreakableGraph] = {}
    staging = Staging()

    @bcg.breakpoint(name="attn", mutates=("out",), prepare=staging.prepare, fits=staging.fits)
    def attention(q, k, v, out):  # noqa: ANN001, ANN202
        if "graph" in holder and len(bcg.live().lengths) > SLOTS and bcg.live().cu is None:
            holder["graph"].reset()
        _attention_body(q, k, v, out)

    block = Block(attention)
    x = torch.randn(64, HIDDEN, device="cuda", dtype=DTYPE)
    graph = bcg.make_graph(block, x, live=Meta((32, 32)))
    holder["graph"] = graph
    with pytest.raises(bcg.ReplayError, match="while this graph is replaying"):
        graph.replay(Meta((10,) * 5 + (14,)))
    assert graph.is_captured and len(graph.forms) == 2
    meta = Meta((20, 44))
    assert torch.equal(graph.replay(meta), _eager(block, x, meta))
    holder.clear()
    graph.reset()
    assert not graph.is_captured


def test_ranks_vote_that_a_bucket_stands_before_its_staged_tiers(monkeypatch: pytest.MonkeyPatch) -> None:
    """With ranks, every rank confirms a bucket's graph and breakable form (a vote) before the
    tiers' eager warm-ups: a peer that failed the bucket after its last vote there is learnt at
    that vote, and the bucket fails on this rank too (it runs eagerly), not inside a tier's capture.
    The peer is simulated: a stand-in agreement whose next vote says the peer failed."""
    from bcg.runner import ladder

    staging = TieredStaging()
    block = Block(_make_attention(staging))
    peer = {"failed": False}
    real_capture_into = ladder.capture_into

    def capture_into(graph, fn, options, **kwargs):  # noqa: ANN001, ANN003, ANN202
        out = real_capture_into(graph, fn, options, **kwargs)
        if kwargs.get("form") == "breakable":
            peer["failed"] = sum(options.live.lengths) == 64  # the peer fails bucket 64 right after this
        return out

    class OnePeer:  # RankAgreement(same_inputs=True), as this rank sees its peer
        same_inputs = True

        def all(self, flag: bool) -> bool:
            ok = flag and not peer["failed"]
            peer["failed"] = False
            return ok

        def expect_same(self, choice: dict[str, int]) -> None:
            pass

    def tiers(n: int) -> bcg.StagedTiers:
        return bcg.StagedTiers(Meta(_lengths(random.Random(n), n, 1), slots=1), _capture_meta(n))

    monkeypatch.setattr(ladder, "capture_into", capture_into)
    x = torch.randn(64, HIDDEN, device="cuda", dtype=DTYPE)
    runner = bcg.GraphRunner(block, buckets=[32, 64], example_inputs=(x,), live=tiers, progress=False,
                             ranks=OnePeer()).capture()  # type: ignore[arg-type]
    assert sorted(runner.failed_buckets) == [64] and "another rank" in runner.failed_buckets[64]
    with pytest.raises(KeyError):
        runner.graph(64)
    assert sum(f.name.startswith("tier") for f in runner.graph(32).forms) == 1  # bucket 32 and its tier voted through
    rng = random.Random(5)
    for T, requests in ((50, 1), (20, 1), (30, 3)):  # eager (bucket 64), bucket 32's tier, its graph
        meta = Meta(_lengths(rng, T, requests))
        x = torch.randn(T, HIDDEN, device="cuda", dtype=DTYPE)
        assert torch.equal(runner(x, live=meta), _eager(block, x, meta)), (T, requests)
    stats = runner.stats()
    assert stats["fallbacks"]["capture_failed"] == 1 and stats["tier_replays"] == 1 and stats["inline_replays"] == 2
    runner.reset()


def test_inline_replays_run_in_c_and_equal_the_python_executors(monkeypatch: pytest.MonkeyPatch) -> None:
    """A native graph's inline and tier replays are chosen and launched in C (no Python form run), the
    breakable form's through Python; with the Python executor every replay runs in Python. Both give
    the same outputs, fits and prepare calls, and counts."""
    from bcg.graph import Form

    ran = {"python": 0}
    real = Form.run

    def counted(self, *args, **kwargs):  # noqa: ANN001,ANN202
        ran["python"] += 1
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Form, "run", counted)
    staging = TieredStaging()
    block = Block(_make_attention(staging), layers=2)

    def tiers(n: int) -> bcg.StagedTiers:
        rng = random.Random(n)
        return bcg.StagedTiers(*(Meta(_lengths(rng, n, min(k, n)), slots=k) for k in (1, 2)), _capture_meta(n))

    runner = _runner(block, [64], live=tiers)
    graph = runner.graph(64)
    rng = random.Random(11)
    calls = [(torch.randn(64, HIDDEN, device="cuda", dtype=DTYPE), Meta(_lengths(rng, 64, r))) for r in (1, 2, 3, 5, 4)]
    results = {}
    for executor in ("native", "python"):
        graph.use_executor(executor)
        ran["python"], fits0, prepares0 = 0, staging.fits_calls, staging.calls
        forms0 = [f.replays for f in graph.forms]
        results[executor] = [runner(x, live=meta).clone() for x, meta in calls]
        results[executor + " asked"] = (staging.fits_calls - fits0, staging.calls - prepares0,
                                        [f.replays - b for f, b in zip(graph.forms, forms0)])
        assert ran["python"] == (1 if executor == "native" else len(calls)), executor  # native: the 5 requests' only
    for a, b, (x, meta) in zip(results["native"], results["python"], calls):
        assert torch.equal(a, b) and torch.equal(a, _eager(block, x, meta))
    assert results["native asked"] == results["python asked"]
    assert results["native asked"][2] == [1, 1, 2, 1]  # tier 0, tier 1, inline (3 and 4 requests), breakable
    runner.reset()
