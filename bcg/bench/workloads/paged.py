"""Decode and mixed batches over a paged KV cache: the batch's metadata, the cache, the attention.

A batch (:class:`PagedBatch`) holds R requests. Each has ``q_len`` new tokens (1 for a decode
step; a prefill chunk in a mixed batch), ``ctx_len`` tokens of context once they are written
(its earlier tokens and the new ones) and a block table: its pages of the cache, in order. The
cache (:class:`PagedKVCache`) holds, per layer, a K and a V tensor of ``[pages, page, kv_heads,
head_dim]``; page 0 is the *trash page*, which only padded requests and padded tokens write to
and read from, so they never touch a real request's slots.

Attention for one layer (:func:`paged_attention`), with every piece of metadata a device tensor
and every size a static bound, so it can run inside a CUDA graph:

1. write the new tokens' K and V into the cache at their slots (``index_copy_``);
2. gather each request's pages into a span of ``pages_per_request * page`` tokens (the context
   bound): on CUDA with Triton, one kernel that copies only the tokens of each request's context
   (its work follows the context lengths, not the bound; the rest of a span is not written);
   elsewhere ``index_select`` over the whole bound;
3. causal attention of each request's new tokens over its context: on CUDA one call of ATen's
   flash kernel with ``seqused_k`` (the context lengths: it reads no key past them); elsewhere a
   masked attention in plain ops;
4. rows past the batch's tokens (padding) are written as zeros.

Why a gather: this torch's flash kernel reads K/V through ``cu_seqlens_k`` and ``seqused_k`` but
takes no block table (torch 2.13 adds one), and FlexAttention's paged attention is an
experimental module that needs ``torch.compile``. The floor and every mode run the same gather.
"""

from __future__ import annotations

import functools
import itertools
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

import bcg
from bcg.bench.timing import UserTime
from bcg.core.torch_internals import has_triton

_FLASH = getattr(getattr(torch.ops.aten, "_flash_attention_forward", None), "default", None)


def flash_paged_usable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether :func:`paged_attention` runs ATen's flash kernel here (CUDA, half precision)."""
    return device.type == "cuda" and _FLASH is not None and dtype in (torch.float16, torch.bfloat16)


# -- the batch ------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=16)
def _trash_slots(tokens: int, page: int) -> np.ndarray:
    """``tokens`` slots on the trash page (page 0), cycling over its ``page`` slots: padded rows'
    (read-only: shared)."""
    slots = np.arange(tokens, dtype=np.int64) % page
    slots.flags.writeable = False
    return slots


@dataclass(frozen=True)
class PagedBatch:
    """The host metadata of one forward over a paged cache (what :func:`bcg.live` returns).

    Arguments:
        q_lens: new tokens of each request (packed in this order in the forward's rows).
        ctx_lens: each request's context once its new tokens are written (``>= q_len``).
        tables: each request's block table (page ids, in order; at least ``ceil(ctx / page)``).
        page: tokens per page.
    """

    q_lens: tuple[int, ...]
    ctx_lens: tuple[int, ...]
    tables: tuple[tuple[int, ...], ...]
    page: int

    def __post_init__(self) -> None:
        if not (len(self.q_lens) == len(self.ctx_lens) == len(self.tables)):
            raise ValueError("q_lens, ctx_lens and tables need one entry per request")
        for q, c, t in zip(self.q_lens, self.ctx_lens, self.tables):
            if not 1 <= q <= c or len(t) * self.page < c:
                raise ValueError(f"a request with {q} new tokens, context {c} and {len(t)} pages of {self.page}")

    @functools.cached_property
    def requests(self) -> int:
        return len(self.q_lens)

    @functools.cached_property
    def tokens(self) -> int:
        return sum(self.q_lens)

    @functools.cached_property
    def max_q(self) -> int:
        return max(self.q_lens)

    def positions(self) -> list[int]:
        """Each new token's position in its request (RoPE), in row order."""
        return [p for q, c in zip(self.q_lens, self.ctx_lens) for p in range(c - q, c)]

    def slots(self) -> list[int]:
        """Each new token's slot in the cache (``page id * page + offset``), in row order."""
        return [t[p // self.page] * self.page + p % self.page
                for q, c, t in zip(self.q_lens, self.ctx_lens, self.tables) for p in range(c - q, c)]

    @functools.cached_property
    def _host(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(slots, cu_q, ctx, table)`` as host arrays over the batch itself, built once (the
        arrays a serving engine's scheduler keeps): what :meth:`padded` copies from."""
        width = max(len(t) for t in self.tables)
        table = np.zeros((self.requests, width), dtype=np.int32)
        for r, t in enumerate(self.tables):
            table[r, : len(t)] = t
        return (np.array(self.slots(), dtype=np.int64),
                np.array(list(itertools.accumulate(self.q_lens, initial=0)), dtype=np.int32),
                np.array(self.ctx_lens, dtype=np.int32), table)

    def padded(self, tokens: int, requests: int, pages: int,
               out: tuple[np.ndarray, ...] | None = None) -> tuple[np.ndarray, ...]:
        """``(slots, cu_q, ctx, table)`` as host arrays over static bounds: ``tokens`` rows
        (int64), ``requests`` slots (int32 ``[requests + 1]`` and ``[requests]``) of ``pages``
        pages each (int32 ``[requests, pages]``). Padded rows write to the trash page; padded
        requests take no token (their ``cu_q`` offset repeats) and have no context; unused table
        entries point at the trash page. ``out``: four arrays of those shapes and dtypes to
        write into (reused from call to call), else new ones. (NumPy: a few small host copies,
        and no torch op, which costs more on the host.)"""
        if self.tokens > tokens or self.requests > requests or self.max_pages > pages:
            raise ValueError(f"a batch of {self.tokens} tokens, {self.requests} requests and {self.max_pages} "
                             f"pages does not fit {tokens} tokens, {requests} requests, {pages} pages")
        if out is None:
            out = (np.empty(tokens, dtype=np.int64), np.empty(requests + 1, dtype=np.int32),
                   np.empty(requests, dtype=np.int32), np.empty((requests, pages), dtype=np.int32))
        out_slots, out_cu, out_ctx, out_table = out
        slots, cu, ctx, table = self._host
        R, N, n = self.requests, self.tokens, min(table.shape[1], pages)
        # (each NumPy call costs host time at every replay: none for an empty span)
        out_slots[:N] = slots
        if N < tokens:
            out_slots[N:] = _trash_slots(tokens, self.page)[N:]
        out_cu[: R + 1] = cu
        out_ctx[:R] = ctx
        if R < requests:
            out_cu[R + 1:] = N
            out_ctx[R:] = 0
            out_table[R:] = 0
        out_table[:R, :n] = table[:, :n] if n < table.shape[1] else table
        if n < pages:
            out_table[:R, n:] = 0
        return out

    @functools.cached_property
    def max_pages(self) -> int:
        """The most pages a request's context covers."""
        return max(math.ceil(c / self.page) for c in self.ctx_lens)


class DecodeSteps:
    """The batches of a decode loop: at each step every request takes one new token, its context
    grows by one and its block table by one page at each page boundary (pages reserved up front,
    as an engine's allocator reserves a request's pages).

    Arguments:
        first: step 0's batch (one new token per request).
        tables: each request's reserved pages, in order: enough for its context at the last step.
    """

    def __init__(self, first: PagedBatch, tables: Sequence[Sequence[int]]) -> None:
        if first.max_q != 1:
            raise ValueError("a decode loop's batch takes one new token per request")
        if len(tables) != first.requests:
            raise ValueError("tables needs one entry per request")
        self.first, self.page = first, first.page
        self._tables = tuple(tuple(t) for t in tables)
        self.steps = min(len(t) * self.page - c for t, c in zip(self._tables, first.ctx_lens)) + 1

    def batch(self, step: int) -> PagedBatch:
        """Step ``step``'s batch (``0 <= step < self.steps``): contexts ``+ step``, each table cut
        to the pages its context covers. Built anew at each call (host work a step pays)."""
        if not 0 <= step < self.steps:
            raise ValueError(f"step {step} is past the pages reserved for {self.steps} steps")
        page, first = self.page, self.first
        ctx = tuple(c + step for c in first.ctx_lens)
        return PagedBatch(first.q_lens, ctx, tuple(t[: -(-c // page)] for t, c in zip(self._tables, ctx)), page)


# -- the cache ------------------------------------------------------------------------------------


class PagedKVCache:
    """Per layer, K and V caches of ``pages`` pages of ``page`` tokens (page 0: the trash page).

    Arguments:
        layers: decoder layers.
        pages: pages per layer, the trash page included.
        page: tokens per page.
        kv_heads, head_dim: the K/V shape of one token.
    """

    def __init__(self, layers: int, pages: int, page: int, kv_heads: int, head_dim: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        if pages < 2:
            raise ValueError("a paged cache needs the trash page and at least one more")
        self.page, self.pages = page, pages
        shape = (pages, page, kv_heads, head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(layers)]

    def tables(self, ctx_lens: Sequence[int], seed: int, spare: int = 0) -> tuple[tuple[int, ...], ...]:
        """A block table per request for ``ctx_lens`` (plus ``spare`` more pages each), drawn from
        pages 1 .. pages-1 in a seeded random order, as an allocator that has run a while hands them out."""
        need = [math.ceil(c / self.page) + spare for c in ctx_lens]
        if sum(need) > self.pages - 1:
            raise ValueError(f"{sum(need)} pages needed, the cache has {self.pages - 1}")
        free = list(range(1, self.pages))
        random.Random(seed).shuffle(free)
        it = iter(free)
        return tuple(tuple(next(it) for _ in range(n)) for n in need)


# -- attention ------------------------------------------------------------------------------------


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, cu_q: torch.Tensor,
                    ctx: torch.Tensor, table: torch.Tensor, max_q: int) -> None:
    """One layer's attention over the paged cache (see the module documentation); writes ``out``.

    Arguments:
        q, k, v: ``[T, heads, D]`` and ``[T, kv_heads, D]``, this forward's new tokens (padded rows too).
        out: ``[T, heads, D]``.
        k_cache, v_cache: the layer's ``[pages, page, kv_heads, D]`` caches.
        slots: ``[T]`` int64, each row's slot (padded rows: the trash page's).
        cu_q: ``[R + 1]`` int32 row offsets of the requests (padded requests repeat the last).
        ctx: ``[R]`` int32 context lengths (0 for padded requests).
        table: ``[R, P]`` int32 block tables (P pages per request: the context bound).
        max_q: a bound on any request's new tokens.
    """
    T, H, D = q.shape
    pages, page, KV, _ = k_cache.shape
    R, P = table.shape
    flat_k, flat_v = k_cache.view(pages * page, KV, D), v_cache.view(pages * page, KV, D)
    flat_k.index_copy_(0, slots, k)
    flat_v.index_copy_(0, slots, v)
    kg, vg = gather_pages(flat_k, flat_v, table, ctx, page)  # [R * L, KV, D]
    L = P * page
    if flash_paged_usable(q.device, q.dtype):
        cu_k = torch.arange(0, (R + 1) * L, L, device=q.device, dtype=torch.int32)
        # max_seqlen_q is a bound: at least 2, since at 1 with grouped KV heads the kernel takes a
        # decode path that reads q as one row per request and ignores cu_seqlens_q (rows here may
        # be padded past the requests)
        o = _FLASH(q, kg, vg, cu_q, cu_k, max(max_q, 2), L, 0.0, True, False, seqused_k=ctx)[0]
    else:
        o = _masked_attention(q, kg.view(R, L, KV, D), vg.view(R, L, KV, D), cu_q, ctx)
    rows = torch.arange(T, device=q.device) < cu_q[-1]
    out.copy_(torch.where(rows.view(T, 1, 1), o, torch.zeros((), device=o.device, dtype=o.dtype)))


def gather_pages(flat_k: torch.Tensor, flat_v: torch.Tensor, table: torch.Tensor, ctx: torch.Tensor,
                 page: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each request's K and V context, ``table.shape[1] * page`` tokens per request (its span),
    from ``[pages * page, KV, D]`` caches: ``[R * P * page, KV, D]`` each.

    On CUDA with Triton one kernel copies, per request, only the ``ctx[r]`` tokens of its
    context and leaves the rest of its span unwritten (attention must read no key past
    ``ctx[r]``: flash with ``seqused_k`` does not); elsewhere ``index_select`` copies whole spans.
    """
    R, P = table.shape
    if flat_k.is_cuda and has_triton():
        _, KV, D = flat_k.shape
        kg = torch.empty((R * P * page, KV, D), device=flat_k.device, dtype=flat_k.dtype)
        vg = torch.empty_like(kg)
        if R * P:
            row = KV * D
            block = min(2048, 1 << (page * row - 1).bit_length())
            _gather_kernel()[(R, P)](flat_k, flat_v, kg, vg, table, table.stride(0), ctx, P,
                                     PAGE=page, ROW=row, BLOCK=block, num_warps=4)
        return kg, vg
    index = (table.to(torch.int64).unsqueeze(-1) * page
             + torch.arange(page, device=table.device)).view(R * P * page)
    return flat_k.index_select(0, index), flat_v.index_select(0, index)


@functools.cache
def _gather_kernel() -> Any:
    """The Triton kernel of :func:`gather_pages`: program ``(r, p)`` copies the tokens of request
    ``r``'s page ``p`` that its context covers (none past ``ctx[r]``), K and V."""
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["table_stride", "P"])  # one build for every batch's table width
    def gather(k, v, kg, vg, table, table_stride, ctx, P, PAGE: tl.constexpr, ROW: tl.constexpr,
               BLOCK: tl.constexpr):
        r = tl.program_id(0)
        p = tl.program_id(1)
        used = tl.load(ctx + r) - p * PAGE  # tokens of this page in the context
        if used > 0:
            n = tl.minimum(used, PAGE) * ROW
            src = tl.load(table + r * table_stride + p).to(tl.int64) * (PAGE * ROW)
            dst = (r * P + p).to(tl.int64) * (PAGE * ROW)
            for i in range(0, PAGE * ROW, BLOCK):
                offs = i + tl.arange(0, BLOCK)
                mask = offs < n
                tl.store(kg + dst + offs, tl.load(k + src + offs, mask=mask), mask=mask)
                tl.store(vg + dst + offs, tl.load(v + src + offs, mask=mask), mask=mask)

    return gather


def _masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
                      ctx: torch.Tensor) -> torch.Tensor:
    """Causal attention of each row over its request's gathered context, in plain ops (no flash):
    row t of request r sits at position ``ctx[r] - q_len[r] + i`` and sees keys ``0 .. position``.
    Rows past the requests come out as NaN or garbage (the caller zeroes them)."""
    T, H, D = q.shape
    R, L, KV, _ = k.shape
    t = torch.arange(T, device=q.device)
    r = torch.bucketize(t, cu_q[1:].to(torch.int64), right=True).clamp(max=R - 1)
    q_len = (cu_q[1:] - cu_q[:-1]).to(torch.int64)
    pos = ctx.to(torch.int64)[r] - q_len[r] + (t - cu_q.to(torch.int64)[r])
    kt = k[r].repeat_interleave(H // KV, dim=2)  # [T, L, H, D]
    vt = v[r].repeat_interleave(H // KV, dim=2)
    scores = torch.einsum("thd,tlhd->thl", q.float(), kt.float()) * D**-0.5
    visible = torch.arange(L, device=q.device).unsqueeze(0) <= pos.unsqueeze(1)  # [T, L]
    scores = scores.masked_fill(~visible.unsqueeze(1), float("-inf"))
    vt = vt.float().masked_fill(~visible.view(T, L, 1, 1), 0.0)  # (0 * NaN of a page not read is NaN)
    return torch.einsum("thl,tlhd->thd", scores.softmax(-1), vt).to(q.dtype)


def dense_reference(q: torch.Tensor, k_ctx: Sequence[torch.Tensor], v_ctx: Sequence[torch.Tensor],
                    batch: PagedBatch) -> torch.Tensor:
    """The same attention from each request's whole K/V history held contiguously (``k_ctx[r]``:
    ``[ctx_r, KV, D]``, its new tokens last), with SDPA: what the paged attention must equal
    (for tests)."""
    H = q.shape[1]
    outs = []
    start = 0
    for r, (qn, c) in enumerate(zip(batch.q_lens, batch.ctx_lens)):
        qr = q[start:start + qn].transpose(0, 1).unsqueeze(0)  # [1, H, qn, D]
        kr = k_ctx[r].transpose(0, 1).unsqueeze(0)
        vr = v_ctx[r].transpose(0, 1).unsqueeze(0)
        rep = H // kr.shape[1]
        kr, vr = kr.repeat_interleave(rep, dim=1), vr.repeat_interleave(rep, dim=1)
        mask = torch.arange(c, device=q.device).unsqueeze(0) <= torch.arange(c - qn, c, device=q.device).unsqueeze(1)
        o = torch.nn.functional.scaled_dot_product_attention(qr.float(), kr.float(), vr.float(), attn_mask=mask)
        outs.append(o[0].transpose(0, 1).to(q.dtype))
        start += qn
    return torch.cat(outs)


# -- breakpoints ----------------------------------------------------------------------------------


class PagedLive:
    """What :func:`bcg.live` returns for a paged forward: the batch, its device metadata built
    once per forward (for the rows a forward runs: a runner's bucket may pad them), and, for a
    staged capture, the bounds of the form being captured.

    Arguments:
        batch: the requests.
        requests, pages, max_q: a staged form's bounds when captured with this value (a tier's:
            fewer request slots or pages); None: the staging buffers' own.
    """

    def __init__(self, batch: PagedBatch, requests: int | None = None, pages: int | None = None,
                 max_q: int | None = None) -> None:
        self.batch = batch
        self.requests, self.pages, self.max_q = requests, pages, max_q
        self._device: dict[tuple[int, torch.device], tuple[torch.Tensor, ...]] = {}

    def tensors(self, rows: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        """``(slots, cu_q, ctx, table)`` on ``device`` for a forward of ``rows`` rows (built once:
        pinned host buffers, non-blocking copies)."""
        key = (rows, device)
        if key not in self._device:
            b = self.batch
            host = tuple(torch.from_numpy(a) for a in b.padded(rows, b.requests, b.max_pages))
            if device.type == "cuda":
                host = tuple(t.pin_memory() for t in host)
            self._device[key] = tuple(t.to(device, non_blocking=True) for t in host)
        return self._device[key]


@dataclass(frozen=True)
class StagedPaged:
    """What a staged paged attention reads when it runs inline (frozen at its capture): views of
    the staging buffers over the form's bounds."""

    slots: torch.Tensor  # [tokens bound] int64
    cu_q: torch.Tensor  # [requests + 1] int32
    ctx: torch.Tensor  # [requests] int32
    table: torch.Tensor  # [requests, pages] int32 (a view of the buffer's [slots, pages bound])
    max_q: int
    requests: int  # the bounds as ints (fits reads them at every replay)
    pages: int
    tokens: int


def _paged(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor,
           v_cache: torch.Tensor) -> None:
    """The breakpoint function: :func:`paged_attention` over this forward's metadata (a
    :class:`PagedLive`, or inline a :class:`StagedPaged`)."""
    live = bcg.live()
    rows = q.shape[0]
    if isinstance(live, StagedPaged):
        if rows > live.slots.shape[0]:
            raise ValueError(f"a forward of {rows} rows through a staged paged attention of {live.slots.shape[0]}: "
                             "give StagedPagedAttention a tokens bound of at least the largest bucket")
        paged_attention(q, k, v, out, k_cache, v_cache, live.slots[:rows], live.cu_q, live.ctx, live.table,
                        min(live.max_q, rows))
        return
    slots, cu, ctx, table = live.tensors(rows, q.device)
    paged_attention(q, k, v, out, k_cache, v_cache, slots, cu, ctx, table, live.batch.max_q)


def paged_breakpoint() -> Any:
    """The breakable paged attention: metadata built on the device once per forward, eagerly."""
    return bcg.breakpoint(_paged, name="attention_paged", mutates=("out", "k_cache", "v_cache"))


class StagedPagedAttention:
    """The staged paged attention: ``prepare`` writes the batch's metadata, padded to the bounds,
    into :class:`bcg.StagingBuffer` s, and the attention runs inline in the graph.

    Arguments:
        tokens: rows bound (the largest runner bucket).
        requests: request slots.
        pages: pages per request (the context bound, in pages).
        page: tokens per page.

    All the metadata shares one buffer of bytes (the int64 slots, then the int32 ``cu_q``,
    ``ctx`` and tables): one host write and one captured copy per replay.
    """

    def __init__(self, tokens: int, requests: int, pages: int, page: int, device: torch.device) -> None:
        self.tokens, self.requests, self.pages, self.page = tokens, requests, pages, page
        ints = 2 * requests + 1 + requests * pages
        self.buffer = bcg.StagingBuffer((8 * tokens + 4 * ints,), dtype=torch.uint8, device=device)
        # the bytes prepare pads into, as typed views (then one memcpy into the pinned buffer)
        self._bytes = np.empty(self.buffer.device.shape, dtype=np.uint8)
        self._padded = self._views(self._bytes, np.int64, np.int32)
        self._staged: dict[tuple[int, int, int], StagedPaged] = {}  # by the bounds of a form
        self.user_time = UserTime()  # (host_us_bcg: the call's host time less these two)
        # one object each, shared by every layer's breakpoint
        prepare, fits = self.user_time.wrap(self.prepare), self.user_time.wrap(self.fits)
        self.breakpoint = bcg.breakpoint(_paged, name="attention_paged_staged",
                                         mutates=("out", "k_cache", "v_cache"), prepare=prepare, fits=fits)

    def _views(self, raw: Any, int64: Any, int32: Any) -> tuple[Any, Any, Any, Any]:
        """``(slots, cu_q, ctx, table)``: typed views of the bytes (a NumPy array or a tensor)."""
        R, cut = self.requests, 8 * self.tokens
        meta = raw[cut:].view(int32)
        return raw[:cut].view(int64), meta[: R + 1], meta[R + 1: 2 * R + 1], meta[2 * R + 1:].reshape(R, self.pages)

    def fits(self, live: PagedLive, staged: StagedPaged) -> bool:
        """Whether the batch fits the bounds of the form captured with ``staged``."""
        b = live.batch
        return (b.requests <= staged.requests and b.max_pages <= staged.pages
                and b.max_q <= staged.max_q and b.tokens <= staged.tokens)

    def prepare(self, live: PagedLive) -> StagedPaged:
        """Write the batch's metadata over the buffers' bounds (host only); return the views the
        form captured with ``live`` reads (its bounds: ``live``'s, else the buffers')."""
        live.batch.padded(self.tokens, self.requests, self.pages, out=self._padded)
        self.buffer.write(self._bytes)  # an array of the buffer's dtype: one memcpy
        key = (min(live.requests or self.requests, self.requests), min(live.pages or self.pages, self.pages),
               live.max_q or self.tokens)
        staged = self._staged.get(key)
        if staged is None:  # the same views at every replay: made once (torch ops cost host time)
            requests, pages, max_q = key
            slots, cu, ctx, table = self._views(self.buffer.device, torch.int64, torch.int32)
            staged = self._staged[key] = StagedPaged(slots, cu[: requests + 1], ctx[:requests],
                                                     table[:requests, :pages], max_q, requests, pages, self.tokens)
        return staged


def tiers(max_q: int, pages: int) -> list[tuple[int, int]]:
    """Staged tiers below a form's bounds, as ``(max_q, pages)`` pairs, smallest first: a quarter
    and a half of the bound that sizes the attention's work. Decode (``max_q`` 1): the context
    bound, which sizes the flash kernel's key blocks and splits (and, without Triton, the gather
    itself). Mixed: ``max_q``, since the flash
    kernel launches blocks for ``max_q`` rows per request and head (the decode requests' long
    contexts keep the context bound up)."""
    if max_q == 1:
        return [(1, p) for p in sorted({pages // 4, pages // 2}) if 0 < p < pages]
    return [(q, pages) for q in sorted({max_q // 4, max_q // 2}) if 0 < q < max_q]


def capture_lives(requests: int, page: int, max_q: int, pages: int, tiered: bool = False) -> Any:
    """What a capture of a paged form runs with: :func:`inert_batch` metadata, the form's bounds
    (``requests`` slots of ``pages`` pages, ``max_q``); ``tiered``: a :class:`bcg.StagedTiers`
    with the forms of :func:`tiers` before it (for a staged attention)."""
    live = PagedLive(inert_batch(requests, page), requests=requests, pages=pages, max_q=max_q)
    if not tiered:
        return live
    return bcg.StagedTiers(*(PagedLive(inert_batch(requests, page), requests=requests, pages=p, max_q=q)
                             for q, p in tiers(max_q, pages)), live)


def per_layer(bp: Any, cache: PagedKVCache) -> list[Any]:
    """``bp`` bound to each layer's caches: the ``attn`` sequence ``LlamaModel.forward`` takes."""
    return [functools.partial(bp, k_cache=k, v_cache=v) for k, v in zip(cache.k, cache.v)]


def inert_batch(requests: int, page: int) -> PagedBatch:
    """``requests`` one-token requests on the trash page: the live metadata of a capture (its
    warm-ups and capture runs write K/V, and must write only where no request reads)."""
    return PagedBatch((1,) * requests, (1,) * requests, ((0,),) * requests, page)


# -- the benchmark points -------------------------------------------------------------------------

#: ``--attn`` kinds served by this module: T is the batch's requests (``decode``: one token each)
#: or its tokens (``mixed``: half in one-token decode requests, half in ``--requests`` prefill chunks).
KINDS = ("decode", "mixed")


def make_batch(kind: str, T: int, context: int, requests: int, page: int, seed: int,
               tables_of: Any) -> PagedBatch:
    """The batch of a point: contexts drawn per request (seeded, 1 .. ``context``), block tables
    from ``tables_of(ctx_lens)``. ``mixed``: ``T // 2`` decode tokens, the rest in up to
    ``requests`` prefill chunks, each after a context of its own."""
    rng = random.Random(seed * 1_000_003 + T)
    if kind == "decode":
        q_lens = [1] * T
    else:
        decode = T // 2
        chunks = max(1, min(requests, T - decode))
        cuts = sorted(rng.sample(range(1, T - decode), chunks - 1)) if chunks > 1 else []
        bounds = [0, *cuts, T - decode]
        q_lens = [1] * decode + [b - a for a, b in zip(bounds, bounds[1:])]
    ctx = [q + rng.randint(0, max(0, context - q)) for q in q_lens]
    ctx = [max(q, min(c, context)) for q, c in zip(q_lens, ctx)]
    return PagedBatch(tuple(q_lens), tuple(ctx), tables_of(ctx), page)


def frozen(batch: PagedBatch, rows: int, device: torch.device) -> Any:
    """The same attention with the batch's metadata frozen on the device now (the floor)."""
    slots, cu, ctx, table = PagedLive(batch).tensors(rows, device)
    max_q = batch.max_q

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor) -> None:
        paged_attention(q, k, v, out, k_cache, v_cache, slots, cu, ctx, table, max_q)

    return attention
