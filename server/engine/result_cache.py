"""Finished results of the search, by everything that determines them: model version, source
pieces (and POS tags), decoding options and length limit. A repeated request is answered from
here without queueing, encoding or decoding (Triton Inference Server calls this a response
cache). LRU, bounded by entries; thread-safe. Size 0 turns it off."""
from __future__ import annotations

import threading
from collections import OrderedDict

from .sequence import Hypothesis, Sequence


def result_key(version: str, seq: Sequence) -> tuple:
    return version, tuple(seq.src), tuple(seq.tags) if seq.tags is not None else None, seq.options, seq.max_len


class ResultCache:
    def __init__(self, max_entries: int):
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple, list[Hypothesis]] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = self.evictions = 0

    def get(self, key: tuple) -> list[Hypothesis] | None:
        if not self.max_entries:
            return None
        with self._lock:
            found = self._entries.get(key)
            if found is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return found

    def put(self, key: tuple, hypotheses: list[Hypothesis]) -> None:
        if not self.max_entries:
            return
        with self._lock:
            self._entries[key] = list(hypotheses)
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
                self.evictions += 1

    def __len__(self) -> int:
        return len(self._entries)

    def stats(self) -> dict[str, int]:
        return {"hits": self.hits, "misses": self.misses, "evictions": self.evictions, "entries": len(self)}
