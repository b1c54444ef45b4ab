"""``bcg.GraphRunner``: one breakable graph per bucket size, padded inputs, one shared memory pool.

* :mod:`~bcg.runner.graph_runner` - the runner: captures, dispatch, stats;
* :mod:`~bcg.runner.inputs` - input specs, call validation, static buffers;
* :mod:`~bcg.runner.padding` - the padded-row sanitizer;
* :mod:`~bcg.runner.pool_lock` - the call lock of runners sharing a pool.

How a call runs: ``docs/runner.md``.
"""

from bcg.runner.buckets import default_buckets, geometric_buckets, pick_bucket, stepped_buckets
from bcg.runner.graph_runner import FALLBACK_REASONS, GraphRunner

__all__ = ["FALLBACK_REASONS", "GraphRunner", "default_buckets", "geometric_buckets", "pick_bucket", "stepped_buckets"]
