"""The CUDA generators captured work draws from, and whether a run moved them.

A captured segment (or keyed variant) whose kernels draw random numbers must be
replayed through torch (``CUDAGraph.replay``), which advances every generator
the graph was captured with; a launch of its executable by bcg would draw the
same numbers again. :class:`GeneratorWatch` tells: an operation recorded took
a CUDA generator (depending on the torch version, torch refuses an unregistered
one in a capture, or registers it with the graph itself), or the work's first
run moved the device's default generator or a registered one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from bcg.core.torch_internals import TorchDispatchMode


class GeneratorWatch(TorchDispatchMode):
    """During a capture: whether captured work draws random numbers.

    It does when an operation recorded since :meth:`reset` took a CUDA generator
    (:attr:`took`), or when a run of it moved one of :attr:`generators` (the
    device's default one and those registered), compared with :meth:`offsets`
    read before the run (:meth:`moved`).

    Arguments:
        device: the capture's CUDA device.
        generators: generators registered with the graph.
        recording: whether the operations running now are captured (False while a
            breakpoint runs eagerly between segments).
    """

    supports_higher_order_operators = True

    @classmethod
    def is_infra_mode(cls) -> bool:
        # only looks: torch.compile'd regions stay compiled under it (see StorageWatch)
        return True

    def __init__(self, device: int, generators: Iterable[torch.Generator] = (),
                 recording: Callable[[], bool] = lambda: True) -> None:
        super().__init__()
        self._recording = recording
        #: the generators whose offsets are compared, the default one first
        self.generators = [torch.cuda.default_generators[device], *generators]
        #: an operation recorded since reset() took a CUDA generator (each op gets its own Python
        #: object for the same generator, so the fact is kept, not the objects)
        self.took = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if not self.took and self._recording():
            self.took = any(isinstance(v, torch.Generator) and v.device.type == "cuda"
                            for v in (*args, *kwargs.values()))
        return func(*args, **kwargs)

    def reset(self) -> None:
        """Forget the operations recorded so far (a new segment begins)."""
        self.took = False

    def offsets(self) -> list[int]:
        """Each of :attr:`generators`' offsets now."""
        return [g.get_offset() for g in self.generators]

    def moved(self, before: list[int]) -> bool:
        """Whether the work draws random numbers: an operation took a generator, or a run since
        ``before`` (:meth:`offsets`) moved one."""
        return self.took or self.offsets() != before
