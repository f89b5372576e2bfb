"""The running batch: every live beam of every admitted sequence as one row of one decoder step.

Search state, in row order (rows of a sequence are contiguous; sequences in admission order):
  enc       EncoderState with one entry per sequence (never tiled per beam)
  row_seq   (R,) which sequence (index into `seqs`, and into enc) a row belongs to
  tokens    (R,) each row's last token;  positions (R,) its next target position = keys cached
  scores    (R,) cumulative log-probability;  history: each row's tokens so far
The self-attention cache lives in slots that do not move when sequences join or leave:
  kv        (2 x layers, slots, H, width, d_h): layer i's keys at 2i, its values at 2i + 1; row r
            keeps its t-th key in column t of slot `slot[r]`; columns >= positions[r] are masked
A joining sequence takes free slots (nothing is copied); a leaving one frees its slots. After a
step the first surviving child of a beam keeps its parent's slot and gets the step's key written
in place; only a second child of the same parent copies the parent's slot. The decoder step runs
over slots 0..n-1 (the highest in use); empty slots among them are computed and ignored, and
are refilled first, or closed up by moving the top rows down once they are many. The storage
grows (slots, and columns in steps of COLUMNS) as needed, gives columns back when the longest
row leaves, and is kept when the batch empties.

The search rules are training.search.beam_search's, per sequence: candidates are the top
2 x beam of (row score + log-probability) over the sequence's rows; an EOS (or any token at the
length limit) ranked inside the beam finishes a hypothesis, the best non-finishing candidates
refill the beam; a sequence is done once it holds `beam` finished hypotheses, reaches its limit,
or has no candidate left. At its first step a sequence has one row (BOS), not `beam` copies.
"""
from __future__ import annotations

import torch

from kernels.encoder_cache import stack_states
from training.model import EncoderState

from .sequence import Hypothesis, Sequence
from .topk import row_topk

NEG_INF = float("-inf")
COLUMNS = 16  # the cache's width grows and shrinks in steps of this many columns


class Batch:
    def __init__(self, cfg, n_heads: int, d_head: int, device: torch.device):
        self.cfg, self.n_heads, self.d_head, self.device = cfg, n_heads, d_head, device
        self.seqs: list[Sequence] = []
        self.counts: list[int] = []  # rows per sequence
        self.enc: EncoderState | None = None
        self.row_seq = torch.empty(0, dtype=torch.long)
        self.tokens = torch.empty(0, dtype=torch.long)
        self.positions = torch.empty(0, dtype=torch.long)
        self.scores = torch.empty(0, dtype=torch.float32)
        self.history: list[list[int]] = []
        self.slot = torch.empty(0, dtype=torch.long)
        self.kv: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        return len(self.history)

    def __len__(self) -> int:
        return len(self.seqs)

    def budget_used(self) -> int:
        return sum(s.rows_budget for s in self.seqs)

    # ---- admission ------------------------------------------------------------------------
    def join(self, seqs: list[Sequence], enc: EncoderState) -> None:
        """Append newly encoded sequences (enc: one entry each), one BOS row per sequence."""
        n = len(seqs)
        first = len(self.seqs)
        self.slot = torch.cat([self.slot, self._free_slots(n, self.slot)])
        self.row_seq = torch.cat([self.row_seq, torch.arange(first, first + n)])
        self.tokens = torch.cat([self.tokens, torch.full((n,), self.cfg.bos_id, dtype=torch.long)])
        self.positions = torch.cat([self.positions, torch.zeros(n, dtype=torch.long)])
        self.scores = torch.cat([self.scores, torch.zeros(n)])
        self.history += [[] for _ in range(n)]
        self.seqs += seqs
        self.counts += [1] * n
        self.enc = enc if self.enc is None else stack_states([self.enc, enc])

    # ---- one step --------------------------------------------------------------------------
    def step_inputs(self) -> tuple:
        """The decoder's inputs over slots 0..n-1: (tokens, positions, row_sentence, past_pad, enc,
        cache); an empty slot has row_sentence -1 and no column of its own."""
        n = int(self.slot.max()) + 1
        tokens = torch.zeros(n, dtype=torch.long).index_copy_(0, self.slot, self.tokens)
        positions = torch.zeros(n, dtype=torch.long).index_copy_(0, self.slot, self.positions)
        row_sentence = torch.full((n,), -1, dtype=torch.long).index_copy_(0, self.slot, self.row_seq)
        past_pad = torch.arange(self.width)[None] >= positions[:, None]
        cache = [(self.kv[2 * i, :n], self.kv[2 * i + 1, :n]) for i in range(self.cfg.dec_layers)]
        return tokens, positions, row_sentence, past_pad, self.enc, cache

    @property
    def width(self) -> int:
        return self.kv.shape[3] if self.kv is not None else 0

    @property
    def capacity(self) -> int:
        return self.kv.shape[1] if self.kv is not None else 0

    def advance(self, log_probs: torch.Tensor, new_kv: torch.Tensor) -> list[Sequence]:
        """Apply one step's log-probabilities (slots, V) and keys/values (2 x layers, slots, H, 1,
        d_h), per slot as step_inputs ordered them; returns the sequences that finished (already
        removed from the batch; their on_done is the caller's to trigger)."""
        log_probs = self._constrain(log_probs.float())
        vocab = log_probs.shape[1]
        beam_max = max(s.options.beam for s in self.seqs)
        # Two-stage top-k: the best 2*beam tokens of each row, then the best 2*beam of each
        # sequence among its rows' candidates (the same set as one top-k over rows x vocab).
        # A row's score shifts all its tokens alike, so it is added after the first stage.
        row_scores, row_tokens = row_topk()(log_probs, min(2 * beam_max, vocab))
        row_scores, row_tokens = row_scores.index_select(0, self.slot), row_tokens.index_select(0, self.slot)
        row_scores += self.scores[:, None]
        per_row = row_scores.shape[1]
        counts = torch.tensor(self.counts)
        starts = torch.cumsum(counts, 0) - counts
        slots = torch.arange(max(self.counts))
        index = torch.where(slots < counts[:, None], starts[:, None] + slots, self.rows)  # R: the -inf row
        starts = starts.tolist()
        padded = torch.cat([row_scores, row_scores.new_full((1, per_row), NEG_INF)])[index].view(len(self.seqs), -1)
        k = min(2 * beam_max, padded.shape[1])
        top_scores, top_pos = padded.topk(k, dim=1)
        top_scores, top_pos = top_scores.tolist(), top_pos.tolist()
        row_tokens = row_tokens.tolist()

        eos = self.cfg.eos_id
        keep_rows, new_tokens, new_scores, new_counts, alive, done = [], [], [], [], [], []
        for i, seq in enumerate(self.seqs):
            beam, length = seq.options.beam, seq.step + 1
            last = length >= seq.max_len
            filled = 0
            for j in range(min(2 * beam, k)):
                s = top_scores[i][j]
                if s == NEG_INF:
                    break
                row = starts[i] + top_pos[i][j] // per_row
                t = row_tokens[row][top_pos[i][j] % per_row]
                if t == eos or last:
                    if j < beam:  # only candidates that rank inside the beam may finish
                        tokens = self.history[row] + ([] if t == eos else [t])
                        seq.finished.append(Hypothesis(tokens, s / length ** seq.options.length_penalty, s))
                    continue
                if filled < beam:
                    keep_rows.append(row)
                    new_tokens.append(t)
                    new_scores.append(s)
                    filled += 1
            seq.step = length
            if len(seq.finished) >= beam or last or filled == 0:
                del keep_rows[len(keep_rows) - filled:], new_tokens[len(new_tokens) - filled:]
                del new_scores[len(new_scores) - filled:]
                done.append(seq)
            else:
                alive.append(i)
                new_counts.append(filled)
        self._reorder(keep_rows, new_tokens, new_scores, new_counts, alive, new_kv)
        return done

    def remove(self, dropped: set[int]) -> None:
        """Take sequences (by index) out of the batch without a step: cancelled or expired."""
        keep = [i for i in range(len(self.seqs)) if i not in dropped]
        rows, r = [], 0
        for i, c in enumerate(self.counts):
            if i not in dropped:
                rows += range(r, r + c)
            r += c
        counts = [self.counts[i] for i in keep]
        self._reorder(rows, self.tokens[rows].tolist(), self.scores[rows].tolist(), counts, keep, None)

    # ---- internals -------------------------------------------------------------------------
    def _constrain(self, log_probs: torch.Tensor) -> torch.Tensor:
        """min_length (no EOS before that many tokens) and no_repeat_ngram, per row (log_probs
        are per slot)."""
        constrained = [i for i, s in enumerate(self.seqs) if s.step < s.options.min_length or s.options.no_repeat_ngram]
        if not constrained:  # the common case: nothing to do per row
            return log_probs
        starts = [0]
        for c in self.counts:
            starts.append(starts[-1] + c)
        slot = self.slot.tolist()
        for i in constrained:
            seq, rows = self.seqs[i], range(starts[i], starts[i + 1])
            if seq.step < seq.options.min_length:
                log_probs[[slot[r] for r in rows], self.cfg.eos_id] = NEG_INF
            n = seq.options.no_repeat_ngram
            for r in rows if n else ():
                banned = banned_tokens(self.history[r], n) if len(self.history[r]) >= n - 1 else []
                if banned:
                    log_probs[slot[r], banned] = NEG_INF
        return log_probs

    def _reorder(self, rows: list[int], tokens: list[int], scores: list[float], counts: list[int],
                 alive: list[int], new_kv: torch.Tensor | None) -> None:
        """Rows `rows` (old indices) survive, in order, as beams of sequences `alive`; with
        new_kv (after a step) each is its parent's child, one token longer."""
        index = torch.tensor(rows, dtype=torch.long)
        parents = self.slot.index_select(0, index)
        positions = self.positions.index_select(0, index)
        if new_kv is not None:
            self.slot = self._place_children(parents, positions, new_kv)
            positions = positions + 1
            self.history = [self.history[r] + [t] for r, t in zip(rows, tokens)]
        else:
            self.slot = parents
            self.history = [self.history[r] for r in rows]
        self.positions = positions
        self.tokens = torch.tensor(tokens, dtype=torch.long)
        self.scores = torch.tensor(scores, dtype=torch.float32)
        self.row_seq = torch.repeat_interleave(torch.arange(len(alive)), torch.tensor(counts, dtype=torch.long))
        self.counts = counts
        if len(alive) < len(self.seqs):
            self.seqs = [self.seqs[i] for i in alive]
            self.enc = trim_source(self.enc.select(torch.tensor(alive, dtype=torch.long))) if alive else None
        if not alive:  # the storage stays for the next sequences
            self.enc = None
            return
        self._close_up()
        self._fit_width()

    def _place_children(self, parents: torch.Tensor, positions: torch.Tensor, new_kv: torch.Tensor) -> torch.Tensor:
        """Slots for children of slots `parents` (their parents' positions `positions`): every
        slot's step key/value is written in place at its position (an empty or dropped slot's
        lands in a column nobody reads); a parent's first child keeps the slot, the others get
        a copy in a free slot."""
        planes, n = new_kv.shape[0], new_kv.shape[1]
        at = torch.zeros(n, dtype=torch.long).index_copy_(0, self.slot, self.positions)
        self._reserve(int(at.max()) + 1, 0)
        # (plane p, slot s, head h, column c) is row ((p * slots + s) * H + h) * width + c of kv as (-1, d_h)
        rows = (torch.arange(planes)[:, None, None] * self.capacity + torch.arange(n)[:, None]) * self.n_heads
        rows = (rows + torch.arange(self.n_heads)) * self.width + at[:, None]
        self.kv.view(-1, self.d_head).index_copy_(0, rows.flatten(), new_kv.reshape(-1, self.d_head))
        first = torch.ones(len(parents), dtype=torch.bool)
        if len(parents):
            order = torch.sort(parents, stable=True).indices
            sorted_parents = parents[order]
            first[order[1:]] = sorted_parents[1:] != sorted_parents[:-1]
        forks = (~first).nonzero()[:, 0]
        slot = parents.clone()
        if len(forks):
            free = self._free_slots(len(forks), parents[first])
            self._copy_slots(parents.index_select(0, forks), free, int(positions.index_select(0, forks).max()) + 1)
            slot[forks] = free
        return slot

    def _copy_slots(self, sources: torch.Tensor, targets: torch.Tensor, columns: int) -> None:
        """Slot targets[i] <- slot sources[i], the first `columns` columns (the rest are not theirs)."""
        for plane in self.kv:  # plane by plane: a copy along the first axis is the fast one
            plane = plane.narrow(2, 0, columns)
            plane.index_copy_(0, targets, plane.index_select(0, sources))

    def _free_slots(self, n: int, taken: torch.Tensor) -> torch.Tensor:
        """The n lowest slots not in `taken`, growing the slots if there are too few."""
        used = torch.zeros(self.capacity + n, dtype=torch.bool)
        used[taken] = True
        free = (~used).nonzero()[:n, 0]
        self._reserve(0, int(free.max()) + 1 if n else 0)
        return free

    def _reserve(self, columns: int, slots: int) -> None:
        """At least `columns` columns and `slots` slots (new storage is zeros: a masked key must
        still be a finite number)."""
        old_slots, old_width = self.capacity, self.width
        if slots <= old_slots and columns <= old_width:
            return
        new_slots = max(slots, 2 * old_slots, 8) if slots > old_slots else old_slots
        self._resize(new_slots, whole_steps(max(columns, old_width, 1)))

    def _fit_width(self) -> None:
        """Give columns back once the longest row leaves many unused: attention reads them all."""
        needed = whole_steps(int(self.positions.max()) + 1)
        if needed + COLUMNS <= self.width:  # not at the first column spare: rows grow back into it
            self._resize(self.capacity, needed)

    def _resize(self, slots: int, width: int) -> None:
        """New storage, with the slots in use (up to the highest in `slot`) copied over."""
        kv = torch.zeros(2 * self.cfg.dec_layers, slots, self.n_heads, width, self.d_head, device=self.device)
        if self.kv is not None and len(self.slot):
            used, w = int(self.slot.max()) + 1, min(width, self.width)
            kv[:, :used, :, :w] = self.kv[:, :used, :, :w]
        self.kv = kv

    def _close_up(self) -> None:
        """Move the rows in the highest slots down into empty ones once an eighth of the slots
        the step computes are empty."""
        rows, n = self.rows, int(self.slot.max()) + 1
        if n - rows <= max(1, n // 8):
            return
        high = (self.slot >= rows).nonzero()[:, 0]
        free = self._free_slots(len(high), self.slot)
        self._copy_slots(self.slot.index_select(0, high), free, int(self.positions.index_select(0, high).max()))
        self.slot[high] = free


def whole_steps(columns: int) -> int:
    """`columns` rounded up to a multiple of COLUMNS."""
    return -(-columns // COLUMNS) * COLUMNS


def banned_tokens(history: list[int], n: int) -> list[int]:
    """Tokens that would complete an n-gram already present in `history`."""
    prefix = tuple(history[len(history) - n + 1:]) if n > 1 else ()
    return [history[i + n - 1] for i in range(len(history) - n + 1) if tuple(history[i: i + n - 1]) == prefix]


def trim_source(enc: EncoderState) -> EncoderState:
    """Drop source columns that are padding for every remaining sentence."""
    width = int((~enc.src_pad).sum(1).max())
    if width == enc.src_pad.shape[1]:
        return enc
    return EncoderState([(k[:, :, :width], v[:, :, :width]) for k, v in enc.memory], enc.src_pad[:, :width],
                        enc.global_state, enc.gate_source)

