"""Workloads: one module per workload, listed in ``WORKLOADS``.

A workload module provides:

* ``NAME`` and ``NEEDS_CUDA`` (``True``: skipped on a machine with no GPU);
* ``add_arguments(parser)`` - its own flags;
* optionally ``check_args(args) -> str | None`` - checks across its flags, run right after
  parsing when the workload is selected (a message: the CLI refuses the arguments with it);
* ``points(args) -> list[(attn | None, T | None)]`` - the benchmark points;
* ``setup(args, device) -> state`` - built once (e.g. the model weights);
* ``make_case(state, args, device, attn, T) -> Case`` - one point, ready for the modes;
* ``config(args, device) -> dict`` - what goes into ``bench.json``'s ``config``.

The ``argparse`` types below are shared by the workloads' flags and the CLI's own: a bad
value is refused by argparse (``usage`` and one ``error:`` line naming the flag, exit 2).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from types import ModuleType


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def positive_int(text: str) -> int:
    """An ``argparse`` type: an integer >= 1."""
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def nonnegative_int(text: str) -> int:
    """An ``argparse`` type: an integer >= 0."""
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return value


def int_in(low: int, high: int) -> Callable[[str], int]:
    """An ``argparse`` type: an integer in ``[low, high]``."""

    def parse(text: str) -> int:
        value = _int(text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be an integer from {low} to {high}, got {text!r}")
        return value

    return parse


from bcg.bench.workloads import llama, micro  # noqa: E402  (they use the types above)

WORKLOADS: dict[str, ModuleType] = {llama.NAME: llama, micro.NAME: micro}
