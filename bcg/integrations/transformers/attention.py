"""The attention breakpoint: transformers' own paged attention function, plain or staged.

:class:`PagedAttention` is registered with ``transformers.AttentionInterface`` (transformers'
public attention extension point) and called by every attention layer inside the forward the
runner captures. It hands the layer's queries and new K/V to one ``@bcg.breakpoint`` that calls
transformers' paged attention (``paged|sdpa`` or ``paged|eager``: it writes the new K/V into the
paged cache, reads the keys back, attends):

* plain (``bcg.live()`` is a :class:`StepMeta`): on the step's ``T`` real rows, with the step's own
  indices: where the staged attention runs flash, :func:`flash_step_attention` (the same kernel on
  the step's own lengths, no mask); else transformers' function with its mask, exactly as
  transformers runs it. Padded rows get zeros and never reach the cache;
* staged, inline in the graph (``bcg.live()`` is a :class:`Staged`): on every row of the bucket,
  with the static indices of :class:`StaticIndices` (padded rows write to the write-trash slot).
  In half precision on CUDA (:func:`flash_usable`) :func:`flash_staged_attention` writes the new
  K/V into the cache, reads the step's keys back (as many as the staged lengths hold, on the
  device: padded keys are never read) and runs ATen's varlen flash kernel over the staged
  cumulative lengths, so its work follows the step's real keys; otherwise transformers' function
  runs with a dense mask built on the device over the KV bound (padded keys read the zeroed
  read-trash slot; padded keys and rows masked out);
* during a capture of the breakable form (a :class:`CaptureMeta`): zeros, nothing written.
"""

from __future__ import annotations

import bisect
import collections
import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch

import bcg
from bcg.integrations.transformers.gather import gather_keys, triton_usable
from bcg.integrations.transformers.metadata import CaptureMeta, Staged, StaticIndices, StepMeta, block_causal_mask

# ATen's varlen flash forward (the kernel behind SDPA's flash backend): varlen with cumulative
# lengths and native GQA, which the public F.scaled_dot_product_attention does not take.
_FLASH = getattr(getattr(torch.ops.aten, "_flash_attention_forward", None), "default", None)


@functools.lru_cache(maxsize=8)
def _flash_device(device: torch.device) -> bool:
    # FlashAttention-2 needs sm80 or newer
    return torch.cuda.is_available() and torch.cuda.get_device_capability(device) >= (8, 0)


def flash_usable(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the staged attention runs ATen's flash kernel here: CUDA (sm80+), half precision,
    a head dimension flash takes, and Triton (:func:`.gather.gather_keys`).

    Arguments:
        device, dtype: the queries' device and dtype.
        head_dim: the attention head dimension.
    """
    return (_FLASH is not None and device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)
            and head_dim % 8 == 0 and head_dim <= 256 and _flash_device(device) and triton_usable())


def flash_staged_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           staged: Staged, out: torch.Tensor) -> None:
    """The staged attention with flash: every shape static, the work following the step's real keys.

    Arguments:
        module: the attention layer (``layer_idx``, ``scaling``).
        query: ``[1, heads, rows, D]``; ``key``/``value``: ``[1, kv_heads, rows, D]`` (the new K/V).
        staged: the static indices (write slots, read slots, cumulative lengths).
        out: ``[1, rows, heads, D]``, written: each request's attention, zeros past the step's rows.

    The new K/V go into the layer's paged cache as transformers' ``PagedAttentionCache.update``
    writes them (``index_copy_``; padded rows to the write trash). :func:`.gather.gather_keys` then
    reads the step's keys from the read slots, as many as ``cu_k`` holds on the device (the rest of
    the ``[kv_bound]`` buffers is never read). Flash attends each request over its own keys
    (``cu_k``), causal aligned bottom-right, which is transformers' CB mask: query ``a`` sees key
    ``b`` when ``b <= a + past``.
    """
    rows = query.shape[2]
    cache = staged.cache
    # transformers' own layout: one cache tensor per layer of a group (models with one group only)
    _, in_group = cache.layer_index_to_group_indices[module.layer_idx]
    k_cache, v_cache = cache.key_cache[in_group], cache.value_cache[in_group]
    k_cache.index_copy_(0, staged.write[:rows], key[0].transpose(0, 1))
    v_cache.index_copy_(0, staged.write[:rows], value[0].transpose(0, 1))
    # A step has at most one request per row: the first rows + 1 cumulative lengths hold every
    # request (the rest are padded, empty), which keeps flash's grid to the bucket, not the cache.
    cu_q, cu_k = staged.cu_q[: rows + 1], staged.cu_k[: rows + 1]
    keys = k_cache.new_empty((staged.kv_bound, *k_cache.shape[1:]))
    values = torch.empty_like(keys)
    gather_keys(k_cache, v_cache, staged.read, cu_k, keys, values)
    _flash_into(module, query, keys, values, cu_q, cu_k, rows, staged.kv_bound, out)


def flash_step_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         meta: StepMeta, out: torch.Tensor) -> None:
    """A step's attention with flash, eagerly on its own sizes: transformers' ``paged|flash_attention``
    path (its cache's ``update``, then the varlen kernel), with ATen's kernel, as the staged form
    computes it.

    Arguments:
        module: the attention layer (``layer_idx``, ``scaling``).
        query: ``[1, heads, T, D]``; ``key``/``value``: ``[1, kv_heads, T, D]`` (the new K/V).
        meta: the step's own indices and lengths.
        out: ``[1, T, heads, D]``, written (zeros in rows no request covers).
    """
    # writes the new K/V, reads the step's keys back (the new K/V themselves when it reads no cache)
    keys, values = meta.cache.update(key_states=key, value_states=value, layer_idx=module.layer_idx,
                                     read_index=[meta.read_index], write_index=[meta.write_index])
    T = query.shape[2]
    _flash_into(module, query, keys.contiguous(), values.contiguous(), meta.cu_q.to(torch.int32),
                meta.cu_k.to(torch.int32), meta.max_q or T, meta.max_k or keys.shape[0], out)


def _flash_into(module: torch.nn.Module, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int, max_k: int, out: torch.Tensor) -> None:
    """ATen's varlen flash kernel, causal aligned bottom-right, into ``out`` (``[1, rows, heads, D]``);
    rows past ``cu_q[-1]`` are zeroed."""
    assert _FLASH is not None
    rows = query.shape[2]
    q = query[0].transpose(0, 1).contiguous()
    # max_q is at least 2: at 1 with grouped KV heads the kernel takes a decode path that reads q
    # as one row per request and ignores cu_seq_q (padded rows are not requests)
    o = _FLASH(q, keys, values, cu_q, cu_k, max(max_q, 2), max_k, 0.0, True, False, scale=module.scaling)[0]
    # flash leaves rows no request covers unwritten (garbage, maybe NaN): zero them, statically shaped
    padded = torch.arange(rows, device=o.device) >= cu_q[-1]
    out[0].copy_(o.masked_fill_(padded.view(rows, 1, 1), 0))


class PagedAttention:
    """The attention function transformers' layers call, and its breakpoint.

    Arguments:
        base: transformers' paged attention function (``AttentionInterface()["paged|sdpa"]``).
        staged: capture the attention inline where a step fits (else: a plain breakpoint only).
        kv_bounds: ascending key bounds of the staged forms (the last one: the bucket's inline form).
        flash: whether the staged attention runs :func:`flash_staged_attention` and plain steps
            :func:`flash_step_attention` (decided once, for the model, with :func:`flash_usable`),
            else transformers' function with a mask.
        staged_max_tokens: forwards of more rows (buckets) call a plain breakpoint only.
    """

    def __init__(self, base: Callable[..., Any], staged: bool, kv_bounds: tuple[int, ...], flash: bool,
                 staged_max_tokens: int) -> None:
        self.base = base
        self.kv_bounds = kv_bounds
        self.flash = flash
        self.staged_max_tokens = staged_max_tokens
        self.indices: StaticIndices | None = None  # the current CB session's buffers (staged)
        # (weakly: transformers' attention registry keeps this object after the model is gone)
        self.modules: weakref.WeakValueDictionary[int, torch.nn.Module] = weakref.WeakValueDictionary()
        self._mask: torch.Tensor | None = None  # built by the first layer of a staged forward
        self._mask_layer: int | None = None
        #: Python runs of the breakpoint by way ("staged", "plain", "inert"; "flash": the staged and
        #: plain runs that used flash): every step in eager mode; in graph mode the steps that do not
        #: replay, warm-ups, captures and replays of the breakable form.
        self.runs: collections.Counter[str] = collections.Counter()
        kwargs: dict[str, Any] = {"name": "transformers_paged_attention", "mutates": ("out",)}
        self.attend_plain = bcg.breakpoint(self._attend, **kwargs)
        self.attend = bcg.breakpoint(self._attend, **kwargs, prepare=self.prepare, fits=self.fits) if staged \
            else self.attend_plain

    def staged_for(self, rows: int) -> bool:
        """Whether a forward of ``rows`` rows (a bucket) runs the staged attention where a step fits:
        a CB session's static indices are set and ``rows`` is at most ``staged_max_tokens``."""
        return self.indices is not None and rows <= self.staged_max_tokens

    def prepare(self, live: StepMeta | CaptureMeta) -> Staged:
        """The static tensors the inline attention reads (host only: the step's indices were
        copied in by :meth:`StaticIndices.load` before the replay)."""
        assert self.indices is not None
        if isinstance(live, CaptureMeta):
            bound = live.kv_bound or self.kv_bounds[-1]
        else:  # eager mode: the smallest bound that holds the step
            bound = self.kv_bounds[min(bisect.bisect_left(self.kv_bounds, live.keys), len(self.kv_bounds) - 1)]
        return self.indices.staged(bound)

    def fits(self, live: StepMeta | CaptureMeta, staged: Staged) -> bool:
        """Whether ``live`` runs inline in the form captured with ``staged``."""
        if isinstance(live, CaptureMeta):
            return live.kv_bound is not None
        return live.loaded and live.keys <= staged.kv_bound

    def forget_mask(self) -> None:
        """Drop the mask the last staged forward built (called when each forward ends)."""
        self._mask = None
        self._mask_layer = None

    def __call__(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                 **kwargs: Any) -> tuple[torch.Tensor, None]:
        """transformers' attention signature: ``query`` ``[1, heads, T, D]``, ``key``/``value``
        ``[1, kv_heads, T, D]``; returns ``[1, T, heads, D]``."""
        layer = module.layer_idx
        self.modules[layer] = module
        _, heads, rows, dim = query.shape
        out = torch.empty(1, rows, heads, dim, dtype=query.dtype, device=query.device)
        (self.attend if self.staged_for(rows) else self.attend_plain)(query, key, value, out, layer)
        return out, None

    def _attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, out: torch.Tensor,
                layer: int) -> None:
        """The breakpoint (see the module docstring for its three ways)."""
        live = bcg.live()
        module = self.modules[layer]
        rows = query.shape[2]
        if isinstance(live, Staged):
            self.runs["staged"] += 1
            if self.flash:
                if not flash_usable(query.device, query.dtype, query.shape[-1]):
                    raise RuntimeError(
                        f"bcg.integrations.transformers: the staged attention was set up for flash at enable(), "
                        f"but the model now runs {query.dtype} on {query.device}: after moving or casting the "
                        "model, call disable() and enable() again")
                self.runs["flash"] += 1
                flash_staged_attention(module, query, key, value, live, out)
                return
            if self._mask is None or self._mask_layer == layer:  # the first layer of this forward
                self._mask = block_causal_mask(live.cu_q, live.cu_k, rows, live.kv_bound, query.dtype)
                self._mask_layer = layer
            result, _ = self.base(module, query, key, value, attention_mask=self._mask, scaling=module.scaling,
                                  dropout=0.0, cache=live.cache, read_index=[live.read], write_index=[live.write[:rows]])
            out.copy_(result)
        elif isinstance(live, StepMeta):
            self.runs["plain"] += 1
            T = live.tokens
            q, k, v = (t[:, :, :T] for t in (query, key, value))
            if self.flash and flash_usable(query.device, query.dtype, query.shape[-1]):
                # the kernel the staged form runs, on the step's own sizes (reading no [T, K] mask)
                self.runs["flash"] += 1
                flash_step_attention(module, q, k, v, live, out[:, :T])
            else:
                result, _ = self.base(module, q, k, v, attention_mask=live.mask, scaling=module.scaling,
                                      dropout=0.0, cache=live.cache, read_index=[live.read_index],
                                      write_index=[live.write_index])
                out[:, :T].copy_(result)
            out[:, T:].zero_()
        else:  # a capture's inert run of the breakable form
            self.runs["inert"] += 1
            out.zero_()
