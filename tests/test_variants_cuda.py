"""Keyed breakpoints on a GPU: variants captured per key, stitched into one graph, bit-identical to eager."""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass

import pytest
import torch

import bcg

pytestmark = pytest.mark.cuda

if not torch.cuda.is_available():  # pragma: no cover - collected on CPU machines
    pytest.skip("needs an NVIDIA GPU (CUDA not available)", allow_module_level=True)

T, HEADS, KV_HEADS, HEAD_DIM = 64, 4, 2, 16
HIDDEN = HEADS * HEAD_DIM
LAYERS = 3


@dataclass(frozen=True)
class Meta:
    lengths: tuple[int, ...]
    scale: float = 1.0  # a field the deliberately wrong key leaves out


def unfused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lengths: tuple[int, ...],
            scale: float = 1.0) -> None:
    """Causal attention request by request: ~10 small launches each, the lengths decide the shapes."""
    rep = q.shape[1] // k.shape[1]
    start = 0
    for n in lengths:
        end = start + n
        qs = q[start:end].transpose(0, 1)
        ks = k[start:end].repeat_interleave(rep, dim=1).transpose(0, 1)
        vs = v[start:end].repeat_interleave(rep, dim=1).transpose(0, 1)
        s = (qs @ ks.transpose(1, 2)) * (scale / HEAD_DIM**0.5)
        mask = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
        p = torch.softmax(s.masked_fill(mask, float("-inf")).float(), dim=-1).to(q.dtype)
        out[start:end].copy_((p @ vs).transpose(0, 1))
        start = end


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
    meta = bcg.live()
    unfused(q, k, v, out, meta.lengths, meta.scale)


attention = bcg.breakpoint(_attention, name="unfused", mutates=("out",), key=lambda m: (m.lengths, m.scale))
wrong_key_attention = bcg.breakpoint(_attention, name="unfused_wrong_key", mutates=("out",), key=lambda m: m.lengths)


class Model:
    def __init__(self, bp, seed: int = 0, dropout: float = 0.0, layers: int = LAYERS) -> None:
        g = torch.Generator(device="cuda").manual_seed(seed)
        self.wqkv = [torch.randn(HIDDEN, HIDDEN + 2 * KV_HEADS * HEAD_DIM, device="cuda", generator=g) * 0.1 for _ in range(layers)]
        self.wo = [torch.randn(HIDDEN, HIDDEN, device="cuda", generator=g) * 0.1 for _ in range(layers)]
        self.bp = bp
        self.dropout = dropout

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        for wqkv, wo in zip(self.wqkv, self.wo):
            h = torch.nn.functional.layer_norm(x, (HIDDEN,)) @ wqkv
            q = h[:, :HIDDEN].reshape(-1, HEADS, HEAD_DIM).contiguous()
            k = h[:, HIDDEN:HIDDEN + KV_HEADS * HEAD_DIM].reshape(-1, KV_HEADS, HEAD_DIM).contiguous()
            v = h[:, HIDDEN + KV_HEADS * HEAD_DIM:].reshape(-1, KV_HEADS, HEAD_DIM).contiguous()
            out = torch.empty_like(q)
            self.bp(q, k, v, out)
            o = out.reshape(-1, HIDDEN) @ wo
            if self.dropout:
                o = torch.nn.functional.dropout(o, self.dropout)
            x = x + o
        return x


def random_lengths(rng: random.Random, total: int = T, most: int = 4) -> tuple[int, ...]:
    r = rng.randint(1, most)
    cuts = sorted(rng.sample(range(1, total), r - 1))
    bounds = [0, *cuts, total]
    return tuple(b - a for a, b in zip(bounds, bounds[1:]))


def eager(model: Model, x: torch.Tensor, meta: Meta) -> torch.Tensor:
    with bcg.live_scope(meta):
        return model(x)


def test_hits_misses_and_stitched_replays_are_bit_identical_to_eager() -> None:
    rng = random.Random(0)
    pool = [random_lengths(rng) for _ in range(12)]
    model = Model(attention)
    x = torch.randn(T, HIDDEN, device="cuda")
    graph = bcg.make_graph(model, x, live=Meta(pool[0]))
    seen: set[tuple[int, ...]] = set()
    hit_once: set[tuple[int, ...]] = set()
    paths = {"miss": 0, "hit": 0, "first hit": 0}
    for i in range(60):
        lengths = pool[rng.randrange(len(pool))] if i % 5 else random_lengths(rng)  # some never repeat
        paths["hit" if lengths in seen else "miss"] += 1
        if lengths in seen and lengths not in hit_once:
            paths["first hit"] += 1  # launched through torch once (it learns that they draw no random numbers)
            hit_once.add(lengths)
        seen.add(lengths)
        x.copy_(torch.randn(T, HIDDEN, device="cuda"))
        want = eager(model, x.clone(), Meta(lengths))
        got = graph.replay(live=Meta(lengths))
        assert torch.equal(got, want), f"replay {i} with lengths {lengths} differs from eager"
    st = graph.stats().keyed["graph"]
    assert st is not None
    bp = st["breakpoints"]["unfused"]
    assert paths["miss"] >= 10 and paths["hit"] >= 20
    assert bp["misses"] == paths["miss"] * LAYERS  # a new key runs eagerly at every layer
    assert bp["captures"] == len(seen) * LAYERS
    assert st["stitched_replays"] == paths["hit"] - paths["first hit"], st  # later repeats: one launch each
    assert st["stitched"]["cached"] >= 1 and st["stitched"]["instantiations"] >= 1
    graph.reset()


def test_stitched_replays_equal_piecewise_replays() -> None:
    rng = random.Random(1)
    model = Model(attention)
    x = torch.randn(T, HIDDEN, device="cuda")
    stitched = bcg.make_graph(model, x, live=Meta((T,)))
    piecewise = bcg.make_graph(model, x, live=Meta((T,)), variants=bcg.VariantPolicy(stitch=False))
    tuples = [random_lengths(rng) for _ in range(4)]
    for i in range(24):
        meta = Meta(tuples[i % 4])
        x.copy_(torch.randn(T, HIDDEN, device="cuda"))
        a = stitched.replay(live=meta).clone()
        b = piecewise.replay(live=meta).clone()
        assert torch.equal(a, b)
    assert stitched.stats().keyed["graph"]["stitched_replays"] == 16  # 4 misses, 4 first hits piecewise
    pst = piecewise.stats().keyed["graph"]
    assert pst["stitched_replays"] == 0 and "off" in pst["stitch_blocker"]
    assert pst["breakpoints"]["unfused"]["hits"] == 20 * LAYERS  # variants launched one by one
    stitched.reset()
    piecewise.reset()


def test_a_keyed_graph_with_a_staged_value_in_kernel_parameters_replays_piecewise_and_equals_eager() -> None:
    """A staged breakpoint whose small value travels in a kernel's parameters, before a keyed one:
    each replay sets the value in the segment's own executable, so the graph is not stitched into
    one launch, and every replay (new keys and repeats) equals eager."""
    shift = bcg.StagingBuffer(1, dtype=torch.float32)
    assert shift.in_parameters

    def prepare(meta: Meta) -> torch.Tensor:
        shift.write([float(len(meta.lengths))])
        return shift.device

    @bcg.breakpoint(name="shift", mutates=("t",), prepare=prepare, fits=lambda meta: True)
    def add_shift(t: torch.Tensor) -> None:
        v = bcg.live()  # inline: the device buffer; eagerly: the metadata
        t.add_(v if isinstance(v, torch.Tensor) else float(len(v.lengths)))

    inner = Model(attention)

    def model(x: torch.Tensor) -> torch.Tensor:
        h = x * 2
        add_shift(h)
        return inner(h)

    rng = random.Random(3)
    x = torch.randn(T, HIDDEN, device="cuda")
    graph = bcg.make_graph(model, x, live=Meta((T,)))
    tuples = [random_lengths(rng) for _ in range(3)]
    for i in range(12):
        meta = Meta(tuples[i % 3])
        x.copy_(torch.randn(T, HIDDEN, device="cuda"))
        want = eager(model, x.clone(), meta)
        assert torch.equal(graph.replay(live=meta), want), i
    st = graph.stats().keyed["inline"]  # (the staged graph's first form; every replay fits it)
    assert st["stitched_replays"] == 0 and "kernel parameters" in st["stitch_blocker"]
    assert st["breakpoints"]["unfused"]["hits"] > 0
    graph.reset()


def test_segments_that_draw_random_numbers_are_not_stitched_and_match_eager() -> None:
    model = Model(attention, dropout=0.5)
    x = torch.randn(T, HIDDEN, device="cuda")
    graph = bcg.make_graph(model, x, live=Meta((T,)))
    st = graph.stats().keyed["graph"]
    assert "random" in st["stitch_blocker"]
    gen = torch.cuda.default_generators[torch.cuda.current_device()]
    for lengths in [(T,), (20, 44), (T,), (20, 44), (10, 10, 44)]:
        meta = Meta(lengths)
        state = gen.get_state()
        want = eager(model, x.clone(), meta)
        eager_end = gen.get_offset()
        gen.set_state(state)
        got = graph.replay(live=meta)
        assert torch.equal(got, want), lengths
        assert gen.get_offset() == eager_end  # the replay advanced the generator as eager did
    assert graph.stats().keyed["graph"]["breakpoints"]["unfused"]["hits"] == 2 * LAYERS
    graph.reset()


def test_a_breakpoint_that_draws_random_numbers_is_not_stitched() -> None:
    @bcg.breakpoint(name="noisy", mutates=("out",), key=lambda m: m.lengths)
    def noisy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
        unfused(q, k, v, out, bcg.live().lengths)
        out.add_(torch.rand_like(out))

    model = Model(noisy)
    x = torch.randn(T, HIDDEN, device="cuda")
    graph = bcg.make_graph(model, x, live=Meta((T,)))
    gen = torch.cuda.default_generators[torch.cuda.current_device()]
    for lengths in [(30, 34)] * 4:
        state = gen.get_state()
        want = eager(model, x.clone(), Meta(lengths))
        gen.set_state(state)
        assert torch.equal(graph.replay(live=Meta(lengths)), want)
    st = graph.stats().keyed["graph"]
    assert st["stitched_replays"] == 0 and st["breakpoints"]["noisy"]["hits"] == 3 * LAYERS
    graph.reset()


def test_evicting_variants_returns_their_memory() -> None:
    big = 32 << 20  # each variant holds a 32 MiB temporary in its pool

    @bcg.breakpoint(name="wide", mutates=("out",), key=lambda m: m.lengths)
    def wide(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
        scratch = torch.empty(big // 4, device=q.device).fill_(float(len(bcg.live().lengths)))
        unfused(q, k, v, out, bcg.live().lengths)
        out.add_(scratch[:1].to(out.dtype) * 0)

    model = Model(wide, layers=1)
    x = torch.randn(T, HIDDEN, device="cuda")
    graph = bcg.make_graph(model, x, live=Meta((T,)), variants=bcg.VariantPolicy(max_variants=2))
    torch.cuda.synchronize()
    base = torch.cuda.memory_reserved()
    highs = []
    for a in range(8, 64, 7):  # 8 keys, none repeating
        meta = Meta((a, T - a))
        assert torch.equal(graph.replay(live=meta), eager(model, x.clone(), meta))
        torch.cuda.synchronize()
        highs.append(torch.cuda.memory_reserved() - base)
    st = graph.stats().keyed["graph"]
    assert st["entries"] == 2 and st["evictions"] == 6, st
    # one variant: its temporary, and the cuBLAS workspace its own capture allocated in its pool
    one = highs[0]
    assert one >= big, [h >> 20 for h in highs]
    assert max(highs) <= 3 * one, [h >> 20 for h in highs]  # two kept, one being captured
    assert highs[-1] <= highs[1] + (4 << 20), [h >> 20 for h in highs]  # evictions return their memory
    graph.reset()
    torch.cuda.synchronize()
    assert torch.cuda.memory_reserved() <= base + (4 << 20)


def test_an_uncapturable_breakpoint_runs_eagerly_with_the_reason_logged(caplog: pytest.LogCaptureFixture) -> None:
    @bcg.breakpoint(name="syncing", mutates=("out",), key=lambda m: m.lengths)
    def syncing(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
        unfused(q, k, v, out, bcg.live().lengths)
        if out.abs().max().item() < 0:  # a host sync: CUDA refuses it inside a capture
            out.zero_()

    model = Model(syncing, layers=2)
    x = torch.randn(T, HIDDEN, device="cuda")
    graph = bcg.make_graph(model, x, live=Meta((T,)))
    with caplog.at_level(logging.WARNING, logger="bcg"):
        for lengths in [(20, 44), (20, 44), (T,), (20, 44)]:
            x.copy_(torch.randn(T, HIDDEN, device="cuda"))
            assert torch.equal(graph.replay(live=Meta(lengths)), eager(model, x.clone(), Meta(lengths)))
    reasons = [r.getMessage() for r in caplog.records if "cannot be captured" in r.getMessage()]
    assert len(reasons) == 1 and "syncing" in reasons[0], reasons  # logged once
    bp = graph.stats().keyed["graph"]["breakpoints"]["syncing"]
    assert bp["hits"] == 0 and bp["misses"] == 8 and sum(bp["eager_only"].values()) == 2
    assert not torch.cuda.is_current_stream_capturing()
    torch.zeros(1, device="cuda").add_(1).item()  # CUDA still usable
    graph.reset()


def test_a_breakpoint_reading_a_live_tensor_stays_eager() -> None:
    @dataclass(frozen=True)
    class TensorMeta:
        lengths: tuple[int, ...]
        bias: torch.Tensor

    @bcg.breakpoint(name="biased", mutates=("out",), key=lambda m: m.lengths)
    def biased(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
        unfused(q, k, v, out, bcg.live().lengths)
        out.add_(bcg.live().bias)

    model = Model(biased, layers=1)
    x = torch.randn(T, HIDDEN, device="cuda")
    graph = bcg.make_graph(model, x, live=TensorMeta((T,), torch.zeros(1, device="cuda")))
    for _ in range(3):
        meta = TensorMeta((T,), torch.randn(1, device="cuda"))  # a new tensor each time
        assert torch.equal(graph.replay(live=meta), eager(model, x.clone(), meta))
    bp = graph.stats().keyed["graph"]["breakpoints"]["biased"]
    assert bp["hits"] == 0 and any("bcg.live()" in r for r in bp["eager_only"]), bp
    graph.reset()


def test_audit_catches_a_key_that_misses_a_field() -> None:
    model = Model(wrong_key_attention)
    x = torch.randn(T, HIDDEN, device="cuda")
    graph = bcg.make_graph(model, x, live=Meta((T,)), variants=bcg.VariantPolicy(audit_every=1))
    a, b = Meta((20, 44), scale=1.0), Meta((20, 44), scale=2.0)  # same (wrong) key, different work
    assert torch.equal(graph.replay(live=a), eager(model, x.clone(), a))
    with pytest.raises(bcg.errors.VerificationError, match=r"unfused_wrong_key.*\(20, 44\)"):
        graph.replay(live=b)
    # the wrong variant was dropped: the next replay captures anew and is right
    assert torch.equal(graph.replay(live=b), eager(model, x.clone(), b))
    graph.reset()


def test_audit_passes_a_right_key() -> None:
    model = Model(attention)
    x = torch.randn(T, HIDDEN, device="cuda")
    graph = bcg.make_graph(model, x, live=Meta((T,)), variants=bcg.VariantPolicy(audit_every=2))
    for scale in [1.0, 2.0, 1.0, 2.0, 1.0, 2.0]:
        meta = Meta((20, 44), scale)
        assert torch.equal(graph.replay(live=meta), eager(model, x.clone(), meta))
    graph.reset()


def test_verify_catches_a_key_that_misses_a_field_and_passes_a_right_one() -> None:
    x = torch.randn(T, HIDDEN, device="cuda")
    samples = [Meta((20, 44), 1.0), Meta((20, 44), 2.0), Meta((T,), 1.0)]
    bcg.verify(Model(attention), lambda: (torch.randn(T, HIDDEN, device="cuda"),), samples)
    with pytest.raises(bcg.errors.VerificationError, match="unfused_wrong_key"):
        bcg.verify(Model(wrong_key_attention), lambda: (torch.randn(T, HIDDEN, device="cuda"),), samples)
    del x


def test_a_full_stitched_cache_updates_in_place() -> None:
    rng = random.Random(3)
    model = Model(attention)
    x = torch.randn(T, HIDDEN, device="cuda")
    graph = bcg.make_graph(model, x, live=Meta((T,)), variants=bcg.VariantPolicy(max_stitched=1))
    tuples = [random_lengths(rng, most=1) for _ in range(1)] + [(a, T - a) for a in (10, 20, 30)]
    for lengths in tuples * 4:  # round 1 captures, round 2 launches piecewise, rounds 3-4 stitch
        x.copy_(torch.randn(T, HIDDEN, device="cuda"))
        assert torch.equal(graph.replay(live=Meta(lengths)), eager(model, x.clone(), Meta(lengths)))
    st = graph.stats().keyed["graph"]["stitched"]
    assert st["cached"] == 1
    assert st["updates"] + st["update_refusals"] == 7, st  # every build but the first tried the one executable
    assert st["updates"] >= 4, st  # two requests -> two requests: the same topology, updated in place
    graph.reset()


def test_low_hit_rate_stops_capturing() -> None:
    rng = random.Random(4)
    model = Model(attention, layers=1)
    x = torch.randn(T, HIDDEN, device="cuda")
    graph = bcg.make_graph(model, x, live=Meta((T,)), variants=bcg.VariantPolicy(window=8, max_variants=256))
    seen = set()
    while len(seen) < 24:
        lengths = random_lengths(rng)
        if lengths in seen:
            continue
        seen.add(lengths)
        assert torch.equal(graph.replay(live=Meta(lengths)), eager(model, x.clone(), Meta(lengths)))
    st = graph.stats().keyed["graph"]
    bp = st["breakpoints"]["unfused"]
    assert not bp["capturing"] and "two windows" in bp["stopped"]
    assert bp["captures"] == 15  # two low windows of 8, judged at the 16th replay
    assert st["entries"] == 0  # their variants, never used, were freed when capturing stopped
    assert "plain breakpoint" in bp["stopped"]  # and the steps went back to plain calls
    assert all(getattr(s, "variants", None) is None for s in graph.plan) and graph.executor == "native"
    graph.reset()


def test_the_runner_keeps_variants_per_bucket() -> None:
    model = Model(attention)

    def live_for(n: int) -> Meta:
        return Meta((n,))

    runner = bcg.GraphRunner(model, buckets=[32, 64], example_inputs=(torch.randn(T, HIDDEN, device="cuda"),),
                             live=live_for, progress=False)
    runner.capture()
    rng = random.Random(5)
    for i in range(20):
        n = 32 if i % 2 else 64
        lengths = random_lengths(rng, total=n, most=2) if i < 10 else ((n // 2, n - n // 2))
        x = torch.randn(n, HIDDEN, device="cuda")
        got = runner(x, live=Meta(lengths))
        assert torch.equal(got, eager(model, x.clone(), Meta(lengths))), (i, n, lengths)
    st = runner.stats()["variants"]
    assert st is not None and set(st["buckets"]) == {32, 64}
    assert st["hits"] > 0 and st["stitched_replays"] > 0
    runner.reset()
