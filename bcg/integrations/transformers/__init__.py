"""bcg for Hugging Face ``transformers``' continuous batching (tested with transformers 5.17.0).

``enable(model)`` makes ``model.generate_batch(...)`` and ``ContinuousBatchingManager`` replay the
decoder (the model's base model) through a lazy :class:`bcg.GraphRunner` (one graph per token bucket), with the
attention a staged breakpoint over transformers' own paged cache, or a plain one. The rest of
transformers' loop is unchanged. How it works, and what is staged: ``docs/transformers.md``.

``transformers`` is imported when ``enable`` is called, not with ``bcg``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from bcg.integrations.transformers.divergence import divergence
from bcg.runner.buckets import normalize_buckets
from bcg.integrations.transformers.graphs import (
    BASES,
    DEFAULT_KV_BOUNDS,
    DEFAULT_STAGED_MAX_TOKENS,
    FLASH_MAX_BUCKET,
    FLASH_MIN_BUCKET,
    ContinuousBatchingGraphs,
)

__all__ = ["BASES", "DEFAULT_KV_BOUNDS", "DEFAULT_STAGED_MAX_TOKENS", "FLASH_MAX_BUCKET", "FLASH_MIN_BUCKET",
           "ContinuousBatchingGraphs",
           "divergence", "enable"]


def enable(model: Any, *, buckets: Sequence[int] | None = None, staged: bool = True,
           kv_bounds: Sequence[int] | None = None, staged_max_tokens: int | None = None,
           mode: str | None = None) -> ContinuousBatchingGraphs:
    """Run ``model``'s continuous-batching forward through a bcg :class:`bcg.GraphRunner`.

    Arguments:
        model: a transformers causal LM whose forward passes the CB arguments to its
            ``base_model`` (Llama and its kind; the model's head stays its own), with attention
            ``"sdpa"`` or ``"eager"`` (which transformers' CB runs as ``"paged|sdpa"`` and
            ``"paged|eager"``) or one of those paged forms, and full attention only (no
            sliding-window layers).
        buckets: the token buckets; a step above the last runs eagerly, and a bucket above the
            CB cache's ``max_batch_tokens`` (no step is larger) is cut to it. Default: where the
            staged attention runs flash (see ``kv_bounds``), ``bcg.runner.geometric_buckets`` from
            ``FLASH_MIN_BUCKET`` to ``FLASH_MAX_BUCKET`` (larger steps run eagerly, attention with
            the same flash kernel on their own sizes); else ``bcg.runner.default_buckets`` from 8
            up to the CB cache's ``max_batch_tokens``. Captured lazily, each at its second step
            (its first runs eagerly).
        staged: run the attention inline in the graph where a step fits (default); ``False``:
            a plain breakpoint, run eagerly at every replay.
        kv_bounds: ascending bounds on the keys one step reads (all its requests' context
            packed), for the masked staged attention (whose work follows the bound): one staged
            form per bound and bucket (bounds below the bucket's tokens skipped, bounds above the
            cache's capacity cut to it); a step above the last runs the attention as a plain
            breakpoint. Default ``DEFAULT_KV_BOUNDS``. Not used where the staged attention runs
            flash (the model in half precision on a CUDA device of sm80 or newer, with Triton):
            its work follows each step's keys, so the one bound is the cache's capacity, every
            step of a bucket runs staged and each bucket has one form (no breakable form).
        staged_max_tokens: buckets above it run the attention as a plain breakpoint only.
            Default: every bucket staged where the staged attention runs flash (it builds no
            mask), else ``DEFAULT_STAGED_MAX_TOKENS``.
        mode: ``"graph"`` or ``"eager"`` (default: graphs on CUDA, eager on the CPU).

    Returns the handle: ``.stats()``, ``.release()`` (free the graphs), ``.disable()``. Enabling
    a model again disables its previous handle. Disable (or enable again) only while no
    ``ContinuousBatchingManager`` thread runs the model's steps.
    Generate with ``ContinuousBatchingConfig(use_cuda_graph=False)`` or the default (which is
    off for these attention implementations): transformers' own graphs would capture bcg's forward.
    A wrong argument raises ``ValueError`` or ``TypeError``; so does a model with another
    attention or with sliding-window layers (``ValueError``). A CB step that bcg cannot run (a
    session with another attention than ``enable`` saw: transformers switches a plain model to
    flash where that is installed, so set ``"paged|sdpa"`` then; a model whose forward does not
    call its base model; embeddings passed for token ids) runs transformers' own forward, and bcg
    logs one warning saying why. Under transformers' compile configs bcg steps aside (no warning).
    """
    if mode not in (None, "graph", "eager"):
        raise ValueError(f"bcg.integrations.transformers.enable: mode must be None, 'graph' or 'eager', not {mode!r}")
    if staged_max_tokens is not None and (not isinstance(staged_max_tokens, int) or staged_max_tokens < 0):
        raise ValueError("bcg.integrations.transformers.enable: staged_max_tokens must be None or an int >= 0, "
                         f"not {staged_max_tokens!r}")
    if buckets is not None:
        try:
            buckets = normalize_buckets(buckets)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"bcg.integrations.transformers.enable: buckets: {exc}") from None
    bounds = tuple(kv_bounds) if kv_bounds is not None else None
    if bounds is not None and (not bounds or any(not isinstance(b, int) or b <= 0 for b in bounds)
                               or list(bounds) != sorted(set(bounds))):
        raise ValueError(f"bcg.integrations.transformers.enable: kv_bounds must be ascending positive ints, not {kv_bounds!r}")
    return ContinuousBatchingGraphs(model, buckets=buckets, staged=staged, kv_bounds=bounds,
                                    staged_max_tokens=staged_max_tokens, mode=mode)
