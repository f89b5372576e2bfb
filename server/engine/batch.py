"""The running batch: every live beam of every admitted sequence as one row of one decoder step.

Search state, in row order (rows of a sequence are contiguous; sequences in admission order):
  sources   each sequence's encoder state in a slot of its own, in its length class (source_slots.py;
            never tiled per beam), enc_class and enc_slot (S,) which class and slot
  row_seq   (R,) which sequence (index into `seqs` and `enc_slot`) a row belongs to
  tokens    (R,) each row's last token;  positions (R,) its next target position = keys cached
  scores    (R,) cumulative log-probability;  history (R, columns): row r's tokens so far in
            its first positions[r] columns
  counts, beams, limits, held  (S,) per sequence: its rows, beam size, output limit (EOS
            counted) and finished hypotheses so far
The self-attention cache lives in slots that do not move when sequences join or leave:
  kv        (2 x layers, slots, H, width, d_h): layer i's keys at 2i, its values at 2i + 1; row r
            keeps its t-th key in column t of slot `slot[r]`, positions[r] of them
A joining sequence takes free slots (nothing is copied); a leaving one frees its slots. The
decoder step writes each slot's new key and value in place, at its position, and reads only the
columns up to it (Seq2Seq.step), so a step costs what the rows hold whatever the width. The first
surviving child of a beam keeps its parent's slot; only a second child of the same parent copies
the parent's columns: into the slot of a sibling beam that ends at this step (the one whose
tokens share the longest prefix with the parent's: the columns of BOS and that prefix are the
same bytes in both, copied from one ancestor's, so only the columns after them are copied), else
into the lowest free slot. The step runs over slots 0..n-1 (the highest in use), so the top rows
are moved down into any empty slot below them at once (_close_up): an empty slot would be
computed and ignored at every step. The storage grows (slots, and columns in steps of COLUMNS)
as needed and is kept when the batch empties: since width costs a step nothing, it is never
narrowed again. A resize lays the cache out anew in the spare of two kept storages (storage.py;
the PyTorch step masks the columns past a row's position).

The search rule is training.seq2seq.beam's, as in training.seq2seq.search.beam_search: candidates are the top
2 x beam of (row score + log-probability) over the sequence's rows; an EOS (or any token at the
length limit) ranked inside the beam finishes a hypothesis, the best non-finishing candidates
refill the beam; a sequence is done once it holds `beam` finished hypotheses, reaches its limit,
or has no candidate left. It runs as array operations over all rows of all sequences at once;
Python touches only the hypotheses that finish and the sequences that end. At its first step a
sequence has one row (BOS), not `beam` copies.

The search state above is NumPy; only what the decoder step reads or writes (the cache, the encoder
slots, the step's inputs) is torch's. The state is a few hundred numbers, on which a call costs its
overhead, not its work: so the per-step work over all rows (the rule's step, the children's slots and
copies, the step's inputs by slot) is compiled with Numba, one call each, and Python is left the
hypotheses that finish and the sequences that end: a NumPy call's fixed cost grows with the caches
cold after a decoder step, and the search and bookkeeping made dozens of them between two steps.

A step is two calls, timed apart by the engine: search() decides (candidates from the top-k that
the backend's step picked, finished hypotheses), advance() moves the rows into their next state
(history, the forked beams' cache slots, the encoder slots of sequences that ended).
"""
from __future__ import annotations

from typing import NamedTuple

import numba
import numpy as np
import torch

from training.seq2seq.beam import (NEG_INF, Candidates, Hypothesis, candidates_kernel, first_rows, force_prefix,
                                  host_top_k, select_kernel)
from training.seq2seq.model import EncoderState

from .sequence import Sequence
from .source_slots import SourceClasses
from .storage import TwoStorages

COLUMNS = 16  # the cache's width grows and shrinks in steps of this many columns


class Choice(NamedTuple):
    """One step's decisions (Batch.search), for Batch.advance to apply."""
    rows: np.ndarray  # the rows (old indices) whose children survive, in order
    tokens: np.ndarray  # each child's token
    scores: np.ndarray  # each child's score
    counts: np.ndarray  # rows per sequence that goes on
    alive: np.ndarray  # the sequences that go on (old indices)
    ended: list[Sequence]  # the sequences that finished


class Batch:
    def __init__(self, cfg, n_heads: int, d_head: int, device: torch.device):
        self.cfg, self.n_heads, self.d_head, self.device = cfg, n_heads, d_head, device
        self.compiled_copies = device.type == "cpu"  # forks copy cache columns in Numba; else with torch (_copy_slots)
        self.seqs: list[Sequence] = []
        self.counts, self.beams, self.limits, self.held = (np.empty(0, np.int64) for _ in range(4))
        self.constrained = 0  # sequences with min_length, no_repeat_ngram or a prefix: _constrain's work
        self.sources = SourceClasses(device)
        self.enc_class, self.enc_slot = np.empty(0, np.int64), np.empty(0, np.int64)
        self.row_seq = np.empty(0, np.int64)
        self.tokens = np.empty(0, np.int64)
        self.positions = np.empty(0, np.int64)
        self.scores = np.empty(0, np.float32)
        self.history = np.empty((0, COLUMNS), np.int64)
        self.slot = np.empty(0, np.int64)
        self.kv: torch.Tensor | None = None  # a view of the front of storages.live
        self.storages = TwoStorages(device)
        self.views: tuple | None = None  # (kv, n, the step's cache views): _cache_views
        self.row_sentence: torch.Tensor | None = None  # the last step's, the same object while its values stay

    @property
    def rows(self) -> int:
        return len(self.tokens)

    def __len__(self) -> int:
        return len(self.seqs)

    def budget_used(self) -> int:
        return sum(s.rows_budget for s in self.seqs)

    # ---- admission ------------------------------------------------------------------------
    def join(self, seqs: list[Sequence], enc: EncoderState) -> None:
        """Append newly encoded sequences (enc: one entry each), one BOS row per sequence."""
        n = len(seqs)
        first = len(self.seqs)
        self.slot = np.concatenate([self.slot, self._free_slots(n, self.slot)])
        self.row_seq = np.concatenate([self.row_seq, np.arange(first, first + n)])
        self.tokens = np.concatenate([self.tokens, np.full(n, self.cfg.bos_id, np.int64)])
        self.positions = np.concatenate([self.positions, np.zeros(n, np.int64)])
        self.scores = np.concatenate([self.scores, np.zeros(n, np.float32)])
        self.history = np.concatenate([self.history, np.zeros((n, self.history.shape[1]), np.int64)])
        self.seqs += seqs
        self.counts = np.concatenate([self.counts, np.ones(n, np.int64)])
        self.beams = np.concatenate([self.beams, np.array([s.options.beam for s in seqs], np.int64)])
        self.limits = np.concatenate([self.limits, np.array([s.max_len for s in seqs], np.int64)])
        self.held = np.concatenate([self.held, np.zeros(n, np.int64)])
        self.constrained += sum(map(constrained, seqs))
        klass, slots = self.sources.put(enc)
        self.enc_class, self.enc_slot = np.concatenate([self.enc_class, klass]), np.concatenate([self.enc_slot, slots])

    # ---- one step --------------------------------------------------------------------------
    def step_inputs(self) -> tuple:
        """The decoder's inputs over slots 0..n-1: (tokens, positions, row_sentence, enc, cache,
        top_k); an empty slot has row_sentence -1 and position 0. A row's sentence is its
        sequence's encoder slot, counted over the length classes (SourceClasses.state); top_k is
        the candidates a row needs: twice the widest beam. The cache has a column free at every
        row's position, where the step writes."""
        last = self.row_sentence.numpy() if self.row_sentence is not None else np.empty(0, np.int64)
        enc, first = self.sources.state()
        tokens, positions, row_sentence, same = slot_inputs(self.slot, self.tokens, self.positions,
                                                            (first[self.enc_class] + self.enc_slot)[self.row_seq], last)
        self._reserve(int(positions.max()) + 1, 0)
        n = len(tokens)
        if not same:
            self.row_sentence = torch.from_numpy(row_sentence)  # never written again: the backend keeps what it derives
        cache = self._cache_views(n)
        top_k = min(2 * int(self.beams.max()), self.cfg.vocab_size)
        return torch.from_numpy(tokens), torch.from_numpy(positions), self.row_sentence, enc, cache, top_k

    def _cache_views(self, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's keys and values over slots 0..n-1: the same view objects while the storage
        and n stay, which the backend's binding recognises without looking into them."""
        if self.views is None or self.views[0] is not self.kv or self.views[1] != n:
            layers = [(self.kv[2 * i, :n], self.kv[2 * i + 1, :n]) for i in range(self.cfg.dec_layers)]
            self.views = (self.kv, n, layers)
        return self.views[2]

    @property
    def width(self) -> int:
        return self.kv.shape[3] if self.kv is not None else 0

    @property
    def capacity(self) -> int:
        return self.kv.shape[1] if self.kv is not None else 0

    def search(self, log_probs: torch.Tensor, top: tuple[np.ndarray, np.ndarray]) -> Choice:
        """One step's decisions from its log-probabilities (slots, V) and each slot's top_k best
        (log-probabilities, tokens) (slots, top_k), NumPy, per slot as step_inputs ordered them: finished
        hypotheses join their sequences, the rest is for advance()."""
        top_log_probs, top_tokens = top
        k = top_tokens.shape[1]
        if self.constrained:  # the constraints change some log-probabilities: their top_k is chosen again
            top_log_probs, top_tokens = host_top_k(self._constrain(log_probs.float()), k)
        scores, rows, tokens, finishing, kept, done, length = decide(
            self.scores, top_log_probs, top_tokens, self.slot, self.counts, self.positions, self.limits,
            self.beams, self.held, self.cfg.eos_id, k)
        # Most steps finish no hypothesis and end no sequence: those skip the bookkeeping for them.
        if finishing.any():
            self.held = self.held + finishing.sum(1)
            self._finish_hypotheses(Candidates(scores, rows, tokens), finishing)
        ended = []
        if done.any():
            ended = [self.seqs[i] for i in np.flatnonzero(done).tolist()]
            for seq, steps in zip(ended, length[done].tolist()):
                seq.step = steps
        return Choice(*children(rows, tokens, scores, kept, done), ended)

    def advance(self, choice: Choice) -> list[Sequence]:
        """Apply search()'s choice after the step (which wrote its keys/values into the cache);
        returns the sequences that finished (already removed from the batch; their on_done is the
        caller's to trigger)."""
        self._reorder(*choice, stepped=True)
        return choice.ended

    def remove(self, dropped: set[int]) -> None:
        """Take sequences (by index) out of the batch without a step: cancelled or expired."""
        keep = np.ones(len(self.seqs), bool)
        keep[list(dropped)] = False
        leaving = [self.seqs[i] for i in sorted(dropped)]
        for seq, steps in zip(leaving, self.positions[first_rows(self.counts)][~keep].tolist()):
            seq.step = steps
        rows = np.flatnonzero(keep[self.row_seq])
        self._reorder(rows, self.tokens[rows], self.scores[rows], self.counts[keep], np.flatnonzero(keep), leaving,
                      stepped=False)

    # ---- internals -------------------------------------------------------------------------
    def _finish_hypotheses(self, cand, finishing: np.ndarray) -> None:
        """Add the hypotheses that candidates `finishing` (S, K) end to their sequences."""
        eos = self.cfg.eos_id
        for i, row, token, score in zip(finishing.nonzero()[0].tolist(), cand.rows[finishing].tolist(),
                                        cand.tokens[finishing].tolist(), cand.scores[finishing].tolist()):
            seq = self.seqs[i]
            prefix = self.history[row, :self.positions[row]].tolist()
            seq.finished.append(Hypothesis.ending(prefix, token, score, seq.options.length_penalty, eos))

    def _constrain(self, log_probs: torch.Tensor) -> torch.Tensor:
        """A target prefix (forced while the step is inside it; training.seq2seq.beam.force_prefix), else
        min_length (no EOS before that many tokens) and no_repeat_ngram, per row (log_probs are per
        slot); rare options, so plain Python over the sequences that have them."""
        starts = first_rows(self.counts).tolist()
        for i, seq in enumerate(self.seqs):
            if not constrained(seq):
                continue
            rows = range(starts[i], starts[i] + int(self.counts[i]))
            slots, step = torch.from_numpy(self.slot[starts[i]: rows.stop]), int(self.positions[starts[i]])
            if step < len(seq.options.prefix):
                force_prefix(log_probs, slots, seq.options.prefix[step])
                continue
            if step < seq.options.min_length:
                log_probs[slots, self.cfg.eos_id] = NEG_INF
            n = seq.options.no_repeat_ngram
            for r, slot in zip(rows, slots.tolist()) if n and step >= n - 1 else ():
                banned = banned_tokens(self.history[r, :step].tolist(), n)
                if banned:
                    log_probs[slot, banned] = NEG_INF
        return log_probs

    def _reorder(self, rows: np.ndarray, tokens: np.ndarray, scores: np.ndarray, counts: np.ndarray,
                 alive: np.ndarray, leaving: list[Sequence], stepped: bool) -> None:
        """Rows `rows` (old indices) survive, in order, as beams of sequences `alive`, `leaving`
        are gone; after a step each row is its parent's child, one token longer."""
        if stepped:
            slot, positions, history, forks, parents, shared = next_rows(self.slot, self.positions, self.history,
                                                                         self.row_seq, rows, tokens, self.capacity)
            if len(forks):  # a parent's later children copy its slot's columns into theirs
                self._reserve(0, int(slot[forks].max()) + 1)  # (the slots in use are still the parents')
                self._copy_slots(parents, slot[forks], shared, positions[forks])
        else:
            slot, positions, history = self.slot[rows], self.positions[rows], self.history[rows]
        self.slot, self.history, self.positions, self.tokens, self.scores = slot, history, positions, tokens, scores
        self.row_seq, self.counts = np.repeat(np.arange(len(alive)), counts), counts
        if leaving:
            self.seqs = [self.seqs[i] for i in alive.tolist()]
            self.beams, self.limits, self.held = self.beams[alive], self.limits[alive], self.held[alive]
            self.constrained -= sum(map(constrained, leaving))
            gone = np.ones(len(self.enc_slot), bool)
            gone[alive] = False
            self.sources.free(self.enc_class[gone], self.enc_slot[gone])
            self.enc_class = self.enc_class[alive]
            self.enc_slot = self.sources.compact(self.enc_class, self.enc_slot[alive])
        if len(alive):  # else the storage stays as it is for the next sequences
            self._close_up()

    def _copy_slots(self, sources: np.ndarray, targets: np.ndarray, starts: np.ndarray, columns: np.ndarray) -> None:
        """Slot targets[i] <- slot sources[i], its columns starts[i] to columns[i] - 1 (those before are
        the same bytes already, those after are not its own): rows of a running batch are at every
        step of their texts, and a young row's fork moves a few columns, not the oldest row's. The
        two sets never meet."""
        if self.compiled_copies:
            copy_columns(self.kv.numpy(), sources, targets, starts, columns)
            return
        # an accelerator's cache: compiled (Numba CPU) code cannot reach it
        for source, target, start, n in zip(sources.tolist(), targets.tolist(), starts.tolist(), columns.tolist()):
            self.kv[:, target, :, start:n] = self.kv[:, source, :, start:n]

    def _free_slots(self, n: int, taken: np.ndarray) -> np.ndarray:
        """The n lowest slots not in `taken`, growing the slots if there are too few."""
        free = lowest_free(taken, n, self.capacity)
        self._reserve(0, int(free.max()) + 1 if n else 0)
        return free

    def _reserve(self, columns: int, slots: int) -> None:
        """At least `columns` columns and `slots` slots."""
        old_slots, old_width = self.capacity, self.width
        if slots <= old_slots and columns <= old_width:
            return
        new_slots = max(slots, 2 * old_slots, 8) if slots > old_slots else old_slots
        self._resize(new_slots, whole_steps(max(columns, old_width, 1)))

    def _resize(self, slots: int, width: int) -> None:
        """The cache laid out anew in the spare storage, with the slots in use (up to the highest in
        `slot`) copied over; each storage stays at most the largest cache the batch has needed (two
        of them: the memory bound)."""
        kv = self.storages.next_layout((2 * self.cfg.dec_layers, slots, self.n_heads, width, self.d_head))
        if self.kv is not None and len(self.slot):
            used, w = int(self.slot.max()) + 1, min(width, self.width)
            kv[:, :used, :, :w] = self.kv[:, :used, :, :w]
        self.kv = kv

    def _close_up(self) -> None:
        """Move the rows in the highest slots down into the empty ones below them, whenever there
        are any: an empty slot costs a whole row of every step until a row fills it, where moving a
        row copies only the columns it holds, once (under 64 callers a tolerance of an eighth left
        3% of the computed rows empty)."""
        rows, n = self.rows, int(self.slot.max()) + 1
        if n == rows:
            return
        high = np.flatnonzero(self.slot >= rows)
        free = self._free_slots(len(high), self.slot)
        self._copy_slots(self.slot[high], free, np.zeros(len(high), np.int64), self.positions[high])
        self.slot[high] = free


@numba.njit(cache=True, nogil=True)
def decide(row_scores, top_log_probs, top_tokens, slot, counts, positions, limits, beams, held, eos: int, k: int):
    """The rule's step (training.seq2seq.beam) over the batch's rows, whose top-k are read at their
    slots: (candidates' scores, rows, tokens; finishing, kept, done; each sequence's length after it)."""
    scores, rows, tokens = candidates_kernel(row_scores, top_log_probs[slot], top_tokens[slot], counts, k)
    length = positions[first_rows(counts)] + 1
    finishing, kept, done = select_kernel(scores, tokens == eos, length >= limits, beams, held)
    return scores, rows, tokens, finishing, kept, done, length


@numba.njit(cache=True, nogil=True)
def children(rows, tokens, scores, kept, done):
    """The next step's rows, Choice's arrays: the kept candidates of the sequences that go on, in
    order (rows, tokens, scores), how many each of them keeps, and which they are (old indices)."""
    alive = np.flatnonzero(~done)
    counts = np.zeros(len(alive), np.int64)
    for a in range(len(alive)):
        counts[a] = kept[alive[a]].sum()
    n = counts.sum()
    child_rows, child_tokens, child_scores = np.empty(n, np.int64), np.empty(n, tokens.dtype), \
        np.empty(n, scores.dtype)
    c = 0
    for i in alive:
        for j in range(kept.shape[1]):
            if kept[i, j]:
                child_rows[c], child_tokens[c], child_scores[c] = rows[i, j], tokens[i, j], scores[i, j]
                c += 1
    return child_rows, child_tokens, child_scores, counts, alive


@numba.njit(cache=True, nogil=True)
def next_rows(slot, positions, history, row_seq, rows, tokens, capacity: int):
    """After a step, rows `rows` (old indices) go on, each its parent's child with its token in
    `tokens` appended: (their slots, positions, history; the children that fork, their parents'
    slots and the columns their own slots already hold: fork_slots)."""
    child_slot, forks, shared = fork_slots(rows, slot, row_seq, positions, history, capacity)
    parent_positions = positions[rows]
    history = extended_history(history, rows, parent_positions, tokens)
    return child_slot, parent_positions + 1, history, forks, slot[rows][forks], shared


@numba.njit(cache=True, nogil=True)
def fork_slots(rows, slot, row_seq, positions, history, capacity: int):
    """(each child's slot, the children that fork, the columns each fork's slot already holds) for
    children of the old rows `rows`, in order, after a step. A parent's first child keeps its slot.
    A later child takes the slot of a row of the same sequence that has no child (of those no other
    child took, the one whose tokens share the longest prefix with its parent's): the columns
    whose inputs lie in BOS + the prefix are the same bytes in both, copied from one ancestor's
    (the step has just written the last of them in both). Where no such row is left, it takes
    the lowest slot no child keeps or took, past `capacity` if need be."""
    n_rows = len(slot)
    taken = np.zeros(capacity, np.bool_)
    has_child = np.zeros(n_rows, np.bool_)
    first = np.zeros(len(rows), np.bool_)
    for i in range(len(rows)):
        has_child[rows[i]] = True
        if not taken[slot[rows[i]]]:
            taken[slot[rows[i]]] = first[i] = True
    child_slot, forks = slot[rows], np.flatnonzero(~first)
    shared = np.zeros(len(forks), np.int64)
    unplaced = np.zeros(len(forks), np.bool_)
    for f in range(len(forks)):
        parent = rows[forks[f]]
        best, common, row = -1, 0, parent
        while row > 0 and row_seq[row - 1] == row_seq[parent]:  # a sequence's rows are contiguous
            row -= 1
        while row < n_rows and row_seq[row] == row_seq[parent]:
            if not has_child[row] and not taken[slot[row]]:  # (a sequence's rows share their position)
                k, n = 0, positions[parent]
                while k < n and history[parent, k] == history[row, k]:
                    k += 1
                if best < 0 or k > common:
                    best, common = row, k
            row += 1
        if best < 0:
            unplaced[f] = True
        else:
            child_slot[forks[f]] = slot[best]
            taken[slot[best]] = True
            shared[f] = common + 1
    rest = forks[np.flatnonzero(unplaced)]
    child_slot[rest] = lowest_free(np.flatnonzero(taken), len(rest), capacity)
    return child_slot, forks, shared


@numba.njit(cache=True, nogil=True)
def lowest_free(taken: np.ndarray, n: int, capacity: int) -> np.ndarray:
    """The n lowest slots not in `taken` (slots below `capacity`), counting on past `capacity` where
    too few are free below it."""
    used = np.zeros(capacity, np.bool_)
    used[taken] = True
    free, slot = np.empty(n, np.int64), 0
    for i in range(n):
        while slot < capacity and used[slot]:
            slot += 1
        free[i] = slot
        slot += 1
    return free


@numba.njit(cache=True, nogil=True)
def copy_columns(kv: np.ndarray, sources: np.ndarray, targets: np.ndarray, starts: np.ndarray,
                 columns: np.ndarray) -> None:
    """kv (planes, slots, H, width, d_h): slot targets[i] <- slot sources[i], columns starts[i] to
    columns[i] - 1; one contiguous block per plane and head (NumPy copies the 5-D view's strided
    slices more slowly)."""
    for i in range(len(sources)):
        a, n = starts[i], columns[i]
        for plane in range(kv.shape[0]):
            for head in range(kv.shape[2]):
                kv[plane, targets[i], head, a:n] = kv[plane, sources[i], head, a:n]


def constrained(seq: Sequence) -> bool:
    """Whether its options need _constrain."""
    return bool(seq.options.min_length or seq.options.no_repeat_ngram or seq.options.prefix)


@numba.njit(cache=True, nogil=True)
def extended_history(history: np.ndarray, rows: np.ndarray, positions: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """Rows `rows` of `history`, each with its token written at its position, in whole steps of
    COLUMNS that hold the longest (the columns past a row's position are not its own)."""
    width = whole_steps(positions.max() + 1 if len(rows) else 1)
    kept = min(width, history.shape[1])
    out = np.zeros((len(rows), width), history.dtype)
    for i in range(len(rows)):
        out[i, :kept] = history[rows[i], :kept]
        out[i, positions[i]] = tokens[i]
    return out


@numba.njit(cache=True, nogil=True)
def slot_inputs(slot: np.ndarray, tokens: np.ndarray, positions: np.ndarray, sentence: np.ndarray,
                last_row_sentence: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
    """The rows' tokens, positions and sentences, laid out by slot over slots 0..n-1 (an empty slot:
    token 0, position 0, sentence -1), and whether the sentences equal the last step's."""
    n = slot.max() + 1
    by_slot_tokens, by_slot_positions = np.zeros(n, np.int64), np.zeros(n, np.int64)
    row_sentence = np.full(n, -1, np.int64)
    for i in range(len(slot)):
        s = slot[i]
        by_slot_tokens[s], by_slot_positions[s], row_sentence[s] = tokens[i], positions[i], sentence[i]
    same = len(last_row_sentence) == n and (last_row_sentence == row_sentence).all()
    return by_slot_tokens, by_slot_positions, row_sentence, same


@numba.njit(cache=True)
def whole_steps(columns: int) -> int:
    """`columns` rounded up to a multiple of COLUMNS."""
    return -(-columns // COLUMNS) * COLUMNS


def banned_tokens(history: list[int], n: int) -> list[int]:
    """Tokens that would complete an n-gram already present in `history`."""
    prefix = tuple(history[len(history) - n + 1:]) if n > 1 else ()
    return [history[i + n - 1] for i in range(len(history) - n + 1) if tuple(history[i: i + n - 1]) == prefix]
