"""One least-recently-used map for the server's caches (encoder states, finished results):
bounded by the sum of its entries' sizes, thread-safe, with the counters the metrics read."""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

V = TypeVar("V")


class LRU(Generic[V]):
    """`capacity` in the unit of `size(value)` (1 per entry by default); an entry larger than the
    whole capacity is not stored (`rejected`), since it would evict everything and still not fit."""

    def __init__(self, capacity: int, size: Callable[[V], int] = lambda value: 1):
        self.capacity, self._size = capacity, size
        self._entries: OrderedDict[Hashable, tuple[V, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.used = self.hits = self.misses = self.evictions = self.rejected = 0

    def get(self, key: Hashable) -> V | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return entry[0]

    def put(self, key: Hashable, value: V) -> None:
        size = self._size(value)
        with self._lock:
            if key in self._entries:
                self.used -= self._entries.pop(key)[1]
            if size > self.capacity:
                self.rejected += 1
                return
            while self.used + size > self.capacity:
                self.used -= self._entries.popitem(last=False)[1][1]
                self.evictions += 1
            self._entries[key] = (value, size)
            self.used += size

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Hashable) -> bool:  # no LRU touch, no counting
        return key in self._entries

    def counters(self) -> dict[str, int]:
        with self._lock:
            return dict(entries=len(self._entries), hits=self.hits, misses=self.misses, evictions=self.evictions,
                        rejected=self.rejected)
