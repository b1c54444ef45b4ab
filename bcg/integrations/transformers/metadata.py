"""The per-step metadata of transformers' continuous batching, as the attention breakpoint reads it.

transformers' continuous batching (CB) calls the model with its paged-attention kwargs
(``PagedAttentionArgs``): packed ``input_ids`` / ``position_ids`` of ``T`` tokens, one write
index per token (the cache slot its K/V goes to), one read index per key (the cache slots
attention reads, every request's keys packed one after another), ``cu_seq_lens_q`` /
``cu_seq_lens_k`` and, for ``paged|sdpa`` and ``paged|eager``, a ``[T, K]`` additive mask.

* :class:`StepMeta`: one step's kwargs, what ``bcg.live()`` returns when the attention runs as a
  plain breakpoint (every size exact).
* :class:`CaptureMeta`: what a bucket's warm-ups and captures run with (inert: see
  :class:`StaticIndices`).
* :class:`StaticIndices`: static device copies of one step's indices at static bounds, read by
  the staged attention inline. Padded query rows write to transformers' write-trash slot; the
  masked attention's padded keys read its read-trash slot (zero K/V, masked out), flash reads no
  slot past the step's keys.
* :func:`block_causal_mask`: transformers' block-diagonal causal mask, built on the device
  from the cumulative lengths at static sizes.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class StepMeta:
    """One CB step's attention kwargs (device tensors; sizes read from shapes, no sync).

    Arguments:
        cache: transformers' ``PagedAttentionCache`` (its K/V tensors and trash slots).
        tokens: ``T``, the step's query tokens.
        write_index: ``[T]`` cache slots the new K/V go to.
        read_index: ``[K]`` cache slots attention reads (empty: no cache read, ``K = T``).
        cu_q, cu_k: ``[R + 1]`` cumulative query and key lengths.
        mask: transformers' ``[1, 1, T, K]`` additive mask (``None`` if it built none).
        max_q, max_k: the longest request's queries and keys (host numbers; 0: not given, bounded by
            ``T`` and ``K``).
        loaded: whether :class:`StaticIndices` hold this step's indices (staged attention may run).
    """

    cache: Any
    tokens: int
    write_index: torch.Tensor
    read_index: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    mask: torch.Tensor | None
    max_q: int = 0
    max_k: int = 0
    loaded: bool = False

    @property
    def keys(self) -> int:
        """``K``: the keys attention reads (``T`` when the step reads no cache)."""
        return self.read_index.numel() or self.tokens


@dataclass(frozen=True)
class CaptureMeta:
    """What a bucket's warm-up and capture run with: no request, K/V written to the trash slot.

    Arguments:
        kv_bound: the keys the staged attention of this form reads (``None``: plain attention).
    """

    kv_bound: int | None


@dataclass(frozen=True)
class Staged:
    """What the staged attention reads inline (``prepare``'s value): static tensors and bounds.

    Arguments:
        cache: transformers' paged cache (a weak proxy).
        write: ``[max_tokens]`` write slots (padded rows: the write trash).
        read: ``[kv_bound]`` read slots (past the step's keys: the read trash, or, for flash, which
            reads only the step's, left as they were).
        cu_q, cu_k: ``[max_tokens + 1]`` cumulative lengths (padded requests: empty).
        kv_bound: ``read``'s length.
    """

    cache: Any
    write: torch.Tensor
    read: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    kv_bound: int


class StaticIndices:
    """Static device buffers holding one step's indices at fixed addresses and bounds.

    Arguments:
        cache: transformers' ``PagedAttentionCache`` of this CB session (its ``write_trash_index``,
            ``read_trash_index``, ``max_batch_tokens`` and device).
        kv_limit: the most keys a staged form reads (the largest KV bound).
        pad_reads: whether the staged attention reads the read slots past the step's keys (the
            masked attention reads all ``[kv_bound]``; flash's gather reads ``cu_k[-1]`` of them).
            If so, :meth:`load` points them at the read trash.

    :meth:`load` copies a step's indices in on the current stream, device to device (transformers
    already uploaded them): a few copies per step, not per layer. :meth:`clear` makes the buffers
    inert (every write to the trash, nothing read), which captures need.
    """

    def __init__(self, cache: Any, kv_limit: int, pad_reads: bool = True) -> None:
        device = cache.key_cache[0].device
        rows = cache.max_batch_tokens
        # (weakly: what a form's capture freezes holds no session alive, see ContinuousBatchingGraphs)
        self.cache = weakref.proxy(cache)
        self.write_trash = int(cache.write_trash_index)
        self.read_trash = int(cache.read_trash_index)
        self.write = torch.full((rows,), self.write_trash, dtype=torch.int64, device=device)
        self.read = torch.full((kv_limit,), self.read_trash, dtype=torch.int64, device=device)
        self.cu_q = torch.zeros(rows + 1, dtype=torch.int32, device=device)
        self.cu_k = torch.zeros(rows + 1, dtype=torch.int32, device=device)
        self.pad_reads = pad_reads
        self._dirty = False  # the buffers hold a step's indices (else inert)

    def staged(self, kv_bound: int) -> Staged:
        """The views a form with ``kv_bound`` keys reads."""
        return Staged(self.cache, self.write, self.read[:kv_bound], self.cu_q, self.cu_k, kv_bound)

    def load(self, meta: StepMeta) -> None:
        """Copy ``meta``'s indices in (its ``K`` must be within the buffers); pads the write slots
        (and, with ``pad_reads``, the read slots) with trash slots."""
        T, K, R = meta.tokens, meta.keys, meta.cu_q.numel() - 1
        self.write[:T].copy_(meta.write_index)
        self.write[T:].fill_(self.write_trash)
        # no cache read: attention reads back the slots it just wrote (transformers uses the new K/V)
        self.read[:K].copy_(meta.read_index if meta.read_index.numel() else meta.write_index)
        if self.pad_reads:
            self.read[K:].fill_(self.read_trash)
        for buffer, cu in ((self.cu_q, meta.cu_q), (self.cu_k, meta.cu_k)):
            buffer[: R + 1].copy_(cu)
            buffer[R + 1:].copy_(cu[R:].expand(buffer.numel() - R - 1))  # padded requests: empty
        self._dirty = True

    def clear(self) -> None:
        """Make the buffers inert: every row writes to the write trash, no request has a key (and,
        with ``pad_reads``, every read slot points at the read trash)."""
        if self._dirty:
            self.write.fill_(self.write_trash)
            if self.pad_reads:
                self.read.fill_(self.read_trash)
            self.cu_q.zero_()
            self.cu_k.zero_()
            self._dirty = False


def block_causal_mask(cu_q: torch.Tensor, cu_k: torch.Tensor, rows: int, cols: int,
                      dtype: torch.dtype) -> torch.Tensor:
    """transformers' CB mask (``build_attention_mask``, full attention) at static sizes, on the device.

    Arguments:
        cu_q, cu_k: cumulative query and key lengths (padded requests empty: repeated values).
        rows, cols: the mask's query rows and key columns (rows and columns past the requests are
            masked out).
        dtype: the mask's dtype (0 where a query sees a key, ``finfo(dtype).min`` elsewhere).

    Returns a ``[1, 1, rows, cols]`` tensor. Query ``a`` of a request sees key ``b`` of the same
    request when ``b <= a + past``, ``past`` being its keys minus its queries.
    """
    device = cu_q.device
    cu_q, cu_k = cu_q.long(), cu_k.long()
    slots = cu_q.numel() - 1
    t = torch.arange(rows, device=device)
    j = torch.arange(cols, device=device)
    rq = torch.bucketize(t, cu_q[1:], right=True)  # each row's request (slots: past the last)
    rk = torch.bucketize(j, cu_k[1:], right=True)
    rq_c, rk_c = rq.clamp(max=slots - 1), rk.clamp(max=slots - 1)
    past = (cu_k[1:] - cu_k[:-1]) - (cu_q[1:] - cu_q[:-1])
    limit = (t - cu_q[rq_c]) + past[rq_c]  # the last key position each row sees
    seen = (rq.unsqueeze(1) == rk.unsqueeze(0)) & (rq < slots).unsqueeze(1)
    seen &= (j - cu_k[rk_c]).unsqueeze(0) <= limit.unsqueeze(1)
    mask = torch.zeros(rows, cols, dtype=dtype, device=device)
    return mask.masked_fill_(~seen, torch.finfo(dtype).min).view(1, 1, rows, cols)
