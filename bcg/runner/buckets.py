"""Bucket ladders: the sizes a :class:`bcg.GraphRunner` captures one graph for.

A call with ``T`` rows runs the graph of the smallest bucket ``>= T`` on inputs
zero-padded to that bucket, so the ladder trades memory and capture time (one
graph per bucket) against padding waste (``(bucket - T) / bucket``). Serving
engines use small steps for small sizes (decode batches, where every row is
expensive relative to the launch cost) and larger steps above. Everything here
is pure Python on plain ``int`` lists, sorted ascending, without duplicates.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence

__all__ = [
    "default_buckets",
    "geometric_buckets",
    "normalize_buckets",
    "padding_ratio",
    "pick_bucket",
    "stepped_buckets",
]


def normalize_buckets(buckets: Iterable[int]) -> list[int]:
    """``buckets`` as a sorted list of unique positive ints; ``ValueError`` if that is impossible."""
    out: set[int] = set()
    for b in buckets:
        if isinstance(b, bool) or not isinstance(b, int) and not hasattr(b, "__index__"):
            raise TypeError(f"bucket sizes must be ints, got {b!r} ({type(b).__name__})")
        value = int(b)
        if value < 1:
            raise ValueError(f"bucket sizes must be >= 1, got {value}")
        out.add(value)
    if not out:
        raise ValueError("the bucket ladder is empty: give at least one bucket size")
    return sorted(out)


def pick_bucket(buckets: Sequence[int], n: int) -> int | None:
    """The smallest bucket ``>= n`` of the ascending ``buckets``, or ``None`` when ``n`` is above them all."""
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else None


def padding_ratio(bucket: int, n: int) -> float:
    """The share of ``bucket`` rows that are padding when ``n`` rows are real: ``(bucket - n) / bucket``."""
    if bucket <= 0:
        raise ValueError(f"bucket must be >= 1, got {bucket}")
    return (bucket - n) / bucket


def too_padded(bucket: int, n: int, max_ratio: float | None) -> bool:
    """Whether more than ``max_ratio`` of ``bucket``'s rows are padding when ``n`` are real
    (``None``: any share may be)."""
    return max_ratio is not None and (bucket - n) > max_ratio * bucket


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def geometric_buckets(min_size: int, max_size: int, ratio: float = 2.0, *, multiple_of: int = 1) -> list[int]:
    """``min_size, min_size*ratio, min_size*ratio**2, ...`` up to ``max_size`` (always included).

    Every size is rounded up to a multiple of ``multiple_of`` (``max_size`` is
    kept as given) and sizes that round to the same value appear once, so the
    worst-case padding ratio is about ``1 - 1/ratio``.
    Example: ``geometric_buckets(16, 4096)`` is ``[16, 32, 64, ..., 4096]``.
    """
    if min_size < 1 or max_size < min_size:
        raise ValueError(f"need 1 <= min_size <= max_size, got min_size={min_size}, max_size={max_size}")
    if not ratio > 1.0:
        raise ValueError(f"ratio must be > 1, got {ratio}")
    if multiple_of < 1:
        raise ValueError(f"multiple_of must be >= 1, got {multiple_of}")
    sizes: set[int] = set()
    x = float(min_size)
    while x < max_size:
        sizes.add(min(_round_up(math.ceil(x - 1e-9), multiple_of), max_size))
        x *= ratio
    sizes.add(max_size)
    return sorted(sizes)


def stepped_buckets(
    max_size: int,
    steps: Sequence[tuple[int | None, int]] = ((256, 8), (512, 16), (None, 32)),
    *,
    head: Sequence[int] = (1, 2, 4),
) -> list[int]:
    """A serving-engine ladder: the sizes in ``head``, then fixed steps that grow with the size.

    ``steps`` is a list of ``(up_to, step)``: after the head, sizes go up by
    ``step`` (each a multiple of ``step``) until ``up_to`` (``None``: until
    ``max_size``), then the next pair takes over; ``max_size`` is always the
    last bucket. The default is like SGLang's/vLLM's decode ladders:
    ``1, 2, 4, 8, 16, ..., 256, 272, ..., 512, 544, ...``.
    Example: ``stepped_buckets(64, steps=((None, 16),))`` is ``[1, 2, 4, 16, 32, 48, 64]``.
    """
    if max_size < 1:
        raise ValueError(f"max_size must be >= 1, got {max_size}")
    sizes = {h for h in head if 1 <= h <= max_size}
    last = max(sizes) if sizes else 0
    for up_to, step in steps:
        if step < 1:
            raise ValueError(f"steps must be >= 1, got {step}")
        limit = max_size if up_to is None else min(up_to, max_size)
        x = (last // step + 1) * step  # the next multiple of step above the last size
        while x <= limit:
            sizes.add(x)
            last = x
            x += step
        if limit == max_size:
            break
    sizes.add(max_size)
    return sorted(sizes)


def default_buckets(max_tokens: int = 4096, min_tokens: int = 16) -> list[int]:
    """The default ladder: ``min_tokens``, then powers of two and 1.5x powers of two up to ``max_tokens``.

    For the defaults it is the 16 buckets ``16, 32, 48, 64, 96, 128, 192, 256,
    384, 512, 768, 1024, 1536, 2048, 3072, 4096``: neighbours differ by at most
    1.5x above 32, so at most a third of a bucket is padding there (half below).
    ``default_buckets(256, min_tokens=1)`` gives a decode (batch size) ladder
    ``1, 2, 3, 4, 6, 8, 12, ..., 192, 256``.
    """
    if min_tokens < 1 or max_tokens < min_tokens:
        raise ValueError(f"need 1 <= min_tokens <= max_tokens, got min_tokens={min_tokens}, max_tokens={max_tokens}")
    sizes = {min_tokens, max_tokens}
    p = 1
    while p <= max_tokens:
        for size in (p, p + p // 2):
            if 2 * min_tokens <= size <= max_tokens:
                sizes.add(size)
        p *= 2
    return sorted(sizes)
