"""Stitching: a replay's segments and variants combined into ONE executable graph, cached per key tuple.

A template graph gets one child-graph node per step (``cudaGraphAddChildGraphNode``
clones the segment's or variant's ``cudaGraph_t``), chained in plan order, and is
instantiated and uploaded once. Executables are kept in an LRU bounded by count
and by bytes (the drop in free device memory over instantiate and upload). A
new key tuple that would overflow the cache first tries to update the least
recently used executable in place (``cudaGraphExecUpdate``: accepted when the
topology matches, e.g. the same number of requests with other lengths); only if
the driver refuses is it destroyed and a new one instantiated.

The executables read and write the memory of the segments and variants they
were built from: the variant cache drops every executable built from an
evicted key (:meth:`StitchedCache.drop`).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from bcg.core import cudart
from bcg.keyed.lru import Lru
from bcg.core.process import on_release

log = logging.getLogger("bcg")


@dataclass(eq=False)
class _Executable:
    handle: int
    parts: tuple[Hashable, ...]  # the variant entries it was built from
    free: Any = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        # destroyed when dropped or collected, never during a capture (an executable still in
        # flight is freed by CUDA once it completes)
        self.free = on_release(self, functools.partial(cudart.exec_destroy, self.handle))


class StitchedCache:
    """Stitched executables of one graph, by key tuple.

    Arguments:
        max_count, max_bytes: the LRU's bounds.
    """

    def __init__(self, max_count: int, max_bytes: int) -> None:
        self._lru: Lru[Hashable, _Executable] = Lru(max_count, max_bytes)
        self.blocked: str | None = None  # the driver refused to stitch this graph (why)
        self.instantiations = 0
        self.updates = 0
        self.update_refusals = 0
        self._instantiate_s = 0.0
        self._update_s = 0.0

    def get(self, key: Hashable) -> int | None:
        """The executable for ``key`` (now the most recently used), or None."""
        found = self._lru.get(key)
        return found.handle if found is not None else None

    def build(self, key: Hashable, children: Sequence[int], parts: tuple[Hashable, ...], stream: int) -> int | None:
        """Stitch ``children`` (``cudaGraph_t`` handles, in launch order) for ``key``; upload on ``stream``.

        Returns the executable, or None when the driver refuses (the reason is
        logged once and kept in :attr:`blocked`; later calls return None at once).
        """
        if self.blocked is not None:
            return None
        template = 0
        try:
            template = cudart.graph_create()
            node: Any = None
            for child in children:
                node = cudart.add_child_graph(template, node, child)
            if self._lru.full(room=1):
                handle = self._update_oldest(key, template, parts)
                if handle is not None:
                    return handle
            for victim in self._lru.over(lambda k: False, room=1):
                self._destroy(victim)
            free = torch.cuda.mem_get_info()[0]
            t0 = time.perf_counter()
            handle = cudart.instantiate(template)
            try:
                cudart.upload(handle, stream)
            except BaseException:
                cudart.exec_destroy(handle)
                raise
            self._instantiate_s += time.perf_counter() - t0
            self.instantiations += 1
            self._lru.put(key, _Executable(handle, parts), max(free - torch.cuda.mem_get_info()[0], 0))
            return handle
        except RuntimeError as exc:
            if "memory" in str(exc).lower():  # out of memory now: piecewise this time, stitch later
                log.info("bcg: no memory to stitch this replay (%s); it runs piecewise", exc)
                return None
            self.blocked = f"{exc}"
            log.warning("bcg: this graph's segments and variants cannot be stitched into one graph (%s); "
                        "its replays stay piecewise", exc)
            return None
        finally:
            if template:
                cudart.graph_destroy(template)

    def _update_oldest(self, key: Hashable, template: int, parts: tuple[Hashable, ...]) -> int | None:
        """Update the least recently used executable to run ``template`` (None: the driver refused)."""
        oldest = self._lru.oldest()
        if oldest is None:
            return None
        found = self._lru.get(oldest)
        assert found is not None
        t0 = time.perf_counter()
        if not cudart.exec_update(found.handle, template):
            self.update_refusals += 1
            return None
        self._update_s += time.perf_counter() - t0
        self.updates += 1
        nbytes = self._lru.size(oldest)
        self._lru.pop(oldest)
        found.parts = parts  # the same object: a new one would leave this one to destroy the handle
        self._lru.put(key, found, nbytes)
        return found.handle

    def drop(self, part: Hashable) -> None:
        """Destroy every executable built from the variant entry ``part``."""
        for key, exe in self._lru.items():
            if part in exe.parts:
                self._destroy(key)

    def _destroy(self, key: Hashable) -> None:
        """Drop the executable of ``key`` from the cache and destroy it (see :mod:`bcg.core.process`)."""
        exe = self._lru.pop(key)
        if exe is not None:
            exe.free()

    def release(self) -> None:
        """Destroy every executable."""
        for key, _ in self._lru.items():
            self._destroy(key)

    def stats(self) -> dict[str, Any]:
        """``cached``, ``bytes``, ``instantiations``, ``updates``, ``update_refusals``, mean
        ``instantiate_ms`` and ``update_ms``, and ``blocked`` (why the driver refused, if it did)."""
        return {
            "cached": len(self._lru),
            "bytes": self._lru.nbytes,
            "instantiations": self.instantiations,
            "updates": self.updates,
            "update_refusals": self.update_refusals,
            "instantiate_ms": 1e3 * self._instantiate_s / self.instantiations if self.instantiations else None,
            "update_ms": 1e3 * self._update_s / self.updates if self.updates else None,
            "blocked": self.blocked,
        }
