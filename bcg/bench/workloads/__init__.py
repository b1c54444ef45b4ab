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

The flags' ``argparse`` types are in :mod:`bcg.bench.argtypes`.
"""

from __future__ import annotations

from types import ModuleType

from bcg.bench.workloads import llama, micro

WORKLOADS: dict[str, ModuleType] = {llama.NAME: llama, micro.NAME: micro}
