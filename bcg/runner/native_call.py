"""A runner call in C (``bcg._native.Call``): the calls on the runner's own input buffers that
nothing unusual holds up, from the handed inputs to the output view, in one native call.

It reads the runner's state at every call and keeps none of its own, so the Python call
(``GraphRunner._call``) stays the one definition of what a call does: whatever the native call
does not serve (another input, a bucket not captured, a fallback, a second stream, a busy call
lock, copies of the outputs) it hands back untouched, and the Python call runs.
"""

from __future__ import annotations

from typing import Any

from bcg.core import native
from bcg.core.torch_internals import stream_readers
from bcg.runner.inputs import HandedInputs
from bcg.runner.ladder import Ladder
from bcg.runner.pool_lock import PoolCallLock
from bcg.runner.sanitizer import PADDING
from bcg.runner.schedule import CaptureSchedule

_current_device, _current_stream = stream_readers()


def native_call(runner: Any, handed: HandedInputs, ladder: Ladder, schedule: CaptureSchedule,
                lock: PoolCallLock, device: int, copy_outputs: bool | None, max_padding_ratio: float | None,
                ranks: Any) -> Any:
    """The ``bcg._native.Call`` of ``runner`` (whose ``_real_rows`` it counts), or False where every
    call goes through Python: ranks (they agree before each launch), outputs always copied, no
    sanitizer, eager mode, the Python executor chosen (``BCG_NATIVE=0``), or no extension."""
    if (ranks is not None or copy_outputs is True or not ladder.sanitize or ladder.mode != "graph"
            or not native.enabled_by_env() or not native.available() or native.driver_error() is not None):
        return False
    views_safe = lock.views_safe if copy_outputs is None else (lambda: True)
    return native.module().Call(
        runner, handed.by_id, handed.first, ladder.buckets, ladder, schedule, lock, views_safe, PADDING, device,
        _current_device, _current_stream, -1.0 if max_padding_ratio is None else float(max_padding_ratio))
