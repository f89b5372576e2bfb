"""The running batch's encoder outputs, one slot per sequence, in storage that outlives them, in
length classes (SourceClasses: short and long sources apart, each class a SourceSlots).

A joining sequence's encoder state (cross-attention K/V per decoder layer, the source padding mask,
GRET's s^M and Gs) is written once into a free slot; a leaving one frees its slot. Nothing is
copied when others join or leave, where stacking and selecting per event copied the whole batch's
state at every admission and every finished sequence (several times a step under steady load).

The decoder step reads each class's slots 0..n-1 (n: the highest in use + 1) as its per-sentence
tensors, so rows say which slot they read. A free slot among them is computed and read by no row;
its mask keeps column 0 unmasked (keys there are finite) so that its softmax stays finite. The source axis
grows in steps of COLUMNS to the longest source and shrinks once the longest leaves; the slots
grow by doubling, and the top slots are moved down into holes once an eighth of them are empty.
A new layout (one every 25 steps or so under load) is written into the spare of two kept
storages (storage.py, as the batch's cache is), with only the slots up to the highest in use
copied: with two engine processes sharing the machine's memory bandwidth, zeroing a fresh
storage and copying every slot made the layouts a large share of the cache phase. A column or
slot that a layout leaves unwritten keeps what an earlier source left there: masked.
The tensors the step reads are torch's, on the engine's device; which slot holds what is NumPy, as
the batch's own state. On the CPU the writes go through NumPy views of the same memory, whose
indexed copies cost less per call than torch's; on a GPU through torch's indexing (_writable).
"""
from __future__ import annotations

import numpy as np
import torch

from export.spec import SOURCE_CLASSES
from training.seq2seq.model import EncoderState

from .storage import TwoStorages

COLUMNS = 8  # the source axis grows and shrinks in steps of this many columns
RECENT = 256  # the class bound is the median length of this many of the latest sources


class SourceClasses:
    """The encoder slots in length classes: a source up to the bound (the median length of the
    latest RECENT sources, in whole COLUMNS) goes to class 0, a longer one to class 1, each a
    SourceSlots with its own width (the longest source it holds). The decoder step attends over
    each class apart (Seq2Seq.step), so a short sentence's cross-attention reads its class's
    columns, not those of the longest source in the batch. Ad hoc, with 32 Multi30K sentences in
    flight: one width read 35.4 columns per sentence for 16.0 pieces, two classes 23.4 (2000
    draws); a 28-sentence int8 step ran 5% faster, the server under 64 callers 1.085x and 1.032x
    its one-class predecessor (two runs, each the median of 6 alternating rounds), the GRET server
    0.959x (within those rounds' noise). A sequence keeps its class and slot for life; its sentence
    in a step is its slot counted on from the classes before its own (state())."""

    def __init__(self, device: torch.device = torch.device("cpu")):
        self.device = device
        self.classes = [SourceSlots(device) for _ in range(SOURCE_CLASSES)]
        self.recent = np.zeros(0, np.int64)  # the latest sources' lengths, oldest first
        self.views: tuple[EncoderState, ...] = ()  # state()'s last

    @property
    def numpy_views(self) -> bool:
        return self.classes[0].numpy_views

    @numpy_views.setter
    def numpy_views(self, value: bool) -> None:
        for c in self.classes:
            c.numpy_views = value

    def put(self, enc: EncoderState) -> tuple[np.ndarray, np.ndarray]:
        """Write a batch of new sentences' states (enc: one entry each) into their classes' free
        slots; returns (each one's class, its slot)."""
        src_pad = host(enc.src_pad)
        lengths = src_pad.shape[1] - src_pad.sum(1)
        self.recent = np.concatenate([self.recent, lengths])[-RECENT:]
        klass = (lengths > whole_steps(int(median(self.recent)))).astype(np.int64)
        slots = np.zeros(len(lengths), np.int64)
        for c, store in enumerate(self.classes):
            sentences = np.flatnonzero(klass == c)
            if len(sentences):
                slots[sentences] = store.put(enc, sentences, lengths[sentences])
        return klass, slots

    def free(self, klass: np.ndarray, slots: np.ndarray) -> None:
        for c, store in enumerate(self.classes):
            if (klass == c).any():
                store.free(slots[klass == c])

    def compact(self, klass: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """SourceSlots.compact in every class; returns the sequences' slots (class klass, slot slots)
        where they are now."""
        slots = slots.copy()
        for c, store in enumerate(self.classes):
            moved = store.compact()
            if moved is not None:
                mine = klass == c
                slots[mine] = moved[slots[mine]]
        return slots

    def state(self) -> tuple[tuple[EncoderState, ...], np.ndarray]:
        """The states of the classes that hold sentences (SourceSlots.state), as one tuple object
        while theirs stay (the backend's decoder graph is the one of as many classes), and each
        class's first sentence in the step: a slot's sentence is the classes' slots before it."""
        used = [c.in_use() for c in self.classes]
        states = tuple(c.state(n) for c, n in zip(self.classes, used) if n)
        if len(states) != len(self.views) or any(a is not b for a, b in zip(states, self.views)):
            self.views = states
        return self.views, np.cumsum([0] + used[:-1])


class SourceSlots:
    def __init__(self, device: torch.device = torch.device("cpu")):
        self.device = device
        self.numpy_views = device.type == "cpu"  # writes through NumPy views; else torch's indexing (_writable)
        self.memory: torch.Tensor | None = None  # (2 x layers, slots, H, width, d_h): K at 2i, V at 2i + 1
        self.storages = TwoStorages(device)  # memory is a view of storages.live
        self.src_pad = torch.ones(0, 0, dtype=torch.bool, device=device)  # (slots, width) True = not a source piece
        self.global_state: torch.Tensor | None = None  # (slots, D), GRET only
        self.gate_source: torch.Tensor | None = None
        self.lengths = np.zeros(0, np.int64)  # each slot's source length; 0 = free
        self.views: tuple | None = None  # (memory, n, their state): state()

    @property
    def capacity(self) -> int:
        return len(self.lengths)

    @property
    def width(self) -> int:
        return self.src_pad.shape[1]

    def put(self, enc: EncoderState, sentences: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Write some new sentences' states (enc's `sentences`, of source lengths `lengths`) into free
        slots; returns them."""
        n = len(sentences)
        width = max(int(lengths.max()), 1)  # the columns past it are padding in all of them
        free = np.flatnonzero(self.lengths == 0)[:n]
        if len(free) < n:
            grown = max(2 * self.capacity, self.capacity + n - len(free), 8)
            self._layout(grown, max(self.width, whole_steps(width)), enc)
            free = np.flatnonzero(self.lengths == 0)[:n]
        elif width > self.width:
            self._layout(self.capacity, whole_steps(width), enc)
        memory = self._writable(self.memory)
        for plane, t in enumerate(t for kv in enc.memory for t in kv):
            memory[plane, free, :, :width] = self._incoming(t, sentences)[:, :, :width]
        slot_pad = self._writable(self.src_pad)
        slot_pad[free] = True
        slot_pad[free, :width] = self._incoming(enc.src_pad, sentences)[:, :width]
        for name in ("global_state", "gate_source"):
            if getattr(enc, name) is not None:
                self._writable(getattr(self, name))[free] = self._incoming(getattr(enc, name), sentences)
        self.lengths[free] = np.maximum(lengths, 1)  # a slot in use never reads as free
        return free

    def free(self, slots: np.ndarray) -> None:
        self.lengths[slots] = 0
        src_pad = self._writable(self.src_pad)
        src_pad[slots] = True
        src_pad[slots, 0] = False

    def state(self, n: int) -> EncoderState:
        """Slots 0..n-1 (n: in_use()) as the decoder step's per-sentence tensors (views, no copies):
        the same view objects while the layout (_layout replaces every tensor) and n stay, which the
        backend's binding recognises at once."""
        if self.views is None or self.views[0] is not self.memory or self.views[1] != n:
            self.views = (self.memory, n, self._views(n))
        return self.views[2]

    def _views(self, n: int) -> EncoderState:
        memory = [(self.memory[i, :n], self.memory[i + 1, :n]) for i in range(0, self.memory.shape[0], 2)]
        first = lambda t: None if t is None else t[:n]  # noqa: E731
        return EncoderState(memory, self.src_pad[:n], first(self.global_state), first(self.gate_source))

    def in_use(self) -> int:
        """The highest slot in use + 1."""
        used = np.flatnonzero(self.lengths)
        return int(used[-1]) + 1 if len(used) else 0

    def compact(self) -> np.ndarray | None:
        """Close holes once they are an eighth of the slots read, and give back source columns once
        the longest source has left; returns each old slot's new slot (capacity,), or None: nothing moved."""
        n, used = self.in_use(), int((self.lengths > 0).sum())
        if used:
            needed = whole_steps(int(self.lengths.max()))
            if needed + COLUMNS <= self.width:
                self._layout(self.capacity, needed)
        if n - used <= max(1, n // 8):
            return None
        high = np.flatnonzero(self.lengths[used:] > 0) + used
        low = np.flatnonzero(self.lengths[:used] == 0)
        memory = self._writable(self.memory)
        memory[:, low] = memory[:, high]
        for t in (self.src_pad, self.global_state, self.gate_source):
            if t is not None:
                a = self._writable(t)
                a[low] = a[high]
        self.lengths[low] = self.lengths[high]
        self.free(high)
        moved = np.arange(self.capacity)
        moved[high] = low
        return moved

    def _layout(self, slots: int, width: int, like: EncoderState | None = None) -> None:
        """A layout of `slots` x `width` in the spare storage, the slots up to the highest in use copied
        over (their columns up to width); the others are free, whatever their columns hold."""
        old = self.memory
        if old is None:
            planes = 2 * len(like.memory)
            _, heads, _, d_head = like.memory[0][0].shape
        else:
            planes, _, heads, _, d_head = old.shape
        self.memory = self.storages.next_layout((planes, slots, heads, width, d_head))
        src_pad = torch.ones(slots, width, dtype=torch.bool, device=self.device)
        src_pad[:, 0] = False
        lengths = np.zeros(slots, np.int64)
        keep, w = min(self.in_use(), slots), min(self.width, width)  # a free slot's columns are not its own
        if old is not None:
            self.memory[:, :keep, :, :w] = old[:, :keep, :, :w]
            src_pad[:keep, :w] = self.src_pad[:keep, :w]
            lengths[:keep] = self.lengths[:keep]
        for name in ("global_state", "gate_source"):
            t = getattr(self, name)
            source = getattr(like, name) if like is not None else None
            if t is None and source is None:
                continue
            fresh = torch.zeros(slots, (t if t is not None else source).shape[1], device=self.device)
            if t is not None:
                fresh[:keep] = t[:keep]
            setattr(self, name, fresh)
        self.src_pad, self.lengths = src_pad, lengths

    def _writable(self, t: torch.Tensor) -> np.ndarray | torch.Tensor:
        """What the slots' writes index: a NumPy view of the same memory on the CPU, the tensor itself
        on a GPU (NumPy index arrays index either)."""
        return t.numpy() if self.numpy_views else t

    def _incoming(self, t: torch.Tensor, sentences: np.ndarray) -> np.ndarray | torch.Tensor:
        """Some sentences of a new state's tensor, as _writable's targets take them."""
        if self.numpy_views:
            return host(t)[sentences]
        return t.to(self.device)[torch.from_numpy(sentences).to(self.device)]


def median(values: np.ndarray) -> float:
    """np.median's value (the mean of the middle two of an even count) in two NumPy calls, where
    np.median makes a dozen: 1.7 against 7.0 us over 256 lengths, warm (ad hoc), and more in an
    engine loop, whose memory is cold after each graph's run."""
    n = len(values)
    middle = np.partition(values, [(n - 1) // 2, n // 2])
    return (middle[(n - 1) // 2] + middle[n // 2]) / 2


def host(t: torch.Tensor) -> np.ndarray:
    """A tensor as NumPy: the same memory on CPU, a copy from an accelerator (a step's outputs)."""
    return t.detach().cpu().numpy()


def whole_steps(columns: int) -> int:
    """`columns` rounded up to a multiple of COLUMNS (at least one step)."""
    return max(1, -(-columns // COLUMNS)) * COLUMNS
