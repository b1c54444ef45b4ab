"""The runner's inputs: what each position of ``example_inputs`` requires, call validation,
and the static inputs every bucket's graph reads."""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from bcg.core import cudart
from bcg.core.args import is_int
from bcg.core.bridge import same_value

PADDED, BY_REFERENCE, VALUE = "padded", "by_reference", "value"


@dataclass(frozen=True, eq=False)
class InputSpec:
    """What one position of ``example_inputs`` requires of a call."""

    index: int
    kind: str  # PADDED, BY_REFERENCE or VALUE
    example: Any
    pad_dim: int = -1
    dtype: torch.dtype | None = None
    device: torch.device | None = None
    shape: tuple[int, ...] = ()  # the example's shape (its pad dim is free)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def shape_text(self) -> str:
        dims = ["T" if d == self.pad_dim else str(s) for d, s in enumerate(self.shape)]
        return "(" + ", ".join(dims) + ("," if len(dims) == 1 else "") + ")"

    def describe(self) -> str:
        if self.kind == VALUE:
            return f"the value {self.example!r} (non-tensor inputs are frozen at capture)"
        if self.kind == BY_REFERENCE:
            return (
                f"the same {self.dtype} tensor of shape {tuple(self.shape)} on {self.device} as in "
                "example_inputs (it is not padded, pad_dim None: the graphs read it in place)"
            )
        return f"a {self.dtype} tensor on {self.device} of shape {self.shape_text()}, T along dim {self.pad_dim}"


def describe_inputs(examples: tuple[Any, ...], pad_dim: int | Sequence[int | None]) -> list[InputSpec]:
    """One :class:`InputSpec` per example input; ``ValueError`` for a ``pad_dim`` that does not fit."""
    if is_int(pad_dim):
        dims: list[int | None] = [operator.index(pad_dim) if isinstance(x, torch.Tensor) else None for x in examples]
    else:
        dims = [None if d is None else operator.index(d) for d in pad_dim]  # type: ignore[union-attr]
        if len(dims) != len(examples):
            raise ValueError(
                f"pad_dim has {len(dims)} entries but example_inputs has {len(examples)}: give one "
                "entry per input (None for inputs that are not padded)"
            )
    specs = []
    for i, (x, d) in enumerate(zip(examples, dims)):
        if not isinstance(x, torch.Tensor):
            if d is not None:
                raise ValueError(f"input {i} is a {type(x).__name__}, not a tensor: its pad_dim must be None")
            specs.append(InputSpec(i, VALUE, x))
            continue
        shape = tuple(x.shape)
        if d is None:
            specs.append(InputSpec(i, BY_REFERENCE, x, -1, x.dtype, x.device, shape))
            continue
        if x.dim() == 0 or not -x.dim() <= d < x.dim():
            raise ValueError(
                f"input {i} has shape {shape}, which has no dim {d} to pad; give pad_dim per input "
                "(None for inputs that are not padded)"
            )
        specs.append(InputSpec(i, PADDED, x, d % x.dim(), x.dtype, x.device, shape))
    return specs


def padded_device(specs: list[InputSpec]) -> tuple[int, torch.device]:
    """The position of the first padded input, and the one device of all padded inputs."""
    padded = [s for s in specs if s.kind == PADDED]
    if not padded:
        raise ValueError(
            "example_inputs needs at least one padded tensor input (the one whose size along pad_dim is T)"
        )
    devices = {s.device for s in padded}
    if len(devices) > 1:
        raise ValueError(f"all padded inputs must be on one device, got {sorted(map(str, devices))}")
    device = devices.pop()
    assert device is not None
    return padded[0].index, device


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
        and a.device == b.device
    )


def check_inputs(specs: list[InputSpec], inputs: tuple[Any, ...], runner: str) -> int:
    """Validate a call's inputs against the example's; return ``T``. Raises before any side effect."""
    if len(inputs) != len(specs):
        raise TypeError(
            f"GraphRunner({runner}) takes {len(specs)} input(s), like example_inputs, "
            f"but {len(inputs)} were given"
        )
    T = -1
    first = -1
    for s, x in zip(specs, inputs):
        if s.kind == VALUE:
            if not same_value(x, s.example):
                raise ValueError(f"input {s.index} is {x!r}; expected {s.describe()}")
            continue
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"input {s.index} is a {type(x).__name__}; expected {s.describe()}")
        if x.dtype != s.dtype:
            raise TypeError(f"input {s.index} has dtype {x.dtype}; expected {s.describe()}")
        if x.device != s.device:
            raise ValueError(f"input {s.index} is on {x.device}; expected {s.describe()}")
        if s.kind == BY_REFERENCE:
            if x is not s.example and not _same_tensor(x, s.example):
                raise ValueError(f"input {s.index} is another tensor; expected {s.describe()}")
            continue
        shape = x.shape
        d = s.pad_dim
        if len(shape) != s.ndim or shape[:d] != s.shape[:d] or shape[d + 1 :] != s.shape[d + 1 :]:
            raise ValueError(f"input {s.index} has shape {tuple(shape)}; expected {s.describe()}")
        if T < 0:
            T, first = shape[d], s.index
        elif shape[d] != T:
            raise ValueError(
                f"input {s.index} has {shape[d]} rows along its pad dim {d} but input {first} has {T}: "
                "all padded inputs must have the same size T"
            )
    return T


class StaticInputs:
    """The static inputs: the buffers of the padded inputs, which every bucket's graph reads.

    A padded input whose dims before ``pad_dim`` are all 1 gets one buffer of
    ``rows`` rows, and each bucket reads a prefix of it; any other gets one
    buffer per bucket size. ``static_ptrs`` holds the storages of every buffer
    and by-reference input (never sanitized: the graphs read them in place).
    """

    def __init__(self, specs: list[InputSpec], rows: int, device: torch.device) -> None:
        self.specs = specs
        self.padded = [s for s in specs if s.kind == PADDED]
        self._device = device
        self._buffers: dict[int, torch.Tensor] = {}  # input index -> shared buffer (``rows`` rows)
        self._own_buffers: dict[tuple[int, int], torch.Tensor] = {}  # (input, size) -> buffer
        self._views: dict[int, list[Any]] = {}
        self.static_ptrs: set[int] = set()
        for s in specs:
            if s.kind == BY_REFERENCE:
                self.static_ptrs.add(s.example.untyped_storage().data_ptr())
        for s in self.padded:
            if all(n == 1 for n in s.shape[: s.pad_dim]):  # a prefix along pad_dim stays contiguous
                shape = list(s.shape)
                shape[s.pad_dim] = rows
                buf = torch.zeros(shape, dtype=s.dtype, device=device)
                self._buffers[s.index] = buf
                self.static_ptrs.add(buf.untyped_storage().data_ptr())

    def buffers(self) -> list[torch.Tensor]:
        """Every static buffer (for inspection)."""
        return [*self._buffers.values(), *self._own_buffers.values()]

    def views(self, n: int) -> list[Any]:
        """The inputs ``forward`` is run on at size ``n``: static inputs of ``n`` rows, and the rest."""
        views = self._views.get(n)
        if views is not None:
            return views
        views = []
        for s in self.specs:
            if s.kind != PADDED:
                views.append(s.example)
                continue
            buf = self._buffers.get(s.index)
            if buf is None:
                shape = list(s.shape)
                shape[s.pad_dim] = n
                buf = torch.zeros(shape, dtype=s.dtype, device=self._device)
                self._own_buffers[(s.index, n)] = buf
                self.static_ptrs.add(buf.untyped_storage().data_ptr())
            views.append(buf.narrow(s.pad_dim, 0, n))
        self._views[n] = views
        return views

    def call_inputs(self, n: int, T: int) -> tuple[Any, ...]:
        """The inputs of a call with ``T`` rows, made of bucket ``n``'s static inputs: the first ``T``
        rows of each padded buffer (``GraphRunner.input_buffers``), the other inputs as given."""
        views = self.views(n)
        return tuple(views[s.index].narrow(s.pad_dim, 0, T) if s.kind == PADDED else views[s.index]
                     for s in self.specs)

    def padded_views(self, views: list[Any]) -> list[tuple[torch.Tensor, int]]:
        """The padded inputs among a bucket's ``views``, each with the dim it is padded along."""
        return [(views[s.index], s.pad_dim) for s in self.padded]

    def load_example(self, n: int) -> list[Any]:
        """Fill the size-``n`` static inputs with the example's rows (zeros past them); return them."""
        views = self.views(n)
        for s in self.padded:
            view = views[s.index]
            view.zero_()
            rows = min(n, s.shape[s.pad_dim])
            view.narrow(s.pad_dim, 0, rows).copy_(s.example.narrow(s.pad_dim, 0, rows))
        return views

    @contextlib.contextmanager
    def preserved(self, sizes: Iterable[int]) -> Iterator[None]:
        """Give the static inputs of ``sizes`` back their values after the block (a capture that
        loads the example into them while calls may have filled them, see
        ``GraphRunner.input_buffers``). Copies on the current stream, before and after."""
        saved = [(view, view.clone()) for n in sorted(set(sizes)) for view in
                 (self.views(n)[s.index] for s in self.padded)]
        try:
            yield
        finally:
            for view, value in saved:
                view.copy_(value)

    def write(self, views: list[Any], inputs: tuple[Any, ...], T: int, zero_tail: bool, stream: int | None = None) -> None:
        """Copy a call's ``T`` rows into the bucket's ``views``; ``zero_tail``: zero the rows past ``T``.

        An input that is the view's own first ``T`` rows is not copied. With
        ``stream`` (the raw current stream of the buffers' CUDA device), a
        contiguous input bound for a shared buffer (whose first ``T`` rows are
        contiguous), and held elsewhere, is copied with one ``cudaMemcpyAsync``
        there; others with ``copy_``.
        """
        for s in self.padded:
            view = views[s.index]
            x = inputs[s.index]
            if x.data_ptr() == view.data_ptr() and x.stride() == view.stride():
                pass  # the call passed the buffer's own first T rows (GraphRunner.input_buffers)
            elif (
                stream is not None
                and s.index in self._buffers
                and x.is_contiguous()
                and not x.is_conj() and not x.is_neg()  # (lazy bits a byte copy would drop)
                and x.untyped_storage().data_ptr() != view.untyped_storage().data_ptr()
            ):  # (``copy_`` refuses an input that overlaps the buffer; a memcpy would not)
                cudart.copy_device_to_device(view.data_ptr(), x.data_ptr(), x.numel() * x.element_size(), stream)
            else:
                view.narrow(s.pad_dim, 0, T).copy_(x)
        if zero_tail:
            self.zero_tails(views, T)

    def zero_tails(self, views: list[Any], T: int) -> None:
        """Zero the rows past ``T`` of the bucket's padded ``views``."""
        for s in self.padded:
            view = views[s.index]
            n = view.shape[s.pad_dim]
            if T < n:
                view.narrow(s.pad_dim, T, n - T).zero_()


class HandedInputs:
    """The inputs :meth:`bcg.GraphRunner.input_buffers` handed out, by ``T``: a call on them is
    recognized by identity (neither checked nor copied).

    Arguments:
        first_padded: the position of the first padded input.
    """

    KEPT = 256  # distinct T whose inputs are kept

    def __init__(self, first_padded: int) -> None:
        self._first = first_padded
        self._by_rows: dict[int, tuple[Any, ...]] = {}
        # id(first padded view) -> (T, bucket, inputs); the inputs are held, so the id stays unique
        self._by_id: dict[int, tuple[int, int, tuple[Any, ...]]] = {}

    @property
    def first(self) -> int:
        return self._first

    @property
    def by_id(self) -> dict[int, tuple[int, int, tuple[Any, ...]]]:
        """``id(first padded input) -> (T, bucket, inputs)``: the one table (cleared in place, never
        replaced) that the native call (:mod:`bcg.runner.native_call`) looks calls up in."""
        return self._by_id

    def get(self, T: int) -> tuple[Any, ...] | None:
        return self._by_rows.get(T)

    def add(self, T: int, bucket: int, inputs: tuple[Any, ...]) -> tuple[Any, ...]:
        """Keep ``inputs`` (bucket ``bucket``'s, for ``T`` rows) and return them."""
        if len(self._by_rows) >= self.KEPT:
            self._by_rows.clear()
            self._by_id.clear()
        self._by_rows[T] = inputs
        self._by_id[id(inputs[self._first])] = (T, bucket, inputs)
        return inputs

    def owns(self, inputs: tuple[Any, ...]) -> bool:
        """Whether the call's first padded input is one handed out."""
        return len(inputs) > self._first and id(inputs[self._first]) in self._by_id

    def recognize(self, inputs: tuple[Any, ...]) -> tuple[int, int] | None:
        """``(T, bucket)`` when the call's inputs are exactly ones handed out, else None."""
        found = self._by_id.get(id(inputs[self._first])) if len(inputs) > self._first else None
        if found is None or len(inputs) != len(found[2]) or not all(map(operator.is_, inputs, found[2])):
            return None
        return found[0], found[1]
