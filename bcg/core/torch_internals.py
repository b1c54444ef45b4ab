"""Every private torch call bcg makes, each with the reason no public route exists.

Keeping them here means one file to read when torch changes, and one place
that says which torch internals bcg depends on.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("bcg")


def clear_cublas_workspaces() -> None:
    """Drop torch's cached cuBLAS/cuBLASLt workspaces, one per (handle, stream).

    bcg calls it right before each segment's capture begins and after each
    capture ends, so that the workspace a captured matmul uses is allocated
    inside the capture, into the graph's own pool, and no cache keeps it
    afterwards: no other graph, stream or eager call then shares it, and no
    later clear (Inductor's CUDA graphs clear around every recording) can
    hand it back to the driver while the graph lives. Private: torch has no
    public way to clear or route these workspaces; Inductor's CUDA graph
    trees call the same function around each recording. A no-op without it.
    """
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


def storage_use_count(storage: torch.UntypedStorage) -> int:
    """How many strong references the storage's ``StorageImpl`` has (tensors, storages, C++).

    Private: torch has no public reference count for storages; its CUDA graph
    trees read the same counter to tell whether an output is still alive.
    """
    return int(torch._C._storage_Use_Count(storage._cdata))
