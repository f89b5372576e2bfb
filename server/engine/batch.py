"""The running batch: every live beam of every admitted sequence as one row of one decoder step.

Layout (rows of a sequence are contiguous; sequences in admission order):
  enc       EncoderState with one entry per sequence (never tiled per beam)
  row_seq   (R,) which sequence (index into `seqs`, and into enc) a row belongs to
  tokens    (R,) each row's last token;  positions (R,) its next target position
  scores    (R,) cumulative log-probability;  history: each row's tokens so far
  cache     per decoder layer (K, V), each (R, H, T, d_h);  past_pad (R, T) True = padding
A sequence that joins late gets a left-padded cache (masked by past_pad); columns that are
padding for every row are trimmed after each step, so T stays the longest live history.

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
        self.cache: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.past_pad = torch.empty(0, 0, dtype=torch.bool)

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
        n, width = len(seqs), self.past_pad.shape[1]
        empty = torch.zeros(n, self.n_heads, width, self.d_head, device=self.device)
        if self.cache:
            self.cache = [(torch.cat([k, empty]), torch.cat([v, empty])) for k, v in self.cache]
        else:
            self.cache = [(empty, empty)] * self.cfg.dec_layers
        self.past_pad = torch.cat([self.past_pad, torch.ones(n, width, dtype=torch.bool)])
        first = len(self.seqs)
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
        return self.tokens, self.positions, self.row_seq, self.past_pad, self.enc, self.cache

    def advance(self, log_probs: torch.Tensor, cache: list) -> list[Sequence]:
        """Apply one step's log-probabilities (R, V) and grown cache; returns the sequences that
        finished (already removed from the batch; their on_done is the caller's to trigger)."""
        log_probs = self._constrain(log_probs.float())
        vocab = log_probs.shape[1]
        beam_max = max(s.options.beam for s in self.seqs)
        # Two-stage top-k: the best 2*beam tokens of each row, then the best 2*beam of each
        # sequence among its rows' candidates (the same set as one top-k over rows x vocab).
        # A row's score shifts all its tokens alike, so it is added after the first stage.
        row_scores, row_tokens = row_topk()(log_probs, min(2 * beam_max, vocab))
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
        self._reorder(keep_rows, new_tokens, new_scores, new_counts, alive, cache)
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
        self._reorder(rows, self.tokens[rows].tolist(), self.scores[rows].tolist(), counts, keep, self.cache,
                      grow=False)

    # ---- internals -------------------------------------------------------------------------
    def _constrain(self, log_probs: torch.Tensor) -> torch.Tensor:
        """min_length (no EOS before that many tokens) and no_repeat_ngram, per row."""
        constrained = [i for i, s in enumerate(self.seqs) if s.step < s.options.min_length or s.options.no_repeat_ngram]
        if not constrained:  # the common case: nothing to do per row
            return log_probs
        starts = [0]
        for c in self.counts:
            starts.append(starts[-1] + c)
        for i in constrained:
            seq, rows = self.seqs[i], range(starts[i], starts[i + 1])
            if seq.step < seq.options.min_length:
                log_probs[list(rows), self.cfg.eos_id] = NEG_INF
            n = seq.options.no_repeat_ngram
            for r in rows if n else ():
                banned = banned_tokens(self.history[r], n) if len(self.history[r]) >= n - 1 else []
                if banned:
                    log_probs[r, banned] = NEG_INF
        return log_probs

    def _reorder(self, rows: list[int], tokens: list[int], scores: list[float], counts: list[int],
                 alive: list[int], cache: list, grow: bool = True) -> None:
        """Rows `rows` (old indices) survive, in order, as beams of sequences `alive`."""
        index = torch.tensor(rows, dtype=torch.long)
        past_pad = self.past_pad
        if grow:  # the step appended one (real) key per row
            past_pad = torch.cat([past_pad, torch.zeros(len(past_pad), 1, dtype=torch.bool)], 1)
        past_pad = past_pad.index_select(0, index)
        cache = [(k.index_select(0, index), v.index_select(0, index)) for k, v in cache]
        live = (~past_pad).any(0).nonzero()
        first = int(live[0]) if len(live) else past_pad.shape[1]
        if first:  # columns that are padding for every row
            past_pad = past_pad[:, first:]
            cache = [(k[:, :, first:], v[:, :, first:]) for k, v in cache]
        old_positions = self.positions
        self.positions = old_positions.index_select(0, index) + (1 if grow else 0)
        self.history = [self.history[r] + [t] for r, t in zip(rows, tokens)] if grow else \
            [self.history[r] for r in rows]
        self.tokens = torch.tensor(tokens, dtype=torch.long)
        self.scores = torch.tensor(scores, dtype=torch.float32)
        self.row_seq = torch.repeat_interleave(torch.arange(len(alive)), torch.tensor(counts, dtype=torch.long))
        self.counts = counts
        self.cache, self.past_pad = cache, past_pad
        if len(alive) < len(self.seqs):
            self.seqs = [self.seqs[i] for i in alive]
            self.enc = trim_source(self.enc.select(torch.tensor(alive, dtype=torch.long))) if alive else None
        if not alive:
            self.enc = None
            self.past_pad = torch.empty(0, 0, dtype=torch.bool)
            self.cache = []


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

