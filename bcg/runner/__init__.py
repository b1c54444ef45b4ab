"""``bcg.GraphRunner``: one breakable graph per bucket size, padded inputs, one shared memory pool.

* :mod:`~bcg.runner.graph_runner` - the runner's face and its calls (dispatch, fallbacks, outputs, reset);
* :mod:`~bcg.runner.ladder` - the buckets, and how one bucket is warmed up and captured;
* :mod:`~bcg.runner.schedule` - when buckets are captured: now, lazily, in the background;
* :mod:`~bcg.runner.buckets` - ladders of sizes, and the padding a size costs;
* :mod:`~bcg.runner.inputs` - input specs, call validation, the static inputs and their padding;
* :mod:`~bcg.runner.sanitizer` - the in-graph zeroing of padded rows;
* :mod:`~bcg.runner.pool_lock` - the call lock of runners sharing a pool;
* :mod:`~bcg.runner.arguments`, :mod:`~bcg.runner.stats` - the constructor's checks; ``stats()``.

How a call runs: ``docs/runner.md``.
"""

from bcg.runner.buckets import default_buckets, geometric_buckets, pick_bucket, stepped_buckets
from bcg.runner.graph_runner import FALLBACK_REASONS, GraphRunner

__all__ = ["FALLBACK_REASONS", "GraphRunner", "default_buckets", "geometric_buckets", "pick_bucket", "stepped_buckets"]
