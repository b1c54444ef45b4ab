"""The CUDA generators captured work draws from, and whether a run moved them.

A captured segment (or keyed variant) whose kernels draw random numbers must be
replayed through torch (``CUDAGraph.replay``), which advances every generator
the graph was captured with; a launch of its executable by bcg would draw the
same numbers again. Whether it draws is learnt from its first run: did a
generator's offset move? :class:`GeneratorWatch` names the generators to ask:
the device's default one, those registered (``register_generator_state``), and
every other CUDA generator an operation takes during the capture (depending on
the torch version, torch refuses such a generator in a capture, or registers it
with the graph itself).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from bcg.core.torch_internals import TorchDispatchMode


class GeneratorWatch(TorchDispatchMode):
    """During a capture: the CUDA generators its operations draw from.

    Arguments:
        device: the capture's CUDA device (its default generator is always watched).
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
        #: the generators to ask, the default one first
        self.generators: list[torch.Generator] = []
        for g in (torch.cuda.default_generators[device], *generators):
            self._add(g)

    def _add(self, generator: torch.Generator) -> None:
        if all(g is not generator for g in self.generators):
            self.generators.append(generator)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self._recording():
            for value in (*args, *kwargs.values()):
                if isinstance(value, torch.Generator) and value.device.type == "cuda":
                    self._add(value)
        return func(*args, **kwargs)

    def offsets(self) -> list[int]:
        """Each watched generator's offset now (compare two readings around a run)."""
        return [g.get_offset() for g in self.generators]
