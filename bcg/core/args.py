"""Checks of the arguments of bcg's public entry points.

Every check raises ``TypeError`` (a wrong type) or ``ValueError`` (a value out of
range, a choice not offered) with one message shape::

    <entry point>: <argument> must be <what it expects>, got <what it got>[; <what to do>]

e.g. ``bcg.make_graph: fn must be callable, got a Tensor of shape (2, 3); did you swap
fn and the static arguments? The signature is make_graph(fn, *static_args)``.

They run once, where an argument is given (construction, decoration, the start
of a capture), never on a replay's or a call's path. ``bool`` is not taken
where an int count is expected (``True`` is an ``int`` to Python); NumPy
integers, floats and bools are taken where Python's are.
"""

from __future__ import annotations

import numbers
import operator
from collections.abc import Iterable
from typing import Any, NoReturn

import numpy as np
import torch

__all__ = [
    "check_bool",
    "check_callable",
    "check_choice",
    "check_int",
    "check_pool",
    "check_real",
    "check_stream",
    "check_type",
    "describe",
    "fail",
    "is_int",
]

_SHORT = 60  # a value whose repr is longer is described by its type alone


def _article(word: str) -> str:
    return "an" if word[:1].lower() in "aeiou" else "a"


def describe(value: Any) -> str:
    """What a message says it got: ``None``, ``42 (int)``, ``'fast' (str)``, ``a Tensor of shape (2, 3)``,
    ``the class VariantPolicy``, ``a function``."""
    if value is None:
        return "None"
    if isinstance(value, torch.Tensor):
        return f"a Tensor of shape {tuple(value.shape)}"
    if isinstance(value, type):  # bcg.VariantPolicy where bcg.VariantPolicy() was meant
        return f"the class {value.__qualname__}"
    kind = type(value).__name__
    try:
        text = repr(value)
    except Exception:  # a repr that fails says nothing: the type does
        text = "<>"
    if len(text) <= _SHORT and not text.startswith("<"):
        return f"{text} ({kind})"
    return f"{_article(kind)} {kind}"


def fail(where: str, name: str, expects: str, value: Any, hint: str = "",
         error: type[Exception] = TypeError) -> NoReturn:
    """Raise ``error`` with the shared message shape."""
    text = f"{where}: {name} must be {expects}, got {describe(value)}"
    raise error(f"{text}; {hint}" if hint else text)


def is_int(value: Any) -> bool:
    """An integer, ``bool`` excluded: Python's, NumPy's, or anything with ``__index__``."""
    if isinstance(value, (bool, np.bool_)):
        return False
    if isinstance(value, int):
        return True
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def check_int(where: str, name: str, value: Any, *, minimum: int | None = None, hint: str = "") -> int:
    """``value`` as an ``int``: an integer (not a bool) ``>= minimum``."""
    expects = "an int" if minimum is None else f"an int >= {minimum}"
    if not is_int(value):
        fail(where, name, expects, value, hint)
    number = operator.index(value)
    if minimum is not None and number < minimum:
        fail(where, name, expects, value, hint, ValueError)
    return number


def check_real(where: str, name: str, value: Any, *, minimum: float | None = None, maximum: float | None = None,
               below: float | None = None, optional: bool = False, hint: str = "") -> float | None:
    """``value`` as a ``float``: a real number (not a bool), ``minimum <= value <= maximum`` (or ``< below``);
    ``None`` as well when ``optional``."""
    if optional and value is None:
        return None
    bounds = []
    if minimum is not None:
        bounds.append(f">= {minimum:g}")
    if maximum is not None:
        bounds.append(f"<= {maximum:g}")
    if below is not None:
        bounds.append(f"< {below:g}")
    expects = ("None or " if optional else "") + "a number" + (f" {' and '.join(bounds)}" if bounds else "")
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        fail(where, name, expects, value, hint)
    number = float(value)
    if (number != number or (minimum is not None and number < minimum)  # NaN fails every bound
            or (maximum is not None and number > maximum) or (below is not None and number >= below)):
        fail(where, name, expects, value, hint, ValueError)
    return number


def check_bool(where: str, name: str, value: Any, *, optional: bool = False, expects: str = "True or False",
               hint: str = "") -> None:
    """``value`` is ``True`` or ``False`` (a NumPy bool too); ``None`` as well when ``optional``."""
    if optional and value is None:
        return
    if not isinstance(value, (bool, np.bool_)):
        if optional:
            expects = "True, False or None" if expects == "True or False" else expects + " or None"
        fail(where, name, expects, value, hint)


def check_callable(where: str, name: str, value: Any, *, optional: bool = False, expects: str = "callable",
                   hint: str = "") -> None:
    """``value`` is callable; ``None`` as well when ``optional``."""
    if optional and value is None:
        return
    if not callable(value):
        fail(where, name, expects + (" or None" if optional else ""), value, hint)


def check_choice(where: str, name: str, value: Any, choices: Iterable[str], hint: str = "") -> None:
    """``value`` is one of the strings ``choices`` (``TypeError`` for a non-string, ``ValueError`` otherwise)."""
    options = tuple(choices)
    expects = "one of " + ", ".join(map(repr, options))
    if not isinstance(value, str):
        fail(where, name, expects, value, hint)
    if value not in options:
        fail(where, name, expects, value, hint, ValueError)


def check_type(where: str, name: str, value: Any, types: type | tuple[type, ...], expects: str, *,
               optional: bool = False, hint: str = "") -> None:
    """``value`` is an instance of ``types`` (``expects`` says which, in words); ``None`` as well when ``optional``."""
    if optional and value is None:
        return
    if not isinstance(value, types):
        if isinstance(value, type) and issubclass(value, types):
            hint = f"pass an instance, {value.__name__}(...), not the class"
        fail(where, name, expects + (" or None" if optional else ""), value, hint)


def check_pool(where: str, value: Any) -> None:
    """``value`` is ``None`` or a pool handle: the pair of ints ``bcg.graph_pool_handle()`` and ``graph.pool()`` return."""
    if value is None:
        return
    if not (isinstance(value, tuple) and len(value) == 2 and all(is_int(v) for v in value)):
        fail(where, "pool", "None or a pool handle (the pair of ints bcg.graph_pool_handle() returns)", value,
             "pass bcg.graph_pool_handle(), or graph.pool() / runner.pool() to share another's pool")


def check_stream(where: str, value: Any) -> None:
    """``value`` is ``None`` or a ``torch.cuda.Stream``."""
    check_type(where, "stream", value, torch.cuda.Stream, "a torch.cuda.Stream", optional=True,
               hint="pass torch.cuda.Stream(), or None for bcg's capture stream of the device")
