"""bcg: breakable CUDA graphs for almost-capturable PyTorch code.

Wrap a forward pass in :class:`capture`; each :func:`breakpoint` call ends a
CUDA graph segment, runs eagerly, and begins the next; :meth:`BreakableGraph.replay`
runs segment, breakpoint, segment, ... in stream order, with per-replay host
metadata available to breakpoints through :func:`live`.
"""

from __future__ import annotations

import logging

from bcg.core.breakpoint import breakpoint, graph_break
from bcg.capture import capture, switchable
from bcg.core.debug import GuardError
from bcg.errors import (
    BcgError,
    BreakpointOutputMismatch,
    CaptureError,
    CaptureInvalidatedError,
    HostSyncInCaptureError,
    LiveReadInSegmentError,
    NestedCaptureError,
    ReplayError,
    StaleTensorError,
    StreamForkError,
    VerificationError,
)
from bcg.graph import BreakableGraph, GraphStats
from bcg.staged.staging import StagedTiers, StagingBuffer
from bcg.keyed.variants import VariantPolicy
from bcg.distributed.agreement import RankAgreement
from bcg.core.breakpoint import live, live_scope
from bcg.make_graph import make_graph
from bcg.core.pool import graph_pool_handle
from bcg.runner.buckets import default_buckets, geometric_buckets, pick_bucket, stepped_buckets
from bcg.runner import GraphRunner
from bcg.verify import VerifyReport, verify

__version__ = "0.1.0"

logging.getLogger("bcg").addHandler(logging.NullHandler())

__all__ = [
    "BcgError",
    "BreakableGraph",
    "BreakpointOutputMismatch",
    "CaptureError",
    "CaptureInvalidatedError",
    "GraphStats",
    "GuardError",
    "HostSyncInCaptureError",
    "LiveReadInSegmentError",
    "NestedCaptureError",
    "RankAgreement",
    "ReplayError",
    "StagedTiers",
    "StagingBuffer",
    "StaleTensorError",
    "StreamForkError",
    "VariantPolicy",
    "VerificationError",
    "VerifyReport",
    "breakpoint",
    "capture",
    "switchable",
    "graph_break",
    "graph_pool_handle",
    "live",
    "live_scope",
    "make_graph",
    "verify",
    "GraphRunner",
    "default_buckets",
    "geometric_buckets",
    "pick_bucket",
    "stepped_buckets",
]
