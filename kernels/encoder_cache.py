"""Cross-request encoder cache: a repeated source skips the encoder (DESIGN: "Encode once").

Entries are per sentence: key (model version, source token ids, POS tags or None) -> that
sentence's EncoderState, cut to its own length S_i (no padding stored). A batch is assembled
by padding every entry to the batch's longest S: K/V get zeros past S_i and src_pad gets True
there, so the padded keys are masked out of every softmax exactly like the padding of a batch
encoded together (s^M and Gs have no S axis). LRU under a byte budget (the tensors' bytes);
one lock guards the map and counters, the encoder itself runs outside it.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence

import torch
import torch.nn.functional as F

from training.model import EncoderState

Key = tuple[Hashable, tuple[int, ...], tuple[int, ...] | None]


def state_bytes(state: EncoderState) -> int:
    tensors = [t for kv in state.memory for t in kv] + [state.src_pad, state.global_state, state.gate_source]
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def split_state(state: EncoderState, lengths: Sequence[int]) -> list[EncoderState]:
    """One EncoderState per sentence, cut to its length. Cloned: a view would keep the whole
    batch's storage alive and make the byte count a lie."""
    def one(i: int, n: int) -> EncoderState:
        row = lambda t: None if t is None else t[i: i + 1].clone()
        return EncoderState([(k[i: i + 1, :, :n].clone(), v[i: i + 1, :, :n].clone()) for k, v in state.memory],
                            state.src_pad[i: i + 1, :n].clone(), row(state.global_state), row(state.gate_source))
    return [one(i, n) for i, n in enumerate(lengths)]


def stack_states(states: Sequence[EncoderState]) -> EncoderState:
    """Batch per-sentence states, padding keys/values with zeros and src_pad with True."""
    width = max(s.src_pad.shape[1] for s in states)

    def padded_kv(t: torch.Tensor) -> torch.Tensor:  # (1, H, S_i, d) -> (1, H, width, d)
        return F.pad(t, (0, 0, 0, width - t.shape[2]))

    memory = [(torch.cat([padded_kv(s.memory[i][0]) for s in states]),
               torch.cat([padded_kv(s.memory[i][1]) for s in states])) for i in range(len(states[0].memory))]
    src_pad = torch.cat([F.pad(s.src_pad, (0, width - s.src_pad.shape[1]), value=True) for s in states])
    cat = lambda ts: None if ts[0] is None else torch.cat(ts)
    return EncoderState(memory, src_pad, cat([s.global_state for s in states]), cat([s.gate_source for s in states]))


class EncoderCache:
    """LRU of per-sentence EncoderStates within `max_bytes`; counts hits, misses and evictions."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._entries: OrderedDict[Key, tuple[EncoderState, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.bytes = self.hits = self.misses = self.evictions = self.rejected = 0

    def get(self, key: Key) -> EncoderState | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return entry[0]

    def put(self, key: Key, state: EncoderState) -> None:
        size = state_bytes(state)
        with self._lock:
            if key in self._entries:
                self.bytes -= self._entries.pop(key)[1]
            if size > self.max_bytes:  # would evict everything and still not fit
                self.rejected += 1
                return
            while self.bytes + size > self.max_bytes:
                self.bytes -= self._entries.popitem(last=False)[1][1]
                self.evictions += 1
            self._entries[key] = (state, size)
            self.bytes += size

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: Key) -> bool:  # no LRU touch, no counting
        return key in self._entries

    def stats(self) -> dict[str, int]:
        with self._lock:
            return dict(entries=len(self._entries), bytes=self.bytes, max_bytes=self.max_bytes, hits=self.hits,
                        misses=self.misses, evictions=self.evictions, rejected=self.rejected)


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
        pad_id = model.cfg.pad_id
        lengths = [len(key[1]) for key in missing]
        src = torch.full((len(missing), max(lengths)), pad_id, dtype=torch.long, device=device)
        tags = None if src_tags is None else torch.zeros_like(src)
        for row, key in enumerate(missing):
            src[row, : lengths[row]] = torch.tensor(key[1], dtype=torch.long)
            if tags is not None:
                tags[row, : lengths[row]] = torch.tensor(key[2], dtype=torch.long)
        for key, state in zip(missing, split_state(model.encode(src, tags), lengths)):
            cache.put(key, state)
            found[key] = state
    return stack_states([found[key] for key in keys])


class CachedEncoder:
    """A Seq2Seq whose encode() goes through the cache: a drop-in for training.search's greedy and
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
