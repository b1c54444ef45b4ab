"""The paged KV cache of the decode workload, on the CPU: metadata, slots, attention against a
dense reference, and padding that touches nothing but the trash page."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bcg.bench.workloads.paged import PagedBatch, PagedKVCache, dense_reference, paged_attention

H, KV, D, PAGE = 4, 2, 16, 4


def _setup(q_lens, ctx_lens, seed=0, pages=64, spare=1):  # noqa: ANN001, ANN202
    gen = torch.Generator().manual_seed(seed)
    cache = PagedKVCache(1, pages, PAGE, KV, D, torch.device("cpu"), torch.float32)
    tables = cache.tables(ctx_lens, seed, spare=spare)
    batch = PagedBatch(tuple(q_lens), tuple(ctx_lens), tables, PAGE)
    hist_k, hist_v = [], []
    for c, qn, t in zip(ctx_lens, q_lens, tables):  # the earlier tokens, already in the cache
        kh, vh = torch.randn(c, KV, D, generator=gen), torch.randn(c, KV, D, generator=gen)
        for p in range(c - qn):
            cache.k[0][t[p // PAGE], p % PAGE] = kh[p]
            cache.v[0][t[p // PAGE], p % PAGE] = vh[p]
        hist_k.append(kh)
        hist_v.append(vh)
    T = batch.tokens
    q = torch.randn(T, H, D, generator=gen)
    k = torch.cat([kh[c - qn:] for kh, c, qn in zip(hist_k, ctx_lens, q_lens)])
    v = torch.cat([vh[c - qn:] for vh, c, qn in zip(hist_v, ctx_lens, q_lens)])
    return cache, batch, q, k, v, hist_k, hist_v


def _run(cache, batch, q, k, v, tokens, requests, pages):  # noqa: ANN001, ANN202
    """Padded rows hold garbage (random), as a bucket's rows past the batch may."""
    slots, cu, ctx, table = batch.padded(tokens, requests, pages)
    pad = tokens - q.shape[0]
    qp, kp, vp = (torch.cat([t, torch.randn(pad, *t.shape[1:])]) for t in (q, k, v))
    out = torch.full((tokens, H, D), float("nan"))
    paged_attention(qp, kp, vp, out, cache.k[0], cache.v[0], *map(torch.from_numpy, (slots, cu, ctx, table)),
                    max(batch.q_lens))
    return out


@pytest.mark.parametrize("q_lens, ctx_lens", [
    ((1, 1, 1), (5, 1, 13)),  # decode
    ((1, 6, 1, 3), (9, 6, 2, 20)),  # mixed: a first prefill chunk, a later chunk, decode tokens
])
def test_paged_attention_equals_dense_attention_and_writes_the_new_tokens(q_lens, ctx_lens) -> None:  # noqa: ANN001
    cache, batch, q, k, v, hist_k, hist_v = _setup(q_lens, ctx_lens)
    out = _run(cache, batch, q, k, v, tokens=batch.tokens, requests=batch.requests, pages=batch.max_pages)
    torch.testing.assert_close(out, dense_reference(q, hist_k, hist_v, batch), rtol=1e-5, atol=1e-5)
    for r, (c, t) in enumerate(zip(ctx_lens, batch.tables)):  # the whole history is in the cache now
        got = torch.stack([cache.k[0][t[p // PAGE], p % PAGE] for p in range(c)])
        assert torch.equal(got, hist_k[r])


def test_padding_is_inert_and_touches_only_the_trash_page() -> None:
    """Padded rows and request slots (a bucket larger than the batch, a context bound larger than
    its contexts): real rows equal the unpadded run, padded rows are zeros (not NaN), and no page
    but the trash page changes besides the real new tokens' slots."""
    q_lens, ctx_lens = (1, 4, 1), (7, 4, 3)
    cache, batch, q, k, v, hist_k, hist_v = _setup(q_lens, ctx_lens, seed=3)
    before_k = cache.k[0].clone()
    out = _run(cache, batch, q, k, v, tokens=batch.tokens + 5, requests=batch.requests + 3, pages=batch.max_pages + 2)
    T = batch.tokens
    torch.testing.assert_close(out[:T], dense_reference(q, hist_k, hist_v, batch), rtol=1e-5, atol=1e-5)
    assert torch.equal(out[T:], torch.zeros_like(out[T:]))
    changed = (cache.k[0] != before_k).flatten(1).any(1).nonzero().flatten().tolist()
    written = {s // PAGE for s in batch.slots()}
    assert set(changed) <= written | {0}
    assert 0 in changed  # the padded rows went to the trash page


def test_pages_a_request_does_not_read_never_reach_it() -> None:
    """NaN in the trash page and in a page of another request leaves the batch's rows finite."""
    q_lens, ctx_lens = (1, 2), (6, 3)
    cache, batch, q, k, v, hist_k, hist_v = _setup(q_lens, ctx_lens, seed=4, spare=0)  # tables end at the context
    used = {p for t in batch.tables for p in t}
    other = next(p for p in range(1, cache.pages) if p not in used)
    for t in (cache.k[0], cache.v[0]):
        t[0].fill_(float("nan"))
        t[other].fill_(float("nan"))
    out = _run(cache, batch, q, k, v, tokens=batch.tokens + 2, requests=batch.requests + 1, pages=batch.max_pages + 1)
    T = batch.tokens
    assert not out.isnan().any()
    torch.testing.assert_close(out[:T], dense_reference(q, hist_k, hist_v, batch), rtol=1e-5, atol=1e-5)


def test_batch_metadata() -> None:
    batch = PagedBatch((1, 3), (5, 3), ((7, 2), (4,)), 4)
    assert batch.positions() == [4, 0, 1, 2]
    assert batch.slots() == [2 * 4 + 0, 4 * 4 + 0, 4 * 4 + 1, 4 * 4 + 2]
    slots, cu, ctx, table = batch.padded(tokens=6, requests=3, pages=2)
    assert slots.dtype == np.int64 and cu.dtype == ctx.dtype == table.dtype == np.int32
    assert slots[:4].tolist() == batch.slots() and all(s < 4 for s in slots[4:].tolist())
    assert cu.tolist() == [0, 1, 4, 4] and ctx.tolist() == [5, 3, 0] and table.tolist() == [[7, 2], [4, 0], [0, 0]]
    # into reused arrays holding another batch's values: every element is written
    for bounds in ((6, 3, 2), (4, 2, 3), (9, 5, 4)):
        fresh = batch.padded(*bounds)
        stale = tuple(np.full_like(a, -7) for a in fresh)
        assert batch.padded(*bounds, out=stale) is stale
        assert [a.tolist() for a in stale] == [a.tolist() for a in fresh]
        assert (stale[3] >= 0).all() and (stale[2] >= 0).all() and stale[1][-1] == batch.tokens
    spare = PagedBatch((1,), (3,), ((9, 8, 7),), 4)  # a table with spare pages, cut to the bound
    assert spare.padded(tokens=2, requests=1, pages=2)[3].tolist() == [[9, 8]]
    with pytest.raises(ValueError, match="does not fit"):
        batch.padded(tokens=3, requests=3, pages=2)
    with pytest.raises(ValueError):
        PagedBatch((2,), (1,), ((1,),), 4)  # more new tokens than context


# -- decode steps through a GraphRunner (eager mode on the CPU) -------------------------------------


def _decode_model():  # noqa: ANN202
    from bcg.bench.workloads.llama import LlamaModel

    shape = {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "intermediate": 128, "head_dim": 16}
    return LlamaModel(shape, torch.device("cpu"), max_pos=128, seed=1)


@pytest.mark.parametrize("staged", [False, True])
def test_decode_steps_through_a_runner_match_eager_and_keep_the_cache_equal(staged: bool) -> None:
    """Requests decode one token per step through a GraphRunner whose buckets are batch sizes:
    outputs match the eager forward, and after every step both KV caches hold the same values on
    every page but the trash page (the captures' warm-ups and the padded requests write only
    there). Batches shrink and grow between steps, so buckets change and requests are padded."""
    import warnings

    import bcg
    from bcg.bench.workloads import paged

    model = _decode_model()
    L, pages, page, bound = 2, 64, 4, 6  # bound: pages per request
    caches = [paged.PagedKVCache(L, pages, page, model.KV, model.D, torch.device("cpu"), torch.float32)
              for _ in range(2)]
    gen = torch.Generator().manual_seed(5)
    for layer in range(L):  # the same history in both caches
        for t in (caches[0].k[layer], caches[0].v[layer]):
            t[1:].copy_(torch.randn(t[1:].shape, generator=gen))
    for a, b in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v):
        b.copy_(a)
    R = 6
    ctx = [3, 9, 1, 14, 6, 5]
    tables = caches[0].tables([bound * page] * R, seed=2)  # room to grow
    tables = tuple(t[:bound] for t in tables)
    buckets = [1, 2, 4, 8]
    if staged:
        attention = paged.StagedPagedAttention(tokens=buckets[-1], requests=buckets[-1], pages=bound, page=page,
                                               device=torch.device("cpu"))
        bp = attention.breakpoint
    else:
        bp = paged.paged_breakpoint()
    runner_attn = paged.per_layer(bp, caches[1])
    eager_attn = paged.per_layer(paged.paged_breakpoint(), caches[0])

    def forward(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return model.forward(x, pos, runner_attn)

    def capture_live(n: int) -> paged.PagedLive:
        return paged.PagedLive(paged.inert_batch(n, page), requests=n, pages=bound, max_q=1)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # (no CUDA: eager mode)
        runner = bcg.GraphRunner(forward, buckets, example_inputs=(torch.zeros(1, model.hidden),
                                 torch.zeros(1, dtype=torch.long)), live=capture_live, progress=False)
    runner.capture()
    for a, b in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v):  # the captures wrote only trash
        assert torch.equal(a[1:], b[1:])
    for step, active in enumerate([range(6), range(3), range(1), range(5), range(6)]):
        idx = list(active)
        for r in idx:
            ctx[r] += 1
        batch = paged.PagedBatch((1,) * len(idx), tuple(ctx[r] for r in idx), tuple(tables[r] for r in idx), page)
        x = torch.randn(len(idx), model.hidden, generator=gen)
        pos = torch.tensor(batch.positions())
        y = runner(x, pos, live=paged.PagedLive(batch))
        with bcg.live_scope(paged.PagedLive(batch)), torch.no_grad():
            expected = model.forward(x, pos, eager_attn)
        torch.testing.assert_close(y, expected, rtol=1e-4, atol=1e-4, msg=lambda m: f"step {step}: {m}")
        for a, b in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v):
            torch.testing.assert_close(b[1:], a[1:], rtol=1e-4, atol=1e-4, msg=lambda m: f"step {step}: {m}")
    stats = runner.stats()
    assert stats["fallbacks"] == dict.fromkeys(stats["fallbacks"], 0) and stats["graph_calls"] == 5


def test_staged_tiers_shrink_the_bound_that_sizes_the_work() -> None:
    """Decode tiers cut the context bound (the gather), mixed ones max_q (the flash grid); the
    form's own bounds come last, as bcg.StagedTiers wants."""
    import bcg
    from bcg.bench.workloads import paged

    assert paged.tiers(1, 128) == [(1, 32), (1, 64)] and paged.tiers(1, 1) == []
    assert paged.tiers(512, 128) == [(128, 128), (256, 128)] and paged.tiers(2, 8) == [(1, 8)]
    lives = paged.capture_lives(4, PAGE, max_q=1, pages=8, tiered=True)
    assert isinstance(lives, bcg.StagedTiers) and [(x.max_q, x.pages) for x in lives] == [(1, 2), (1, 4), (1, 8)]
    assert all(x.requests == 4 and x.batch.tables == ((0,),) * 4 for x in lives)  # the trash page only
    assert not isinstance(paged.capture_lives(4, PAGE, max_q=1, pages=8), bcg.StagedTiers)
