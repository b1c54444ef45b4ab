"""``bcg-bench``: the benchmark CLI (``python -m bcg.bench``).

Layout (each piece is small on purpose, so adding one is a local change):

* :mod:`bcg.bench.case` - :class:`Case`, what a workload hands to a mode: static
  inputs, the live metadata, and a forward built around a given breakpoint.
* :mod:`bcg.bench.workloads` - one file per workload (``llama.py``, ``micro.py``)
  and the ``WORKLOADS`` registry. A workload yields one :class:`Case` per
  (attention, T) point.
* :mod:`bcg.bench.registry` - the mode registry: :func:`register_mode`, ``MODES``,
  and ``MODE_MODULES``, the modules that define modes (imported by :func:`load_modes`).
  A mode turns a :class:`Case` into a :class:`Built` (a ``run()`` that replays once,
  capture seconds, pool bytes).
* :mod:`bcg.bench.modes` - bcg's own modes, one function each (``eager``, ``floor``,
  ``bcg``, ...).
* :mod:`bcg.bench.peers` - adapters for other breakable-graph libraries (modes too).
* :mod:`bcg.bench.timing` - synchronized host wall-clock timing.
* :mod:`bcg.bench.argtypes` - the ``argparse`` types of the CLI's and workloads' flags.
* :mod:`bcg.bench.report` - the terminal table, ``bench.json`` and ``bench.png``.
* :mod:`bcg.bench.cli` - flags and the measuring loop.
"""
