"""bcg: breakpoint CUDA graphs for almost-capturable PyTorch code.

Wrap a forward pass in :class:`capture`; each :func:`breakpoint` call ends a
CUDA graph segment, runs eagerly, and begins the next; :meth:`BreakableGraph.replay`
runs segment, breakpoint, segment, ... in stream order, with per-replay host
metadata available to breakpoints through :func:`live`.

Errors are in :mod:`bcg.errors` (all derive from :class:`BcgError`); multi-GPU
agreement in :mod:`bcg.distributed`; bucket ladders in :mod:`bcg.runner`.
"""

from __future__ import annotations

import logging

from bcg import errors
from bcg.capture import capture
from bcg.core.breakpoint import breakpoint, graph_break, live, live_scope
from bcg.core.debug import Debug
from bcg.core.pool import graph_pool_handle
from bcg.errors import BcgError, CaptureError, ReplayError
from bcg.graph import BreakableGraph
from bcg.keyed.variants import VariantPolicy
from bcg.make_graph import make_graph
from bcg.runner import GraphRunner
from bcg.staged.staging import StagedTiers, StagingBuffer
from bcg.verify import verify

__version__ = "0.1.0"

logging.getLogger("bcg").addHandler(logging.NullHandler())

__all__ = [
    "BcgError",
    "BreakableGraph",
    "CaptureError",
    "Debug",
    "GraphRunner",
    "ReplayError",
    "StagedTiers",
    "StagingBuffer",
    "VariantPolicy",
    "breakpoint",
    "capture",
    "errors",
    "graph_break",
    "graph_pool_handle",
    "live",
    "live_scope",
    "make_graph",
    "verify",
]
