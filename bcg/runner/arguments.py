"""The arguments of :class:`bcg.GraphRunner`, checked before it builds anything (one function, at
the top of its ``__init__``). Checks that need the example inputs' shapes (``pad_dim`` per input)
are in :func:`bcg.runner.inputs.describe_inputs`."""

from __future__ import annotations

from collections.abc import Iterable, Sized
from typing import Any

import torch

from bcg.capture import check_capture_options
from bcg.core.args import check_bool, check_callable, check_choice, check_int, check_real, check_type, fail, is_int
from bcg.distributed.agreement import RankAgreement

MODES = ("graph", "eager")

_WHERE = "bcg.GraphRunner"


def check_runner_arguments(
    forward: Any,
    buckets: Any,
    example_inputs: Any,
    pad_dim: Any,
    mode: Any,
    max_padding_ratio: Any,
    copy_outputs: Any,
    sanitize: Any,
    pool: Any,
    stream: Any,
    capture_error_mode: Any,
    progress: Any,
    name: Any,
    variants: Any,
    debug: Any,
    ranks: Any,
    lazy: Any,
) -> None:
    """``TypeError`` or ``ValueError`` naming the first argument of ``GraphRunner`` that is wrong.
    (``live`` takes any value, or a function of the bucket size.)"""
    hint = "the signature is GraphRunner(forward, buckets=None, *, example_inputs=..., ...)"
    check_callable(_WHERE, "forward", forward, hint=hint)
    _check_buckets(buckets)
    if not isinstance(example_inputs, (tuple, list)):
        wrap = "; wrap a single input: example_inputs=(x,)" if isinstance(example_inputs, torch.Tensor) else ""
        fail(_WHERE, "example_inputs", "a tuple (or list) of forward's positional inputs", example_inputs,
             "give one example per positional input of forward" + wrap)
    _check_pad_dim(pad_dim)
    check_choice(_WHERE, "mode", mode, MODES)
    check_real(_WHERE, "max_padding_ratio", max_padding_ratio, minimum=0.0, below=1.0, optional=True,
               hint="it is the share of a bucket's rows that may be padding (None: any share)")
    check_bool(_WHERE, "copy_outputs", copy_outputs, optional=True)
    check_bool(_WHERE, "sanitize", sanitize)
    check_capture_options(_WHERE, pool, stream, capture_error_mode, variants, debug)
    check_bool(_WHERE, "progress", progress)
    check_type(_WHERE, "name", name, str, "a str", optional=True)
    if ranks is not None and not isinstance(ranks, RankAgreement) and not hasattr(ranks, "same_inputs"):
        # (an object with RankAgreement's methods passes: tests stand in for a peer that way)
        fail(_WHERE, "ranks", "None or a bcg.distributed.RankAgreement", ranks,
             "construct RankAgreement() on every rank, in the same order")
    if not isinstance(lazy, bool):
        check_int(_WHERE, "lazy", lazy, minimum=1, hint="True, False, or the call of a bucket that captures it")


def _check_buckets(buckets: Any) -> None:
    """None, or a collection of bucket sizes (ints >= 1), not empty. (Iterators are checked by
    :func:`bcg.runner.buckets.normalize_buckets` as it reads them: reading one here would use it up.)"""
    if buckets is None:
        return
    expects = "None or a list of bucket sizes (ints >= 1)"
    if is_int(buckets):
        fail(_WHERE, "buckets", expects, buckets,
             f"give the sizes, e.g. [16, 32, {buckets}], or bcg.runner.default_buckets({buckets}) for a ladder up "
             f"to {buckets}")
    if isinstance(buckets, (str, bytes)) or not isinstance(buckets, Iterable):
        fail(_WHERE, "buckets", expects, buckets, "e.g. buckets=[16, 32, 64]")
    if not isinstance(buckets, Sized):
        return
    if len(buckets) == 0:
        fail(_WHERE, "buckets", "None or a non-empty list of bucket sizes", buckets,
             "give at least one size, or None for the default ladder (bcg.runner.default_buckets())", ValueError)
    for i, size in enumerate(buckets):
        check_int(_WHERE, f"buckets[{i}]", size, minimum=1)


def _check_pad_dim(pad_dim: Any) -> None:
    """An int (the dim of every tensor input along which it is padded), or one int or None per input."""
    expects = "an int, or a tuple with one int (or None: not padded) per input"
    if is_int(pad_dim):
        return
    if not isinstance(pad_dim, (tuple, list)):
        fail(_WHERE, "pad_dim", expects, pad_dim)
    for i, d in enumerate(pad_dim):
        if d is not None and not is_int(d):
            fail(_WHERE, f"pad_dim[{i}]", "an int or None (not padded)", d)
