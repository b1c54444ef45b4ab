"""``torch.compile``'d code inside a bcg capture.

Inductor's kernels (Triton and library calls) are ordinary CUDA work on the
current stream, so a capture records them in the current segment like any other
kernel; a breakpoint inside compiled code is a Dynamo graph break (see
:mod:`bcg.breakpoint`). Two things need care, and this module handles them for
the duration of one capture:

* Inductor's own CUDA graphs (``mode="reduce-overhead"`` / ``"max-autotune"``,
  i.e. cudagraph trees) are **switched off** while a bcg capture runs: compiled
  regions then launch their kernels directly and bcg records them (bcg makes the
  graphs). Outside the capture they behave as compiled. This uses Inductor's
  ``triton.cudagraph_capture_sizes`` setting (an empty tuple: no size is
  graphed), patched process-wide for the capture. With
  ``torch._inductor.config.triton.cudagraph_trees = False`` Inductor's older
  graph wrapper does not read that setting: compile without CUDA graphs then.
* Compiling (or autotuning) inside a capture is not supported: run the compiled
  code eagerly on every shape you capture first (``bcg.make_graph`` and
  ``bcg.GraphRunner`` do this). A capture during which Dynamo compiled says so:
  a warning when it succeeded, a note on the error when it failed.

Nothing here imports Inductor: when it is not loaded there is nothing to switch.
"""

from __future__ import annotations

import logging
import threading
from types import TracebackType
from typing import Any

from bcg.core.torch_internals import dynamo_graphs, inductor_config

log = logging.getLogger("bcg")

CAPTURE_SIZES = "triton.cudagraph_capture_sizes"


class _InductorGraphsOff:
    """Inductor's ``triton.cudagraph_capture_sizes`` set to ``()``, process-wide, reference counted.

    The setting is process-wide, so overlapping captures (on several threads)
    share one patch: the first turns it on, the last restores the user's value.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._depth = 0
        self._patch: Any = None

    def enter(self) -> None:
        with self._lock:
            self._depth += 1
            if self._depth > 1:
                return
            config = inductor_config()
            if config is not None and getattr(config.triton, "cudagraph_capture_sizes", ()) != ():
                self._patch = config.patch({CAPTURE_SIZES: ()})
                self._patch.__enter__()
                log.debug("bcg: Inductor's own CUDA graphs are off while bcg captures")

    def exit(self) -> None:
        with self._lock:
            self._depth -= 1
            if self._depth == 0 and self._patch is not None:
                self._patch.__exit__(None, None, None)
                self._patch = None


_GRAPHS_OFF = _InductorGraphsOff()


class CompileWatch:
    """One capture's view of torch.compile: Inductor's CUDA graphs off, compiles counted.

    Use as a context manager around the capture. ``compiled`` is how many
    Dynamo graphs were compiled since it was entered.
    """

    def __init__(self) -> None:
        self._start = 0
        self._entered = False

    def __enter__(self) -> CompileWatch:
        self._start = dynamo_graphs()
        _GRAPHS_OFF.enter()
        self._entered = True
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._entered:
            self._entered = False
            _GRAPHS_OFF.exit()

    @property
    def compiled(self) -> int:
        return dynamo_graphs() - self._start

    def message(self) -> str | None:
        """What to tell the user when Dynamo compiled during the capture (None: it did not)."""
        n = self.compiled
        if n <= 0:
            return None
        return (
            f"bcg: torch.compile compiled {n} graph(s) during this capture. Compiling and autotuning "
            "may synchronize the device, which a capture forbids, and cost seconds inside it: run the "
            "compiled code eagerly once on every shape you capture before capturing (bcg.make_graph "
            "and bcg.GraphRunner warm up for you)"
        )
