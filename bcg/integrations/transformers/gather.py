"""The flash staged attention's K/V read, bounded by the step's real keys on the device.

A graph's shapes are fixed at capture: ``torch.index_select`` over the static ``[kv_bound]`` read
slots moves ``kv_bound`` rows at every replay, whatever the step reads. :func:`gather_keys` is one
Triton kernel that reads the step's key count on the device (the last staged cumulative length)
and moves only those rows, so its work follows the real keys and one form per bucket can bound
them by the cache's capacity. Triton ships with torch's CUDA wheels; without it the staged
attention does not take the flash way (:func:`triton_usable`).
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import time
from typing import Any

import torch

log = logging.getLogger("bcg")

#: rows per loop step of one program, and programs per SM (a grid-stride loop: the grid is fixed at
#: capture, the loop's end is read on the device)
_BLOCK_ROWS = 16
_PROGRAMS_PER_SM = 4


@functools.lru_cache(maxsize=1)
def triton_usable() -> bool:
    """Whether Triton imports here (the flash staged attention needs it)."""
    return importlib.util.find_spec("triton") is not None


@functools.lru_cache(maxsize=1)
def _kernel() -> Any:
    import triton
    import triton.language as tl

    # ``last`` is not specialized on: one compiled kernel for every bucket's prefix of ``cu_k``
    @triton.jit(do_not_specialize=["last"])
    def gather(k_src, v_src, index, cu_k, last, k_dst, v_dst, ROW: tl.constexpr, BLOCK_ROWS: tl.constexpr,
               BLOCK_COLS: tl.constexpr):
        n = tl.load(cu_k + last)
        cols = tl.arange(0, BLOCK_COLS)
        col_ok = cols < ROW
        for start in range(tl.program_id(0) * BLOCK_ROWS, n, tl.num_programs(0) * BLOCK_ROWS):
            rows = start + tl.arange(0, BLOCK_ROWS)
            row_ok = rows < n
            slots = tl.load(index + rows, mask=row_ok, other=0).to(tl.int64)
            src = slots[:, None] * ROW + cols[None, :]
            dst = rows.to(tl.int64)[:, None] * ROW + cols[None, :]
            ok = row_ok[:, None] & col_ok[None, :]
            tl.store(k_dst + dst, tl.load(k_src + src, mask=ok), mask=ok)
            tl.store(v_dst + dst, tl.load(v_src + src, mask=ok), mask=ok)

    return gather


def load_kernel(device: torch.device, dtype: torch.dtype, kv_heads: int, head_dim: int) -> float:
    """Compile (or load from Triton's disk cache) the kernel that :func:`gather_keys` runs on
    caches of ``dtype`` with rows of ``kv_heads * head_dim``, by one call that moves nothing.
    Returns the seconds it took.

    Arguments:
        device: a CUDA device.
        dtype: the K/V cache's dtype.
        kv_heads, head_dim: the cache's row shape.

    A kernel's first call in a process compiles it (on a machine's first use) or loads it: at
    ``enable``, rather than inside the first capture's warm-up.
    """
    t0 = time.perf_counter()
    cache = torch.zeros(1, kv_heads, head_dim, dtype=dtype, device=device)
    index = torch.zeros(1, dtype=torch.int64, device=device)
    cu_k = torch.zeros(2, dtype=torch.int32, device=device)  # no keys: nothing moved
    out = torch.empty_like(cache)
    gather_keys(cache, cache, index, cu_k, out, out.clone())
    torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    log.info("bcg: the K/V gather kernel loaded in %.2f s", seconds)
    return seconds


@functools.lru_cache(maxsize=8)
def _programs(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count * _PROGRAMS_PER_SM


def gather_keys(k_cache: torch.Tensor, v_cache: torch.Tensor, index: torch.Tensor, cu_k: torch.Tensor,
                keys: torch.Tensor, values: torch.Tensor) -> None:
    """``keys[i] = k_cache[index[i]]`` and ``values[i] = v_cache[index[i]]`` for ``i < cu_k[-1]``.

    Arguments:
        k_cache, v_cache: ``[slots, kv_heads, D]`` contiguous CUDA tensors (one layer's cache).
        index: ``[bound]`` contiguous cache slots (int32 or int64).
        cu_k: contiguous cumulative key lengths on the device; its last value is the rows to move.
        keys, values: ``[bound, kv_heads, D]`` contiguous outputs; rows from ``cu_k[-1]`` on are
            left as they were.

    The kernel reads ``cu_k[-1]`` on the device, so a captured call moves the rows a replay's
    ``cu_k`` holds. Nothing checks ``cu_k[-1] <= bound`` on the device: it must hold.
    """
    bound = index.numel()
    row = k_cache[0].numel()
    if not all(t.is_contiguous() for t in (k_cache, v_cache, index, cu_k, keys, values)):
        raise ValueError("gather_keys: every tensor must be contiguous")
    if keys.shape[0] != bound or keys[0].numel() != row or values.shape != keys.shape or v_cache.shape != k_cache.shape:
        raise ValueError(f"gather_keys: outputs {tuple(keys.shape)}/{tuple(values.shape)} for {bound} slots of "
                         f"{tuple(k_cache.shape[1:])}")
    if bound == 0:
        return
    import triton

    grid = (min(triton.cdiv(bound, _BLOCK_ROWS), _programs(keys.device)),)
    _kernel()[grid](k_cache, v_cache, index, cu_k, cu_k.numel() - 1, keys, values, ROW=row, BLOCK_ROWS=_BLOCK_ROWS,
                    BLOCK_COLS=triton.next_power_of_2(row))
