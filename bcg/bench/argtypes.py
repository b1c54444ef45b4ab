"""``argparse`` types shared by the CLI's flags and the workloads' own.

A bad value is refused by argparse (``usage`` and one ``error:`` line naming the
flag, exit 2).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable


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
