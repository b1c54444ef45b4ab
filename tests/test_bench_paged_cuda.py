"""Decode over a paged KV cache on a GPU: the bench's decode and mixed points in every graph mode,
and a runner over batch-size buckets serving random decode steps, with NaN in the trash page."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

import bcg
from bcg.bench import cli
from bcg.bench.workloads import paged
from bcg.bench.workloads.llama import LlamaModel
from bcg.core.torch_internals import has_triton

pytestmark = pytest.mark.cuda

TINY = ["--shape", "tiny", "--iters", "3", "--warmup", "1", "--no-progress"]


def test_decode_and_mixed_points_in_every_graph_mode(tmp_path: Path) -> None:
    """floor, bcg and bcg-staged replay the eager kernels (the staged form with its bounds: the
    same up to bf16 rounding), and the staged attention runs inline at every replay."""
    rc = cli.main(["--workload", "llama", "--attn", "decode,mixed", "--tokens", "8,64", "--context", "256",
                   "--modes", "eager,floor,bcg,bcg-staged", "--out", str(tmp_path), *TINY])
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert rc == 0 and doc["errors"] == []
    rows = doc["rows"]
    assert {(r["attn"], r["T"], r["mode"]) for r in rows} == {
        (a, t, m) for a in ("decode", "mixed") for t in (8, 64) for m in ("eager", "floor", "bcg", "bcg-staged")}
    for r in rows:
        assert r["attn_backend"] == "paged: gather + flash seqused_k"
        if r["mode"] == "bcg-staged":
            assert r["rel_err"] < 1e-2 and r["inline_fraction"] == 1.0, r
        else:
            assert r["rel_err"] == 0.0, r


@pytest.mark.skipif(not has_triton(), reason="the gather kernel needs Triton")
def test_the_gather_copies_each_context_from_a_strided_table() -> None:
    """gather_pages on CUDA (Triton): the first ctx[r] tokens of each request's span equal
    index_select's, with a block table that is a view of a wider one (as a staged form reads)
    and a request of no context."""
    page, KV, D, pages = 16, 2, 64, 40
    gen = torch.Generator(device="cuda").manual_seed(5)
    k = torch.randn(pages * page, KV, D, generator=gen, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(pages * page, KV, D, generator=gen, device="cuda", dtype=torch.bfloat16)
    wide = torch.randint(1, pages, (6, 12), generator=gen, device="cuda", dtype=torch.int32)
    table = wide[:5, :8]
    ctx = torch.tensor([1, 16, 17, 128, 0], device="cuda", dtype=torch.int32)
    kg, vg = paged.gather_pages(k, v, table, ctx, page)
    index = (table.long().unsqueeze(-1) * page + torch.arange(page, device="cuda")).flatten()
    span = 8 * page
    for r, c in enumerate(ctx.tolist()):
        rows = slice(r * span, r * span + c)
        assert torch.equal(kg[rows], k[index][rows]) and torch.equal(vg[rows], v[index][rows]), r


@pytest.mark.parametrize("q_lens, ctx_lens", [((1, 1, 1), (5, 1, 70)), ((1, 6, 1, 3), (9, 6, 2, 40))])
def test_paged_attention_on_the_gpu_equals_dense_attention_with_nan_in_unread_pages(q_lens, ctx_lens) -> None:  # noqa: ANN001
    """The flash path (gather, seqused_k) with padded rows, request slots and pages: the batch's
    rows equal SDPA over each request's history, padded rows are zeros, and NaN in the trash
    page and in the pages no request reads reaches no output."""
    H, KV, D, page = 4, 2, 64, 16
    dt = torch.bfloat16
    cache = paged.PagedKVCache(1, 32, page, KV, D, torch.device("cuda"), dt)
    tables = cache.tables(ctx_lens, seed=1)
    batch = paged.PagedBatch(tuple(q_lens), tuple(ctx_lens), tables, page)
    gen = torch.Generator(device="cuda").manual_seed(2)
    for t in (cache.k[0], cache.v[0]):
        t.fill_(float("nan"))  # every page: the history below overwrites what requests read
    hist_k, hist_v = [], []
    for c, qn, t in zip(ctx_lens, q_lens, tables):
        kh = torch.randn(c, KV, D, generator=gen, device="cuda", dtype=dt)
        vh = torch.randn(c, KV, D, generator=gen, device="cuda", dtype=dt)
        for p in range(c - qn):
            cache.k[0][t[p // page], p % page] = kh[p]
            cache.v[0][t[p // page], p % page] = vh[p]
        hist_k.append(kh)
        hist_v.append(vh)
    T, pad = batch.tokens, 3
    q = torch.randn(T + pad, H, D, generator=gen, device="cuda", dtype=dt)
    k = torch.cat([*(kh[c - qn:] for kh, c, qn in zip(hist_k, ctx_lens, q_lens)),
                   torch.randn(pad, KV, D, generator=gen, device="cuda", dtype=dt)])
    v = torch.cat([*(vh[c - qn:] for vh, c, qn in zip(hist_v, ctx_lens, q_lens)),
                   torch.randn(pad, KV, D, generator=gen, device="cuda", dtype=dt)])
    meta = [torch.from_numpy(a).cuda() for a in batch.padded(T + pad, batch.requests + 2, batch.max_pages + 2)]
    out = torch.full_like(q, float("nan"))
    paged.paged_attention(q, k, v, out, cache.k[0], cache.v[0], *meta, max(q_lens))
    assert not out.isnan().any()
    torch.testing.assert_close(out[:T], paged.dense_reference(q[:T], hist_k, hist_v, batch), rtol=2e-2, atol=2e-2)
    assert torch.equal(out[T:], torch.zeros_like(out[T:]))


@pytest.mark.usefixtures("every_tier_kept")  # (the tiers serve batches below)
def test_a_decode_runner_over_batch_buckets_serves_random_steps_and_never_reads_the_trash_page() -> None:
    """50 random decode batches per bucket (1, 2, 4, 8), staged with context tiers: outputs match
    the eager forward on the padded input, the cache's real pages match eager's after every step,
    and NaN written into the trash page before every call never reaches an output."""
    shape = {"layers": 2, "hidden": 256, "heads": 4, "kv_heads": 2, "intermediate": 512, "head_dim": 64}
    model = LlamaModel(shape, torch.device("cuda"), max_pos=512, seed=3)
    page, bound, R = 16, 16, 8  # pages per request: contexts up to 256
    device = torch.device("cuda")
    caches = [paged.PagedKVCache(2, 1 + R * bound, page, model.KV, model.D, device, model.dtype) for _ in range(2)]
    gen = torch.Generator(device="cuda").manual_seed(0)
    for k in caches[0].k + caches[0].v:
        k[1:].copy_(torch.randn(k[1:].shape, generator=gen, device="cuda", dtype=model.dtype))
    for a, b in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v):
        b.copy_(a)
    tables = tuple(tuple(range(1 + r * bound, 1 + (r + 1) * bound)) for r in range(R))
    buckets = [1, 2, 4, 8]
    staged = paged.StagedPagedAttention(tokens=8, requests=8, pages=bound, page=page, device=device)
    runner_layers = paged.per_layer(staged.breakpoint, caches[1])
    eager_layers = paged.per_layer(paged.paged_breakpoint(), caches[0])
    runner = bcg.GraphRunner(
        lambda x, pos: model.forward(x, pos, runner_layers), buckets,
        example_inputs=(torch.zeros(1, model.hidden, device="cuda", dtype=model.dtype),
                        torch.zeros(1, dtype=torch.long, device="cuda")),
        live=lambda n: paged.capture_lives(n, page, max_q=1, pages=bound, tiered=True),
        progress=False,
    ).capture()
    ctx = [random.Random(r).randint(1, 160) for r in range(R)]
    rng = random.Random(1)
    for n in buckets:
        for step in range(50):
            prev = max([b for b in buckets if b < n], default=0)
            B = rng.randint(prev + 1, n)
            chosen = sorted(rng.sample(range(R), B))
            for r in chosen:
                ctx[r] = min(ctx[r] + 1, bound * page)
            batch = paged.PagedBatch((1,) * B, tuple(ctx[r] for r in chosen), tuple(tables[r] for r in chosen), page)
            x = torch.randn(B, model.hidden, generator=gen, device="cuda", dtype=model.dtype)
            pos = torch.tensor(batch.positions(), device="cuda")
            for c in caches:  # poison: what only padded requests and rows may touch
                for t in c.k + c.v:
                    t[0].fill_(float("nan"))
            y = runner(x, pos, live=paged.PagedLive(batch)).clone()
            xp = torch.zeros(n, model.hidden, device="cuda", dtype=model.dtype)
            xp[:B] = x
            pp = torch.zeros(n, dtype=torch.long, device="cuda")
            pp[:B] = pos
            with bcg.live_scope(paged.PagedLive(batch)), torch.no_grad():
                expected = model.forward(xp, pp, eager_layers)[:B]
            assert not y.isnan().any(), (n, step)
            torch.testing.assert_close(y, expected, rtol=2e-2, atol=2e-2, msg=lambda m: f"bucket {n}, step {step}: {m}")
            assert torch.equal(caches[1].k[0][1:], caches[0].k[0][1:]), (n, step)  # layer 0: the same GEMM rows
            for a, b in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v):
                torch.testing.assert_close(b[1:], a[1:], rtol=2e-2, atol=2e-2)
    stats = runner.stats()
    assert stats["graph_calls"] == 200 and stats["inline_replays"] == 200
    # the context tiers (4 and 8 pages of 16) served the batches whose contexts fit them
    per_form = [runner.graph(n).stats().staged.replays for n in buckets]
    assert all(len(r) == 3 for r in per_form) and sum(r[0] + r[1] for r in per_form) > 0, per_form
    runner.reset()
