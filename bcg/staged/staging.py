"""Staged breakpoints: live metadata written into static device buffers, the breakpoint captured inline.

A breakpoint declared with ``@bcg.breakpoint(prepare=..., fits=...)`` is
*staged*. The contract:

* ``fits(live) -> bool`` says whether this replay's live metadata is within the
  static bounds the graph was captured with: the number of request slots, an
  upper bound on ``max_seqlen``, a split count. What must be bounded is
  whatever decides a launch configuration (grid sizes, loop counts, kernel choice).
  A ``fits`` that takes a second argument is given what ``prepare`` returned at
  the form's capture (``fits(live, staged)``): the bounds can then differ from
  one form to another, e.g. the staged tiers of a :class:`bcg.GraphRunner`
  bucket (:class:`StagedTiers`), each captured for fewer request slots.
* ``prepare(live)`` writes the metadata that may vary at every replay
  (``cu_seqlens``, ``seqused``, page tables: anything a kernel reads from device
  memory) into :class:`StagingBuffer` s, on the host only, and returns the
  object :func:`bcg.live` returns inside the breakpoint when it runs *inline*:
  the buffers' device tensors and the static bounds (say, ``max_seqlen`` = the
  bucket size). It must not launch work or synchronize.
* At capture, bcg calls ``prepare`` with the capture's live metadata, captures
  the copies of the buffers it wrote into the segment (a staging kernel whose
  parameters carry a small buffer's value, or a copy from pinned host memory),
  and runs the breakpoint's function inline: its kernels are recorded in the
  segment, reading the device buffers. What ``prepare`` returned at capture is
  frozen into the graph.
* At replay, bcg asks ``fits(live)``; if every staged breakpoint fits, it
  calls each distinct ``prepare`` once (breakpoints sharing one ``prepare``
  function share its buffers: stage once per forward, not per layer) and
  launches the graph, which carries the buffers in (``make_graph`` and the
  runner launch the work before the first staged copy first, see
  :meth:`bcg.core.session.CaptureSession.staging_point`). Otherwise it replays the graph's
  breakable form, where the function runs eagerly and ``bcg.live()`` is the
  real metadata; so the function must accept both.
* Outside bcg (plain eager calls) the function runs with the real metadata;
  ``prepare`` and ``fits`` are not called.

A small buffer's value travels in a kernel's parameters, which each replay
sets before its launch and a queued launch keeps (:mod:`bcg.staged.kernel`).
A large buffer's captured copy records an event after it, and
:meth:`StagingBuffer.write` first waits until the previous replay's copy has
run. Either way a replay queued behind others never reads a value meant for a
later one. One replay at a time per buffer, from one thread (as
:class:`bcg.GraphRunner` serializes its calls).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import math
import struct
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from bcg.core import cudart
from bcg.core.args import check_int, fail, is_int
from bcg.core.breakpoint import NOT_INLINE, BreakpointSpec, Recorder, live
from bcg.errors import CaptureError
from bcg.staged.kernel import StageLaunch, param_bytes, stage_kernel, words_of

log = logging.getLogger("bcg")

# struct codes (standard sizes) of the dtypes a StagingBuffer holds
_STRUCT_CODES = {
    torch.bool: "?", torch.int8: "b", torch.uint8: "B", torch.int16: "h", torch.uint16: "H",
    torch.int32: "i", torch.uint32: "I", torch.int64: "q", torch.uint64: "Q",
    torch.float16: "e", torch.float32: "f", torch.float64: "d",
}

# The buffers written since the innermost ``collecting()`` began (None: nobody collects).
_WRITTEN: contextvars.ContextVar[list[StagingBuffer] | None] = contextvars.ContextVar("bcg_staged", default=None)


class StagingBuffer:
    """A static device tensor whose value is written on the host at every replay.

    Arguments:
        shape: the buffer's shape, an int or a tuple of ints >= 0 (fixed: the
            static bound, e.g. request slots + 1).
        dtype: its dtype: a ``torch`` integer, bool or float16/32/64 dtype.
        device: the device tensor's device: a ``torch.device``, a str or a CUDA
            device index (default: the current CUDA device, or the CPU when CUDA
            is unavailable, where no copy is pinned).

    A wrong argument raises ``TypeError`` (a wrong type, a dtype it cannot
    hold) or ``ValueError`` (a negative size, a device torch does not know).

    ``device`` is the tensor kernels read (its address never changes); ``host``
    is the host memory that :meth:`write` fills. Integer, bool and
    float16/32/64 dtypes (the host side is written with one precompiled
    ``struct`` pack: values must be numbers of the dtype's kind, in range).

    A CUDA buffer of at most 8,184 bytes (4,088 with a driver or NVRTC older than CUDA
    12.1: ``bcg.staged.kernel.param_bytes()``) reaches
    the device in a kernel's parameters (:attr:`in_parameters`): every replay sets
    them to the host value after ``prepare``, launches already queued keep theirs,
    and :meth:`write` never waits for the GPU. A larger one (or where the kernel
    cannot be built) is a captured copy from pinned host memory, and :meth:`write`
    first waits until the previous replay's copy ran.

    .. warning::
        Write it only from a ``prepare`` function: bcg uploads what ``prepare``
        wrote (captured in the graph, or eagerly in eager runs).

    .. warning::
        Create it before capturing: created inside a capture it raises
        :class:`bcg.CaptureError`.
    """

    def __init__(self, shape: int | Sequence[int], dtype: torch.dtype = torch.int32, device: Any = None) -> None:
        device = _check_arguments(shape, dtype, device)
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        device = torch.device(device)
        numel = math.prod(shape) if isinstance(shape, (tuple, list, torch.Size)) else int(shape)
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        cuda = device.type == "cuda"
        if cuda and torch.cuda.is_current_stream_capturing():
            # (its memory would come from the graph's pool and go with the graph, and building the
            # staging kernel loads a module, which a capture may not see)
            raise CaptureError("bcg.StagingBuffer was created inside a CUDA graph capture: create staging "
                               "buffers before capturing (e.g. where the staged breakpoint is made), so that "
                               "they outlive the graphs that read them")
        words = words_of(nbytes)
        function = None
        if cuda and 0 < nbytes <= param_bytes():
            function = stage_kernel(device.index if device.index is not None else torch.cuda.current_device(), words)
        self._stage: StageLaunch | None = None
        if function is not None:
            # the value travels in the staging kernel's parameters (bcg.staged.kernel): both sides
            # hold whole 8-byte words, and the host side needs no pinning
            device_words = torch.zeros(words * 8, dtype=torch.uint8, device=device)
            host_words = torch.zeros(words * 8, dtype=torch.uint8)
            self._device_tensor = device_words[:nbytes].view(dtype).view(shape)
            self.host = host_words[:nbytes].view(dtype).view(shape)
            self._stage = StageLaunch(function, words, device_words.data_ptr(), host_words.data_ptr())
        else:
            self._device_tensor = torch.zeros(shape, dtype=dtype, device=device)
            self.host = torch.zeros(shape, dtype=dtype, pin_memory=cuda)
        self._numel = self.host.numel()
        # One C call writes every value (a NumPy slice assignment runs its array
        # coercion, several times the host code, at every replay).
        self._pack = struct.Struct(f"={self._numel}{_STRUCT_CODES[dtype]}").pack_into
        self._host_buffer = self.host.numpy().reshape(-1)
        # Recorded after each copy of the host value (an eager upload, or a captured copy at every
        # replay): write() waits for it, so a value is never overwritten before it was copied. (A
        # value carried in the kernel's parameters is copied by CUDA when it is set: no event.)
        self._read: torch.cuda.Event | None = torch.cuda.Event(external=True) if cuda and self._stage is None else None
        self._read_pending = False  # an eager upload recorded _read and write() has not seen it done
        self._read_in_graph = False  # a captured copy records _read at every replay

    @property
    def device(self) -> torch.Tensor:
        """The device tensor the captured kernels read."""
        return self._device_tensor

    @property
    def in_parameters(self) -> bool:
        """Whether the value reaches the device in a kernel's parameters (a CUDA buffer of at most
        ``bcg.staged.kernel.param_bytes()`` bytes where the staging kernel builds), rather than by a
        captured copy from pinned memory."""
        return self._stage is not None

    @property
    def stage(self) -> StageLaunch | None:
        """The staging kernel's launch (None: the value is copied): the replay sets its node."""
        return self._stage

    def write(self, values: Sequence[Any] | torch.Tensor | np.ndarray) -> None:
        """Write ``values`` (as many numbers as the buffer holds: host numbers, a CPU tensor or a
        NumPy array) into the host copy (for a copied buffer, once the previous value was copied
        to the device). An array or CPU tensor of the buffer's dtype is copied in one memcpy (the fast route for
        large metadata, such as block tables); numbers, and arrays of another dtype, are packed
        and range-checked."""
        written = _WRITTEN.get()  # set while bcg records (a capture, an eager run); None at replay
        if (self._read_pending or self._read_in_graph) and (
                written is None or not torch.cuda.is_current_stream_capturing()):
            # The GPU has copied the previous value in. (A capture starts with a device
            # synchronize, so nothing is queued then, and waiting is not allowed.) Replays
            # skip the capture query: nothing records then. (A query first: synchronize
            # releases the GIL even when there is nothing to wait for.)
            assert self._read is not None
            if not self._read.query():
                self._read.synchronize()
            self._read_pending = False
        if isinstance(values, torch.Tensor):
            if values.device.type != "cpu":
                raise TypeError(
                    f"StagingBuffer.write takes host values or a CPU tensor, not a {values.device} tensor "
                    "(reading it would wait on the GPU)"
                )
            values = values.detach().numpy()
        if isinstance(values, np.ndarray) and values.dtype == self._host_buffer.dtype and values.size == self._numel:
            np.copyto(self._host_buffer, values.reshape(-1))  # one memcpy, whatever the size
        else:
            if isinstance(values, np.ndarray):
                values = values.reshape(-1).tolist()  # another dtype: packed, so values are range-checked
            if len(values) != self._numel:
                raise ValueError(
                    f"StagingBuffer.write got {len(values)} values for a buffer of {self._numel}: "
                    "write every element (fill unused slots with sentinels)"
                )
            try:
                self._pack(self._host_buffer, 0, *values)
            except struct.error as exc:
                raise TypeError(
                    f"StagingBuffer.write: {exc}: write {self.host.dtype} values (numbers of its kind, in its range)"
                ) from exc
        if written is not None and self not in written:
            written.append(self)

    def upload(self) -> Any:
        """Copy the host value to the device on the current stream (captured when capturing:
        then every replay copies the value the host wrote last). Returns the captured staging
        kernel's node when the value travels in its parameters and the stream captures (the
        replay sets its parameters before each launch), else None."""
        if self._stage is not None:
            device = self._device_tensor.device
            stream = torch.cuda.current_stream(device).cuda_stream
            if device.index != torch.cuda.current_device():  # (the launch runs in the current device's context)
                with torch.cuda.device(device):
                    self._stage.launch(stream)
                return None  # (a capture runs on the current device: an upload to another is not captured)
            self._stage.launch(stream)
            return self._stage.captured_node(stream) if torch.cuda.is_current_stream_capturing() else None
        if self._read is None:
            self._device_tensor.copy_(self.host)
            return None
        stream = torch.cuda.current_stream(self._device_tensor.device)
        if not torch.cuda.is_current_stream_capturing():
            self._device_tensor.copy_(self.host, non_blocking=True)
            self._read.record(stream)
            self._read_pending = True
            return None
        nbytes = self.host.numel() * self.host.element_size()
        cudart.copy_host_to_device(self._device_tensor.data_ptr(), self.host.data_ptr(), nbytes, stream.cuda_stream)
        self._read.record(stream)
        self._read_in_graph = True
        return None


def _check_arguments(shape: Any, dtype: Any, device: Any) -> torch.device | None:
    """``StagingBuffer``'s arguments, checked; returns ``device`` as a ``torch.device`` (None: the default)."""
    where = "bcg.StagingBuffer"
    if not is_int(shape):
        if not isinstance(shape, (tuple, list, torch.Size)):
            fail(where, "shape", "an int or a tuple of ints", shape, "e.g. StagingBuffer(slots + 1) or (rows, cols)")
        for i, size in enumerate(shape):
            check_int(where, f"shape[{i}]", size, minimum=0)
    else:
        check_int(where, "shape", shape, minimum=0)
    if not isinstance(dtype, torch.dtype) or dtype not in _STRUCT_CODES:
        hint = f"pass torch.{dtype}" if isinstance(dtype, str) and hasattr(torch, dtype) else ""
        fail(where, "dtype", "a torch dtype of integer, bool or float16/32/64 metadata (e.g. torch.int32)", dtype,
             hint)
    if device is None:
        return None
    if not isinstance(device, (str, torch.device)) and not is_int(device):
        fail(where, "device", "None, a torch.device, a str such as 'cuda:0', or a CUDA device index", device)
    hint = "CUDA is not available here: omit device= (without CUDA the buffer lives on the CPU)"
    try:
        resolved = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        fail(where, "device", "None, a torch.device, a str such as 'cuda:0', or a CUDA device index", device,
             hint if is_int(device) and not torch.cuda.is_available() else "", error=ValueError)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        fail(where, "device", "a device this machine has", device, hint, error=ValueError)
    return resolved


@contextlib.contextmanager
def collecting() -> Iterator[list[StagingBuffer]]:
    """Collect the buffers written inside the block (in the order first written)."""
    written: list[StagingBuffer] = []
    token = _WRITTEN.set(written)
    try:
        yield written
    finally:
        _WRITTEN.reset(token)


def stage(spec: BreakpointSpec, live: Any) -> tuple[Any, list[StagingBuffer]]:
    """``spec.prepare(live)`` and the buffers it wrote."""
    assert spec.prepare is not None
    with collecting() as written:
        staged = spec.prepare(live)
    return staged, written


class StagedBreakpoints:
    """The staged breakpoints of one recording: what a replay asks and prepares before launching.

    Each distinct ``fits`` is asked (a two-argument one once per staged value
    it checks against), and each distinct ``prepare`` run, once per replay, in
    the order the recording first met them. Functions are told apart by
    ``==``, so ``obj.prepare`` (a new bound-method object at each access)
    counts once.
    """

    def __init__(self) -> None:
        # each distinct check: (spec, its staged value, the reason a misfit gives; made once, not per replay)
        self._fits: list[tuple[BreakpointSpec, Any, str]] = []
        self._prepares: list[Any] = []
        self._values: list[Any] = []  # what each prepare returned when recorded
        self.names: list[str] = []  # the staged breakpoints recorded inline, each name once
        self.misfits: list[str] = []  # those recorded as breakpoints: their metadata did not fit
        self._buffers: dict[StagingBuffer, str] = {}  # each buffer uploaded -> the breakpoint whose prepare wrote it

    def _index(self, spec: BreakpointSpec) -> int | None:
        return next((i for i, p in enumerate(self._prepares) if p == spec.prepare), None)

    def value(self, spec: BreakpointSpec) -> Any:
        """What ``spec``'s ``prepare`` returned when recorded (``KeyError``: not recorded inline)."""
        i = self._index(spec)
        if i is None or spec.name not in self.names:
            raise KeyError(spec.name)
        return self._values[i]

    def __bool__(self) -> bool:
        return bool(self._prepares)

    @property
    def copies(self) -> int:
        """The buffer copies recorded so far (each staged buffer's once)."""
        return len(self._buffers)

    def misfit(self, live: Any) -> str | None:
        """``None`` when every staged breakpoint fits ``live``, else the reason (``"<name> does not fit"``)."""
        for spec, staged, reason in self._fits:
            assert spec.fits is not None
            if not (spec.fits(live, staged) if spec.fits_reads_staged else spec.fits(live)):
                return reason
        return None

    def checks(self) -> tuple[tuple[Any, Any, bool, str], ...]:
        """What :meth:`misfit` asks, in order, for the native replay: ``(fits, staged,
        reads_staged, reason)``, ``fits(live, staged)`` when ``reads_staged``, else ``fits(live)``."""
        return tuple((spec.fits, staged, spec.fits_reads_staged, reason) for spec, staged, reason in self._fits)

    def prepares(self) -> tuple[Any, ...]:
        """What :meth:`prepare` runs, in order (each ``prepare(live)``)."""
        return tuple(self._prepares)

    def prepare(self, live: Any) -> None:
        """Run every ``prepare`` once: host writes, which the graph's captured copies read."""
        for prepare in self._prepares:
            prepare(live)

    def prepare_and_upload(self, live: Any) -> None:
        """Run every ``prepare``, then copy what it wrote to the device now (eager runs)."""
        with collecting() as written:
            self.prepare(live)
        for buf in written:
            buf.upload()

    def record(self, recorder: Recorder, spec: BreakpointSpec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run staged breakpoint ``spec`` inline as ``recorder``'s breakpoint code; return its result.

        The first time a ``prepare`` is met it runs with the recording's live
        metadata and its buffers are uploaded (captured into the segment when
        capturing); its return value, frozen from then on, is what
        ``bcg.live()`` returns inside ``spec``. Returns :data:`NOT_INLINE`, and
        uploads nothing, when that metadata does not ``fit`` (logged once per name):
        the caller records ``spec`` as a breakpoint instead. A two-argument ``fits``
        is asked after ``prepare`` ran (its bounds are what ``prepare`` returns);
        a ``prepare`` that raises then counts as not fitting.
        """
        assert spec.fits is not None and spec.prepare is not None
        value = live(static_ok=True)
        i = self._index(spec)
        staged, written = (self._values[i], []) if i is not None else (None, None)
        if spec.fits_reads_staged:
            fits = True
            if i is None:  # its bounds are what prepare returns: stage first (uploaded only if it fits)
                try:
                    staged, written = recorder.run_breakpoint(stage, (spec, value), {})
                except Exception as exc:  # a prepare that refuses metadata past its bounds
                    log.debug("bcg: staged breakpoint %r: prepare raised %r: taken as not fitting", spec.name, exc)
                    fits = False
            fits = fits and spec.fits(value, staged)
        else:
            fits = spec.fits(value)
        if not fits:
            if spec.name not in self.misfits:
                self.misfits.append(spec.name)
                log.warning(
                    "bcg: staged breakpoint %r is recorded as a breakpoint (breakable form): the recording's "
                    "live metadata does not fit its static bounds (fits() returned False). Record with "
                    "metadata that fits, e.g. the bucket's own, to get it inline", spec.name,
                )
            return NOT_INLINE
        if spec.name not in self.names:
            self.names.append(spec.name)
        if i is None:
            if written is None:
                staged, written = recorder.run_breakpoint(stage, (spec, value), {})
            self._upload_written(recorder, spec, written)
            self._prepares.append(spec.prepare)
            self._values.append(staged)
        if not any(s.fits == spec.fits and (not s.fits_reads_staged or v is staged) for s, v, _ in self._fits):
            self._fits.append((spec, staged, f"{spec.name} does not fit"))
        return recorder.run_breakpoint(spec.fn, args, kwargs, live=staged)

    def _upload_written(self, recorder: Recorder, spec: BreakpointSpec, written: list[StagingBuffer]) -> None:
        """Upload the buffers ``spec``'s ``prepare`` wrote (captured, when capturing: the graph
        copies the host values in at every replay). The recording's first copy is announced to
        ``recorder`` first (:meth:`Recorder.staging_point`)."""
        if written and not self._buffers:
            recorder.staging_point()
        for buf in written:
            other = self._buffers.get(buf)
            if other is not None:
                raise CaptureError(
                    f"staged breakpoints {other!r} and {spec.name!r} have different prepare functions that "
                    "write one StagingBuffer: a replay runs both before the graph copies it, so the kernels "
                    "of the first would read the second's value. Share one prepare function (the same "
                    "object), or give each its own buffer"
                )
            self._buffers[buf] = spec.name
            node = buf.upload()
            if node is not None:
                recorder.staged_node(node, buf)


class StagedTiers(tuple):  # type: ignore[type-arg]
    """Capture-time live metadata for the staged tiers of each :class:`bcg.GraphRunner` bucket.

    Return one from the runner's ``live`` (``StagedTiers(live_a, live_b, live)``,
    smallest bounds first): the runner captures each bucket's graph, and its
    breakable form, with the last value as usual, and one more inline form
    (a *tier*) per earlier value, tried first (see :meth:`bcg.BreakableGraph.choose`).
    A tier's staged breakpoints are bounded by what their ``prepare`` returned
    for its value, which their ``fits(live, staged)`` reads: say, fewer request
    slots, so that a small batch does not pay for empty ones. Each tier ends by
    copying its outputs into the bucket's (in the graph; not those that its
    capture placed there already), so calls return the same tensors whichever
    form ran. A tier that does not replay faster than the form after it in every
    round timed at capture (on its value) is dropped.

    Arguments:
        lives: the tiers' values, then the bucket's own (last).
        breakable: capture the breakable form too (default). ``False``: not, where every call's
            metadata fits a staged form (the last bound covers every call): one capture less per
            bucket, and a call that fits none runs eagerly (fallback ``"staged_unfit"``). With
            ``ranks=`` the breakable form is always captured (ranks agree on the form they run).

    .. warning::
        Each tier costs one more capture and executable per bucket (its
        temporaries share the pool), and its timing: a few replays of the
        forward on its value, with the forward's side effects.
    """

    breakable: bool

    def __new__(cls, *lives: Any, breakable: bool = True) -> StagedTiers:
        if not lives:
            raise ValueError("StagedTiers needs at least one live value (the bucket's own, last)")
        tiers = super().__new__(cls, lives)
        tiers.breakable = bool(breakable)
        return tiers

    def __getnewargs_ex__(self) -> tuple[tuple[Any, ...], dict[str, Any]]:
        # copy and pickle: the values (not one tuple of them) and the flag
        return tuple(self), {"breakable": self.breakable}


class StagedWarmup(Recorder):
    """The active recorder of a warm-up before a capture: breakpoints are plain calls, staged
    ones run inline (eagerly, with their buffers uploaded), as the capture will record them."""

    segment_label = "a warm-up run"

    def __init__(self) -> None:
        super().__init__()
        self.staged_breakpoints = StagedBreakpoints()

    def on_breakpoint(self, spec: BreakpointSpec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return self.run_breakpoint(spec.fn, args, kwargs)

    def on_staged(self, spec: BreakpointSpec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        result = self.staged_breakpoints.record(self, spec, args, kwargs)
        return self.on_breakpoint(spec, args, kwargs) if result is NOT_INLINE else result
