"""Cross-request encoder cache: a repeated source skips the encoder.

Entries are per sentence: key (model version, source token ids, POS tags or None) -> that
sentence's EncoderState, cut to its own length S_i (no padding stored). A batch is assembled
by padding every entry to the batch's longest S: K/V get zeros past S_i and src_pad gets True
there, so the padded keys are masked out of every softmax exactly like the padding of a batch
encoded together (s^M and Gs have no S axis). LRU under a byte budget (the tensors' bytes);
the encoder itself runs outside the cache's lock.
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np
import torch

from training.seq2seq.model import EncoderState

from .lru import LRU

Key = tuple[Hashable, tuple[int, ...], tuple[int, ...] | None]


class EncoderCache(LRU[EncoderState]):
    """Per-sentence EncoderStates within `max_bytes` (their tensors' bytes)."""

    def __init__(self, max_bytes: int):
        super().__init__(max_bytes, size=lambda state: state.nbytes)

    @property
    def max_bytes(self) -> int:
        return self.capacity

    @property
    def bytes(self) -> int:
        return self.used

    def stats(self) -> dict[str, int]:
        return self.counters() | {"bytes": self.used, "max_bytes": self.capacity}


def cache_key(version: Hashable, ids: Sequence[int], tags: Sequence[int] | None = None) -> Key:
    return (version, tuple(int(i) for i in ids), None if tags is None else tuple(int(t) for t in tags))


@torch.no_grad()
def encode_cached(model, cache: EncoderCache, version: Hashable, src_ids: Sequence[Sequence[int]],
                  src_tags: Sequence[Sequence[int]] | None = None, device: torch.device | str | None = None
                  ) -> EncoderState:
    """The batch EncoderState for unpadded sources, running the encoder on the misses only (once
    per distinct source). `version` must change whenever the weights do."""
    keys = [cache_key(version, ids, None if src_tags is None else src_tags[i]) for i, ids in enumerate(src_ids)]
    found = {key: cache.get(key) for key in dict.fromkeys(keys)}  # each distinct source looked up once
    missing = [key for key, state in found.items() if state is None]
    if missing:
        # padded in NumPy: a torch call costs an engine loop tens of microseconds (its caches are
        # cold between decoder steps), and this took two per text
        lengths = [len(key[1]) for key in missing]
        src = np.full((len(missing), max(lengths)), model.cfg.pad_id, np.int64)
        tags = None if src_tags is None else np.zeros_like(src)
        for row, key in enumerate(missing):
            src[row, : lengths[row]] = key[1]
            if tags is not None:
                tags[row, : lengths[row]] = key[2]
        encoded = model.encode(*(None if t is None else torch.from_numpy(t).to(device) for t in (src, tags)))
        if len(missing) == len(keys) and not cache.capacity:  # nothing to store or assemble: as encoded
            return encoded
        for key, state in zip(missing, encoded.split(lengths)):
            cache.put(key, state)
            found[key] = state
    return EncoderState.stack([found[key] for key in keys])


class CachedEncoder:
    """A Seq2Seq whose encode() goes through the cache: a drop-in for training.seq2seq.search's greedy and
    beam_search, which take padded (B, S) sources (pads are stripped to form the keys)."""

    def __init__(self, model, cache: EncoderCache, version: Hashable):
        self.model, self.cache, self.version = model, cache, version

    def encode(self, src: torch.Tensor, src_tags: torch.Tensor | None = None) -> EncoderState:
        keep = src.ne(self.model.cfg.pad_id)
        ids = [row[k].tolist() for row, k in zip(src, keep)]
        tags = None if src_tags is None else [row[k].tolist() for row, k in zip(src_tags, keep)]
        return encode_cached(self.model, self.cache, self.version, ids, tags, device=src.device)

    def __getattr__(self, name):  # cfg, decode_step, ... come from the model
        return getattr(self.model, name)
