"""The attention breakpoint: transformers' own paged attention function, plain or staged.

:class:`PagedAttention` is registered with ``transformers.AttentionInterface`` (transformers'
public attention extension point) and called by every attention layer inside the forward the
runner captures. It hands the layer's queries and new K/V to one ``@bcg.breakpoint`` that calls
transformers' paged attention (``paged|sdpa`` or ``paged|eager``: it writes the new K/V into the
paged cache, reads the keys back, attends):

* plain (``bcg.live()`` is a :class:`StepMeta`): on the step's ``T`` real rows, with the step's own
  indices and mask, exactly as transformers runs it; padded rows get zeros and never reach the cache;
* staged, inline in the graph (``bcg.live()`` is a :class:`Staged`): on every row of the bucket,
  with the static indices of :class:`StaticIndices` (padded rows write to the write-trash slot,
  padded keys read the zeroed read-trash slot) and a mask built on the device from the staged
  cumulative lengths (padded keys and rows masked out);
* during a capture of the breakable form (a :class:`CaptureMeta`): zeros, nothing written.
"""

from __future__ import annotations

import bisect
import collections
from collections.abc import Callable
from typing import Any

import torch

import bcg
from bcg.integrations.transformers.metadata import CaptureMeta, Staged, StaticIndices, StepMeta, block_causal_mask


class PagedAttention:
    """The attention function transformers' layers call, and its breakpoint.

    Arguments:
        base: transformers' paged attention function (``AttentionInterface()["paged|sdpa"]``).
        staged: capture the attention inline where a step fits (else: a plain breakpoint only).
        kv_bounds: ascending key bounds of the staged forms (the last one: the bucket's inline form).
    """

    def __init__(self, base: Callable[..., Any], staged: bool, kv_bounds: tuple[int, ...]) -> None:
        self.base = base
        self.kv_bounds = kv_bounds
        self.indices: StaticIndices | None = None  # the current CB session's buffers (staged)
        self.modules: dict[int, torch.nn.Module] = {}
        self._mask: torch.Tensor | None = None  # built by the first layer of a staged forward
        self._mask_layer: int | None = None
        #: Python runs of the breakpoint by way ("staged", "plain", "inert"): every step in eager
        #: mode; in graph mode only warm-ups, captures and replays of the breakable form.
        self.runs: collections.Counter[str] = collections.Counter()
        kwargs: dict[str, Any] = {"name": "transformers_paged_attention", "mutates": ("out",)}
        if staged:
            kwargs.update(prepare=self.prepare, fits=self.fits)
        self.attend = bcg.breakpoint(self._attend, **kwargs)

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
        self.attend(query, key, value, out, layer)
        return out, None

    def _attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, out: torch.Tensor,
                layer: int) -> None:
        """The breakpoint (see the module docstring for its three ways)."""
        live = bcg.live()
        module = self.modules[layer]
        rows = query.shape[2]
        if isinstance(live, Staged):
            self.runs["staged"] += 1
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
            result, _ = self.base(module, q, k, v, attention_mask=live.mask, scaling=module.scaling, dropout=0.0,
                                  cache=live.cache, read_index=[live.read_index], write_index=[live.write_index])
            out[:, :T].copy_(result)
            out[:, T:].zero_()
        else:  # a capture's inert run of the breakable form
            self.runs["inert"] += 1
            out.zero_()
