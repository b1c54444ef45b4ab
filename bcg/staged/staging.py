"""Staged breakpoints: live metadata staged in static device buffers, the breakpoint captured inline.

A breakpoint declared with ``@bcg.breakpoint(prepare=..., fits=...)`` is
*staged*. The contract:

* ``fits(live) -> bool`` says whether this replay's live metadata is within the
  static bounds the graph was captured with: the number of request slots, an
  upper bound on ``max_seqlen``, a split count. What must be bounded is
  whatever decides a launch configuration (grid sizes, loop counts, kernel choice).
  A ``fits`` that takes a second argument is given what ``prepare`` returned at
  the graph's capture (``fits(live, staged)``): the bounds can then differ from
  one capture to another, e.g. the staged tiers of a :class:`bcg.GraphRunner`
  bucket (:class:`bcg.StagedTiers`), each captured for fewer request slots.
* ``prepare(live)`` writes the metadata that may vary at every replay
  (``cu_seqlens``, ``seqused``, page tables: anything a kernel reads from device
  memory) into :class:`StagingBuffer` s, on the host only, and returns the
  object :func:`bcg.live` returns inside the breakpoint when it runs *inline*:
  the buffers' device tensors and the static bounds (say, ``max_seqlen`` = the
  bucket size). It must not launch work or synchronize.
* At capture, bcg calls ``prepare`` with the capture's live metadata, captures
  the copies of the buffers it wrote (pinned host to device) into the segment,
  and runs the breakpoint's function inline: its kernels are recorded in the
  segment, reading the device buffers. What ``prepare`` returned at capture is
  frozen into the graph.
* At replay, bcg asks ``fits(live)``; if every staged breakpoint fits, it calls
  each distinct ``prepare`` once (breakpoints sharing one ``prepare`` function
  share its buffers: stage once per forward, not per layer) and launches the
  graph, which copies the buffers in. Otherwise it replays the graph's
  breakable form, where the function runs eagerly and ``bcg.live()`` is the
  real metadata; so the function must accept both.
* Outside bcg (plain eager calls) the function runs with the real metadata;
  ``prepare`` and ``fits`` are not called.

Each copy of a buffer a ``prepare`` wrote is captured behind a *gate*, a
pinned flag of the buffer: one kernel (:mod:`bcg.staged.gate`; over 64 KiB, a copy
node between two) waits until the flag says the value is written, copies it,
and clears the flag. A replay sets the flags once ``prepare`` has
written. :meth:`StagingBuffer.write` first waits until the previous replay's
copy has cleared its flag, so a replay queued behind others never reads a
value meant for a later one; the host blocks only when the queue is so deep
that the previous replay's copy has not run yet. (Where the kernel cannot be
built, the gate is stream memory operations, ``cuStreamWaitValue32`` and
``cuStreamWriteValue32``, around a plain copy, and without
``prepare_after_launch`` the copy is not gated: ``write`` waits for an event
recorded after it.)

``@bcg.breakpoint(..., prepare_after_launch=True)`` takes ``prepare`` off the
host's path before the launch. A replay of a graph whose staged breakpoints all
ask for it, and whose plan is segments only (no breakpoint steps), launches
first (unless its recent launches were late: below) and runs ``prepare`` while
the GPU runs the work before the first copy
(in a model: the first layer's work before attention); then bcg sets the
flags. Other replays run ``prepare`` first and set the flags before the
launch. Constraints:

* ``prepare`` must never wait on the GPU (``.item()``, ``.cpu()``, a
  synchronize): the graph it would wait for is waiting for ``prepare``; a hang.
  (The capture runs ``prepare`` while capturing, where such calls fail.)
* A ``prepare`` that raises after the launch leaves the launched replay to run
  with the values staged at capture (restored, so that its kernels read
  metadata within their bounds); the exception says so. Its outputs, and
  anything else the graph writes (a KV cache), are then not this call's.
* One replay at a time per buffer, from one thread (as :class:`bcg.GraphRunner`
  serializes its calls): before its launch a replay waits until the previous
  one's copy has taken the value it was released for.
* The flags are plain stores, ordered after the values' on x86 (TSO); on
  other hosts bcg runs ``prepare`` before the launch.

Launching first pays only while the launch returns before the GPU reaches the
first gate. A launch's host time grows with the graph's work (on an H200, an
8B forward's took 10, 60 and 290 us at 128, 512 and 2048 tokens), so the GPU
can get there first and wait for the rest of the launch and ``prepare``, where
running ``prepare`` first would have cost it only ``prepare``. Each gated copy
therefore also says when the GPU reached it (a pinned *arrival* flag, written
just before the gate's wait). A replay whose launch returns with an arrival
already set is *late*; after ``LATE_STREAK`` late replays in a row, the graph
runs ``prepare`` first for the next ``PREPARE_FIRST_REPLAYS`` replays, then
tries launching first again. ``GraphStats.launched_first`` and
``late_launches`` count them.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import platform
import struct
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from bcg.core import cudart
from bcg.staged import gate
from bcg.core.cudart import stream_readers
from bcg.core.breakpoint import BreakpointSpec, Recorder, live
from bcg.errors import CaptureError, ReplayError, add_note

log = logging.getLogger("bcg")

# struct codes (standard sizes) of the dtypes a StagingBuffer holds
_STRUCT_CODES = {
    torch.bool: "?", torch.int8: "b", torch.uint8: "B", torch.int16: "h", torch.uint16: "H",
    torch.int32: "i", torch.uint32: "I", torch.int64: "q", torch.uint64: "Q",
    torch.float16: "e", torch.float32: "f", torch.float64: "d",
}


# Hosts whose stores become visible in program order (TSO), where a flag set after the values
# never reaches the GPU before them: only there does a replay launch before its prepare.
_ORDERED_STORES = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")

# The buffers written since the innermost ``collecting()`` began (None: nobody collects).
_WRITTEN: contextvars.ContextVar[list[StagingBuffer] | None] = contextvars.ContextVar("bcg_staged", default=None)

#: Late launch-first replays in a row (the GPU at a gate before the launch returned) after which
#: a graph runs ``prepare`` before its launch ...
LATE_STREAK = 3
#: ... for this many replays, then tries launching first again (the host's speed changes).
PREPARE_FIRST_REPLAYS = 256


class StagingBuffer:
    """A static device tensor whose value is written on the host at every replay.

    Arguments:
        shape: the buffer's shape (fixed: the static bound, e.g. request slots + 1).
        dtype: its dtype.
        device: the device tensor's device (default: the current CUDA device, or
            the CPU when CUDA is unavailable, where no copy is pinned).

    ``device`` is the tensor kernels read (its address never changes); ``host``
    is pinned host memory that :meth:`write` fills. Integer, bool and
    float16/32/64 dtypes (the host side is written with one precompiled
    ``struct`` pack: values must be numbers of the dtype's kind, in range).

    .. warning::
        Write it only from a ``prepare`` function: bcg uploads what ``prepare``
        wrote (captured in the graph, or eagerly in eager runs).
    """

    def __init__(self, shape: int | Sequence[int], dtype: torch.dtype = torch.int32, device: Any = None) -> None:
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        if dtype not in _STRUCT_CODES:
            raise TypeError(f"StagingBuffer holds integer, bool or float16/32/64 metadata, not {dtype}")
        self._device_tensor = torch.zeros(shape, dtype=dtype, device=device)
        cuda = self._device_tensor.device.type == "cuda"
        self.host = torch.zeros(shape, dtype=dtype, pin_memory=cuda)
        self._numel = self.host.numel()
        # One C call writes every value (a NumPy slice assignment runs its array
        # coercion, several times the host code, at every replay).
        self._pack = struct.Struct(f"={self._numel}{_STRUCT_CODES[dtype]}").pack_into
        self._host_buffer = self.host.numpy().reshape(-1)
        # Recorded after each copy that is not gated (eager uploads; captured ones where the gated
        # copy cannot be): write() waits for it while one may be queued.
        self._read: torch.cuda.Event | None = torch.cuda.Event(external=True) if cuda else None
        self._read_pending = False  # an eager upload recorded _read and write() has not seen it done
        self._read_in_graph = False  # a captured copy records _read at every replay
        # The gate of the copies captured behind one: pinned int32 flags, [0] 1 from _release()
        # until a queued gated copy has read the value (the GPU writes 0), [1] the arrival: the
        # GPU writes 1 when it reaches the gate, the host clears it before a launch-first replay.
        # Allocated here (pinning memory during a capture is not allowed), as is the kernel.
        self._gate: torch.Tensor | None = torch.zeros(2, dtype=torch.int32, pin_memory=True) if cuda else None
        self._gate_flag: Any = None  # its NumPy view, once a copy is captured behind it
        self._gate_address = 0  # its device address (the captured wait and writes; the arrival 4 bytes on)
        self._gate_stream = 0  # the stream of the copy the open gate is for (raw handle)
        # the gated-copy kernel (bcg.staged.gate; None where it cannot be built: stream memory operations)
        self._gated_copy: Any = gate.kernel(self._device_tensor.device.index) if cuda else None

    @property
    def device(self) -> torch.Tensor:
        """The device tensor the captured kernels read."""
        return self._device_tensor

    def write(self, values: Sequence[Any] | torch.Tensor) -> None:
        """Write ``values`` (as many numbers as the buffer holds: host numbers, or a CPU tensor)
        into the pinned host copy."""
        written = _WRITTEN.get()  # set while bcg records (a capture, an eager run); None at replay
        if self.gate_open:
            self._wait_for_gate()  # a queued gated copy has not read the value released for it
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
                    f"StagingBuffer.write takes host values or a CPU tensor, not a {values.device} tensor: "
                    "reading it waits on the GPU (a hang with prepare_after_launch=True)"
                )
            values = values.reshape(-1).tolist()
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

    @property
    def gate_open(self) -> bool:
        """Whether a value is released to a replay's gated copy that has not read it yet
        (always False for a buffer whose copies are not gated)."""
        return bool(self._gate_flag is not None and self._gate_flag[0])

    def upload(self) -> None:
        """Copy the host value to the device on the current stream (captured when capturing)."""
        self._copy(gated=False)

    def _stage_copy(self, after_launch: bool) -> bool:
        """The copy of a staged breakpoint's ``prepare`` (see :class:`Stager`): behind the gate
        where the gated-copy kernel is built, or ``after_launch`` asks for it (when capturing).
        Returns whether it was captured behind the gate."""
        return self._copy(gated=after_launch or self._gated_copy is not None)

    def _copy(self, gated: bool) -> bool:
        """Copy the host value to the device on the current stream: when capturing, ``gated``
        behind the buffer's gate, which the copy waits for and then closes (the gated-copy
        kernel, else stream memory operations). Returns whether the copy was captured behind it."""
        if self._read is None:
            self._device_tensor.copy_(self.host)
            return False
        stream = torch.cuda.current_stream(self._device_tensor.device)
        if not torch.cuda.is_current_stream_capturing():
            self._device_tensor.copy_(self.host, non_blocking=True)
            self._read.record(stream)
            self._read_pending = True
            return False
        handle = stream.cuda_stream
        nbytes = self.host.numel() * self.host.element_size()
        if not gated:
            cudart.copy_host_to_device(self._device_tensor.data_ptr(), self.host.data_ptr(), nbytes, handle)
            self._read.record(stream)
            self._read_in_graph = True
            return False
        # No event behind a gate: a write made after the launch would wait on this replay's.
        if self._gate_flag is None:
            assert self._gate is not None
            self._gate_address = cudart.host_device_pointer(self._gate.data_ptr())
            self._gate_flag = self._gate.numpy()
        if self._gated_copy is not None:
            gate.capture(self._gated_copy, handle, self._gate_address, self.host.data_ptr(),
                         cudart.host_device_pointer(self.host.data_ptr()), self._device_tensor.data_ptr(), nbytes)
            return True
        if _ORDERED_STORES:  # where replays may launch first: the arrival (see Stager.prepare_launched)
            cudart.write_value32(handle, self._gate_address + 4, 1)
        cudart.wait_value32(handle, self._gate_address, 1)
        cudart.copy_host_to_device(self._device_tensor.data_ptr(), self.host.data_ptr(), nbytes, handle)
        cudart.write_value32(handle, self._gate_address, 0)
        return True

    def _release(self, stream: int) -> None:
        """Open the gate for the next gated copy to run (queued on raw ``stream``)."""
        self._gate_stream = stream
        self._gate_flag[0] = 1

    def _wait_for_gate(self) -> None:
        """Wait until the gated copy the open gate was released for has read the value.

        Raises :class:`bcg.ReplayError` when the copy's stream is idle and the gate
        still open (no queued copy will read it), and the stream's CUDA error if it has one.
        """
        flag = self._gate_flag
        spins = 0
        while flag[0]:
            spins += 1
            if spins > 2000:  # a deep queue: let other threads run
                time.sleep(2e-5)
                if spins % 5000 == 0 and cudart.stream_idle(self._gate_stream) and flag[0]:
                    raise ReplayError(
                        "a StagingBuffer's gate is open but no queued copy will read it (its stream is "
                        "idle): a replay of a gated graph failed in a way bcg could not settle. Capture "
                        "the graph again (or reset the runner)"
                    )

    def _arrived(self) -> bool:
        """Whether the GPU reached a gated copy of this buffer since :meth:`_clear_arrival`."""
        return bool(self._gate_flag[1])

    def _clear_arrival(self) -> None:
        self._gate_flag[1] = 0

    def _close_gate(self) -> None:
        """Clear a gate no queued copy will read (after a failure, with the stream drained)."""
        if self._gate_flag is not None:
            self._gate_flag[0] = 0


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


class Stager:
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
        self._after_launch: list[bool] = []  # each prepare's prepare_after_launch
        self._buffers: dict[StagingBuffer, str] = {}  # each buffer uploaded -> the breakpoint whose prepare wrote it
        self._gated: list[StagingBuffer] = []  # the buffers whose copies were captured behind their gate
        self._capture_values: list[torch.Tensor] = []  # their host values at capture (bounds that fit)
        self._armed: list[StagingBuffer] = []  # gated copies of the capture's open segment, not yet run
        self._prepare_first = False  # a prepare that runs before the launch (not asked after it, or copies not gated)
        self._late_streak = 0  # late launch-first replays in a row (see LATE_STREAK)
        self._prepare_first_left = 0  # replays left that run prepare first after a late streak
        self.launched_first = 0  # replays that launched before prepare
        self.late_launches = 0  # of those, the ones whose launch returned with the GPU at a gate
        self._switches = 0  # late streaks so far (the first is logged at INFO, later ones at DEBUG)
        self._device = 0  # the gated buffers' device
        self._current_stream = stream_readers()[1]  # its current raw stream, cheaply

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
        """The buffer copies recorded so far (each staged buffer's once): a block that records
        one must run at every replay (see :meth:`bcg.capture.switchable`)."""
        return len(self._buffers)

    def misfit(self, live: Any) -> str | None:
        """``None`` when every staged breakpoint fits ``live``, else the reason (``"<name> does not fit"``)."""
        for spec, staged, reason in self._fits:
            assert spec.fits is not None
            if not (spec.fits(live, staged) if spec.fits_reads_staged else spec.fits(live)):
                return reason
        return None

    @property
    def launches_first(self) -> bool:
        """Whether a replay may launch before :meth:`prepare_launched`: every ``prepare`` asked for
        it and each buffer it writes is copied behind its gate (on a host whose stores are ordered)."""
        return bool(self._gated) and not self._prepare_first and _ORDERED_STORES

    def launch_first_now(self) -> bool:
        """For a replay that may launch first (:attr:`launches_first`): whether this one does
        (``False`` for :data:`PREPARE_FIRST_REPLAYS` replays after a late streak)."""
        if self._prepare_first_left:
            self._prepare_first_left -= 1
            return False
        return True

    def _run_prepares(self, live: Any) -> None:
        for prepare in self._prepares:
            prepare(live)

    def prepare(self, live: Any) -> None:
        """Run every ``prepare`` once (host writes; a graph copies them in), then open the gates."""
        if not self._gated:
            self._run_prepares(live)
            return
        self.wait_for_gates()  # (a buffer prepare does not write this time is opened all the same)
        self._run_prepares(live)
        self._open_gates()

    def _open_gates(self) -> None:
        stream = self._current_stream(self._device)
        for buf in self._gated:
            buf._release(stream)

    def wait_for_gates(self) -> None:
        """Wait until the replays queued before have read the values their gates were opened for."""
        for buf in self._gated:
            buf._wait_for_gate()

    def before_launch(self) -> None:
        """Before a launch-first replay: :meth:`wait_for_gates`, then clear the arrivals. In
        this order: a replay's arrival is written before its copy, whose gate is read 0 only
        once the copy ran, so no earlier arrival can land after the clear."""
        self.wait_for_gates()
        for buf in self._gated:
            buf._clear_arrival()

    def prepare_launched(self, live: Any, choosing: bool = True) -> None:
        """:meth:`prepare` for a replay already launched, which waits at its gates.

        Called as the launch returns: first notes whether the GPU already
        reached a gate (a late launch), which counts toward the order of the
        next replays (see :data:`LATE_STREAK`) when ``choosing``. A ``prepare``
        that raises opens the gates on the values staged at capture (the
        launched kernels read metadata within their bounds), and its exception
        says so.
        """
        self.launched_first += 1
        late = any(buf._arrived() for buf in self._gated)
        self.late_launches += late
        if choosing:
            self._late_streak = self._late_streak + 1 if late else 0
            if self._late_streak >= LATE_STREAK:
                self._late_streak = 0
                self._prepare_first_left = PREPARE_FIRST_REPLAYS
                self._switches += 1
                log.log(logging.INFO if self._switches == 1 else logging.DEBUG,
                        "bcg: the GPU reached a staged gate before the graph's launch returned in %d replays "
                        "in a row: running prepare before the launch for the next %d replays (late streak %d)",
                        LATE_STREAK, PREPARE_FIRST_REPLAYS, self._switches)
        try:
            self._run_prepares(live)
        except BaseException as exc:
            self._open_on_capture_values()
            add_note(exc, "bcg: raised by a staged prepare (prepare_after_launch=True) after its graph was launched: "
                     "the replay ran with the metadata staged at capture, so its outputs (and anything else the "
                     "graph writes) are not this call's. The graph stays replayable")
            raise
        self._open_gates()

    def _open_on_capture_values(self) -> None:
        """Open every closed gate on the value its buffer held at capture (within the kernels' bounds)."""
        stream = self._current_stream(self._device)
        for buf, value in zip(self._gated, self._capture_values):
            if not buf.gate_open:
                buf.host.copy_(value)
                buf._release(stream)

    def settle(self) -> None:
        """After a replay that raised: leave every gate closed, with no copy waiting at one.

        Gates still closed are opened on the values staged at capture (a copy
        launched before the failure reads metadata within its bounds), the
        current stream is drained, and every gate closed.
        """
        if not self._gated:
            return
        self._open_on_capture_values()
        try:
            torch.cuda.current_stream(self._device).synchronize()
        finally:
            for buf in self._gated:
                buf._close_gate()

    def segment_ran(self, ran: bool, stream: int) -> None:
        """A capture closed its open segment: launched it on raw ``stream`` (``ran``: its gates
        open for that run, on the values ``prepare`` wrote at capture), or did not (they stay closed)."""
        if ran:
            for buf in self._armed:
                buf._release(stream)
        self._armed.clear()

    def prepare_and_upload(self, live: Any) -> None:
        """Run every ``prepare``, then copy what it wrote to the device now (eager runs)."""
        with collecting() as written:
            self._run_prepares(live)
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
            self._upload_written(spec, written)
            self._prepares.append(spec.prepare)
            self._values.append(staged)
            self._after_launch.append(spec.prepare_after_launch)
        elif self._after_launch[i] != spec.prepare_after_launch:
            raise CaptureError(
                f"staged breakpoint {spec.name!r} shares its prepare function with one recorded before, "
                f"but says prepare_after_launch={spec.prepare_after_launch} where that one said "
                f"{self._after_launch[i]}: the prepare runs once per replay, so give every breakpoint "
                "sharing it the same prepare_after_launch"
            )
        if not any(s.fits == spec.fits and (not s.fits_reads_staged or v is staged) for s, v, _ in self._fits):
            self._fits.append((spec, staged, f"{spec.name} does not fit"))
        return recorder.run_breakpoint(spec.fn, args, kwargs, live=staged)

    def _upload_written(self, spec: BreakpointSpec, written: list[StagingBuffer]) -> None:
        """Upload the buffers ``spec``'s ``prepare`` wrote: captured, when capturing (behind their
        gates with ``prepare_after_launch``), so the graph copies the host values in."""
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
        gated = [buf._stage_copy(after_launch=spec.prepare_after_launch) for buf in written]
        for buf, behind_gate in zip(written, gated):
            if behind_gate:
                self._device = buf.device.device.index
                self._gated.append(buf)
                self._capture_values.append(buf.host.clone())
                self._armed.append(buf)
        if not spec.prepare_after_launch or not all(gated) or not written:
            self._prepare_first = True


class StagedTiers(tuple):  # type: ignore[type-arg]
    """Capture-time live metadata for the staged tiers of each :class:`bcg.GraphRunner` bucket.

    Return one from ``capture_live`` (``StagedTiers(live_a, live_b, live)``,
    smallest bounds first): the runner captures each bucket's graph, and its
    breakable form, with the last value as usual, and one more inline form
    (a *tier*) per earlier value. A tier's staged breakpoints are bounded by
    what their ``prepare`` returned for its value, which their
    ``fits(live, staged)`` reads: say, fewer request slots, so that a small
    batch does not pay for empty ones. A call runs the first tier whose
    staged breakpoints all fit its ``live``, else the bucket's graph (inline
    or breakable, as usual). Each tier ends by copying its outputs into the
    bucket's (in the graph), so calls return the same tensors whichever ran.

    .. warning::
        Each tier costs one more capture and executable per bucket (its
        temporaries share the pool). Runners with ``ranks=`` capture no tiers.
    """

    def __new__(cls, *lives: Any) -> StagedTiers:
        if not lives:
            raise ValueError("StagedTiers needs at least one live value (the bucket's own, last)")
        return super().__new__(cls, lives)

    def __getnewargs__(self) -> tuple[Any, ...]:  # copy and pickle: the values, not one tuple of them
        return tuple(self)


NOT_INLINE: Any = object()
"""What :meth:`Stager.record` returns for a staged breakpoint recorded as a breakpoint."""


class StagedWarmup(Recorder):
    """The active recorder of a warm-up before a capture: breakpoints are plain calls, staged
    ones run inline (eagerly, with their buffers uploaded), as the capture will record them."""

    segment_label = "a warm-up run"

    def __init__(self) -> None:
        super().__init__()
        self.stager = Stager()

    def on_breakpoint(self, spec: BreakpointSpec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return self.run_breakpoint(spec.fn, args, kwargs)

    def on_staged(self, spec: BreakpointSpec, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        result = self.stager.record(self, spec, args, kwargs)
        return self.on_breakpoint(spec, args, kwargs) if result is NOT_INLINE else result
