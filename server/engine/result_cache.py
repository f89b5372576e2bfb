"""Finished results of the search, by everything that determines them: model version, source
pieces (and POS tags), decoding options and length limit. A repeated request is answered from
here without queueing, encoding or decoding (Triton Inference Server calls this a response
cache)."""
from __future__ import annotations

from .lru import LRU
from .sequence import Hypothesis, Sequence


def result_key(version: str, seq: Sequence) -> tuple:
    return version, tuple(seq.src), tuple(seq.tags) if seq.tags is not None else None, seq.options, seq.max_len


class ResultCache(LRU[list[Hypothesis]]):
    """Bounded by entries; size 0 turns it off (nothing stored, nothing counted)."""

    def get(self, key: tuple) -> list[Hypothesis] | None:
        return super().get(key) if self.capacity else None

    def put(self, key: tuple, hypotheses: list[Hypothesis]) -> None:
        if self.capacity:
            super().put(key, list(hypotheses))

    def stats(self) -> dict[str, int]:
        c = self.counters()
        return {"hits": c["hits"], "misses": c["misses"], "evictions": c["evictions"], "entries": c["entries"]}
