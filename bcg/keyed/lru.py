"""An LRU map bounded by a count and a byte total: the variant and stitched-executable caches' bookkeeping."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class Lru(Generic[K, V]):
    """An LRU map bounded by a count and a byte total (the caller evicts what :meth:`over` names)."""

    def __init__(self, max_count: int, max_bytes: int) -> None:
        self.max_count = max_count
        self.max_bytes = max_bytes
        self._items: OrderedDict[K, V] = OrderedDict()
        self._bytes: dict[K, int] = {}
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def get(self, key: K) -> V | None:
        """The value under ``key`` (now the most recently used), or None."""
        value = self._items.get(key)
        if value is not None:
            self._items.move_to_end(key)
        return value

    def peek(self, key: K) -> V | None:
        """The value under ``key``, or None, without making it the most recently used."""
        return self._items.get(key)

    def put(self, key: K, value: V, nbytes: int = 0) -> None:
        self.pop(key)
        self._items[key] = value
        self._bytes[key] = nbytes
        self.nbytes += nbytes

    def size(self, key: K) -> int:
        """The bytes counted for ``key``."""
        return self._bytes.get(key, 0)

    def add_bytes(self, key: K, nbytes: int) -> None:
        self._bytes[key] += nbytes
        self.nbytes += nbytes

    def pop(self, key: K) -> V | None:
        value = self._items.pop(key, None)
        if value is not None or key in self._bytes:
            self.nbytes -= self._bytes.pop(key, 0)
        return value

    def over(self, keep: Callable[[K], bool], room: int = 0) -> list[K]:
        """Least recently used keys to evict (never one ``keep`` protects) so that ``room`` more
        entries fit the count and the bytes fit the byte bound."""
        out: list[K] = []
        count, nbytes = len(self._items), self.nbytes
        for key in self._items:
            if count + room <= self.max_count and nbytes <= self.max_bytes:
                break
            if keep(key):
                continue
            out.append(key)
            count -= 1
            nbytes -= self._bytes[key]
        return out

    def full(self, room: int = 1) -> bool:
        return len(self._items) + room > self.max_count or self.nbytes > self.max_bytes

    def oldest(self) -> K | None:
        return next(iter(self._items), None)

    def items(self) -> Iterator[tuple[K, V]]:
        return iter(list(self._items.items()))
