"""The beam-search rule, written once for every search in the project: the offline reference
(training.seq2seq.search), the server's engine (server.engine.batch) and the CTranslate2 path (its
output-length limit and its hypotheses).

One step of a sequence: its candidates are the 2 x beam best of (row score + log-probability)
over its rows' tokens, best first, ties to the lower row, then the lower token. Each row's own
best tokens come first (row_top_k: best first, of equal values the lower token, as ONNX's TopK
orders them), chosen by blocks of the vocabulary whose maxima the decoder graph computes. An EOS, or any
token at the sequence's last step, finishes a hypothesis if its candidate ranks inside the beam
(and is dropped otherwise); the best non-finishing candidates refill the beam. The sequence is
done once it holds `beam` finished hypotheses, reaches its length limit, or has no candidate left.
Both steps work on all sequences at once, each with its own beam size and rows, as loops compiled
with Numba (candidates_kernel, select_kernel; the engine composes them with its own bookkeeping in
one compiled call): the step runs between every two decoder steps on a few hundred numbers, where
each NumPy call's fixed cost, not its work, was the time.

A target prefix (CTranslate2's target_prefix) is forced decoding: while a sequence's step is inside
its prefix, its rows may take only the prefix's next token, at no cost (force_prefix); so one row
goes through the prefix, the free search starts from it, and a score counts only what follows
the prefix, while a length counts the prefix too (as CTranslate2 scores it).
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from typing import NamedTuple

import numba
import numpy as np
import torch

NEG_INF = float("-inf")


@dataclass
class Hypothesis:
    tokens: list[int]  # without BOS/EOS
    score: float  # log P / length ** length_penalty (length counts EOS)
    log_prob: float

    @classmethod
    def ending(cls, prefix: list[int], token: int, log_prob: float, length_penalty: float,
               eos: int) -> "Hypothesis":
        """The hypothesis that `token` ends after `prefix`: the length counts the last token,
        EOS or not, but EOS is not part of the output."""
        tokens = prefix if token == eos else prefix + [token]
        return cls(tokens, log_prob / (len(prefix) + 1) ** length_penalty, log_prob)


def output_limit(source_tokens: int, a: float, b: int, cap: int) -> int:
    """Most tokens a search may generate (EOS counted) for a source of `source_tokens` pieces:
    a * n + b rounded down, at least 1, at most `cap`.

    The ratio is taken as the decimal a user writes: the wire type of max_length_ratio is float32,
    where 1.3 is 1.29999995, so float arithmetic gives 90 * 1.3 + 10 = 126.9999... -> 126 (and
    float64 gives 127 only because its own error happens to round up; 0.29 * 100 gives 28). We
    read a as the shortest decimal that is the same float32 and multiply exactly: 127, the
    number the formula promises."""
    return max(1, min(int(decimal_ratio(a) * source_tokens + b), cap))


@lru_cache(maxsize=256)  # a handful of distinct ratios in practice; parsing one costs ~10 us per text
def decimal_ratio(a: float) -> Fraction:
    """The shortest decimal that is the same float32 as `a`, exactly (output_limit)."""
    return Fraction(np.format_float_positional(np.float32(a), unique=True, trim="-"))


def force_prefix(log_probs: torch.Tensor, rows, token: int) -> None:
    """In place: rows `rows` of (rows, V) log-probabilities may take only `token`, with
    log-probability 0 (a prefix is given, not chosen: it adds nothing to the score)."""
    log_probs[rows] = NEG_INF
    log_probs[rows, token] = 0.0


TOP_K_BLOCK = 64  # vocabulary columns per block of row_top_k


def block_maxima(log_probs: torch.Tensor) -> torch.Tensor:
    """(R, ceil(V / TOP_K_BLOCK)): the largest value of each block of TOP_K_BLOCK columns of each row,
    the last block padded with -inf. In plain torch ops, so that the decoder graph traces it (one
    ReduceMax, a vectorised pass over the row) and row_top_k needs only a few blocks of the row."""
    pad = -int(log_probs.shape[1]) % TOP_K_BLOCK  # static: a constant in the traced graph
    if pad:
        log_probs = torch.nn.functional.pad(log_probs, (0, pad), value=NEG_INF)
    return log_probs.reshape(-1, int(log_probs.shape[1]) // TOP_K_BLOCK, TOP_K_BLOCK).amax(-1)


def row_top_k(log_probs: torch.Tensor, k: int, maxima: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's k best (log-probabilities, tokens) of (R, V) float32, each (R, k): best first, of
    equal values the lower token first (ONNX TopK's order); k <= V. `maxima`: block_maxima of these
    log-probabilities where the step has them already (the decoder graph's output), else computed.
    On a GPU, torch's topk (its order of equal values is its own)."""
    if log_probs.device.type != "cpu":
        return log_probs.topk(k, dim=1)
    if maxima is None:
        maxima = block_maxima(log_probs)
    values, tokens = top_k_arrays(log_probs.detach().numpy(), maxima.detach().numpy(), k)
    return torch.from_numpy(values), torch.from_numpy(tokens)


def host_top_k(log_probs: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
    """row_top_k as NumPy arrays on the host, where the search runs (copied from an accelerator)."""
    values, tokens = row_top_k(log_probs, k)
    return values.cpu().numpy(), tokens.cpu().numpy()


def top_k_arrays(x: np.ndarray, maxima: np.ndarray, k: int,
                 out: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """row_top_k on NumPy arrays: x (R, V) float32 and its block maxima -> (values, tokens) (R, k),
    written into `out` where given (float32 and int64 arrays of that shape): for a caller that keeps
    its arrays from step to step (the ONNX Runtime backend's)."""
    values, tokens = out if out is not None else (np.empty((len(x), k), np.float32), np.empty((len(x), k), np.int64))
    top_k_kernel(x, maxima, TOP_K_BLOCK, values, tokens)
    return values, tokens


@numba.njit(cache=True, nogil=True)
def top_k_kernel(x, maxima, block, values, tokens):
    """row_top_k into values, tokens (R, k). A row's m-th best block maximum t (m = k, or every block
    where there are fewer) is reached by m values in m blocks, so no value below t and no block
    whose maximum is below t holds one of the k best: the row is read only in the few blocks that
    reach t, in column order, and an insertion that moves only past strictly smaller values keeps
    the lower of equal tokens first. At 111 rows x 8000 this takes about 0.15 ms, where the graph's
    TopK over the blocks' maxima, its TopK over the chosen blocks and their gathers took 0.33 (ONNX
    Runtime's profile, ad hoc): its TopK costs about a microsecond per row and call."""
    n_rows, vocab = x.shape
    k, n_blocks = values.shape[1], maxima.shape[1]
    m = min(k, n_blocks)
    best = np.empty(m, x.dtype)  # the row's m best block maxima, best first
    which = np.empty(m, np.int64)  # their blocks, which insert() keeps; the scan tests each block's maximum instead
    for r in range(n_rows):
        held = 0
        for b in range(n_blocks):
            held = insert(best, held, maxima[r, b], which, b)
        t = best[m - 1] if m == k else NEG_INF
        held = 0
        for b in range(n_blocks):
            if maxima[r, b] < t:
                continue
            for j in range(b * block, min((b + 1) * block, vocab)):
                if not x[r, j] < t:
                    held = insert(values[r], held, x[r, j], tokens[r], j)


@numba.njit(cache=True, nogil=True, inline="always")
def insert(values, held, value, at, index) -> int:
    """value (from index) into values[:held], kept best first, of equal values the earlier first,
    at most len(values) of them; at[] follows values[]. Returns how many are held now."""
    size = len(values)
    if held == size and not value > values[size - 1]:
        return held
    p = held if held < size else size - 1
    while p > 0 and value > values[p - 1]:
        values[p], at[p] = values[p - 1], at[p - 1]
        p -= 1
    values[p], at[p] = value, index
    return held + 1 if held < size else held


@numba.njit(cache=True, nogil=True)  # also inside the engine's compiled step (server.engine.batch.decide)
def first_rows(counts: np.ndarray) -> np.ndarray:
    """Where each group of consecutive rows starts, given the groups' sizes."""
    return np.cumsum(counts) - counts


class Candidates(NamedTuple):
    scores: np.ndarray  # (S, K) best first; -inf where a sequence has fewer than K
    rows: np.ndarray  # (S, K) the row each one extends
    tokens: np.ndarray  # (S, K) the token it appends


def candidates(row_scores: np.ndarray, top_log_probs: np.ndarray, top_tokens: np.ndarray, counts: np.ndarray,
               k: int) -> Candidates:
    """Each sequence's k best candidates (fewer where all its rows hold fewer: K = min(k, widest
    sequence's rows x m), padded with -inf, row R, token 0). Sequence i owns `counts[i]` consecutive
    rows (R in all); top_log_probs / top_tokens (R, m) are each row's own best tokens, best first and
    ties to the lower token. A row's score shifts all its tokens alike, so a sequence's k best are
    among its rows' k best: a merge of its rows' lists, ties to the lower row, is its top-k over
    rows x vocabulary."""
    return Candidates(*candidates_kernel(row_scores, top_log_probs, top_tokens, counts, k))


@numba.njit(cache=True, nogil=True)
def candidates_kernel(row_scores, top_log_probs, top_tokens, counts, k):
    n_seqs, per_row = len(counts), top_log_probs.shape[1]
    width = counts.max() if n_seqs else 0
    m = min(k, width * per_row)
    scores = np.empty((n_seqs, m), top_log_probs.dtype)
    rows = np.empty((n_seqs, m), np.int64)
    tokens = np.empty((n_seqs, m), top_tokens.dtype)
    head = np.zeros(width, np.int64)  # each row's next unused candidate
    start = 0
    for i in range(n_seqs):
        head[:] = 0
        for j in range(m):
            best, at = NEG_INF, -1
            for r in range(counts[i]):
                if head[r] < per_row:
                    total = top_log_probs[start + r, head[r]] + row_scores[start + r]
                    if at < 0 or total > best:  # strictly better: of equals, the lower row
                        best, at = total, r
            if at < 0:  # the sequence's rows hold fewer than m
                scores[i, j], rows[i, j], tokens[i, j] = NEG_INF, len(row_scores), 0
            else:
                scores[i, j], rows[i, j], tokens[i, j] = best, start + at, top_tokens[start + at, head[at]]
                head[at] += 1
        start += counts[i]
    return scores, rows, tokens


class Selection(NamedTuple):
    finishing: np.ndarray  # (S, K) candidates that finish a hypothesis
    kept: np.ndarray  # (S, K) candidates that are the next step's beams, at most `beam` each
    done: np.ndarray  # (S,) sequences whose search ends with this step


def select(scores: np.ndarray, ends: np.ndarray, last: np.ndarray, beams: np.ndarray,
           finished: np.ndarray) -> Selection:
    """One step's decisions for all sequences: scores (S, K) their candidates, best first; ends
    (S, K) where the token is EOS; last (S,) this is the sequence's last step; beams (S,) its beam
    size; finished (S,) the hypotheses it held before this step."""
    return Selection(*select_kernel(scores, ends, last, beams, finished))


@numba.njit(cache=True, nogil=True)
def select_kernel(scores, ends, last, beams, finished):
    n_seqs, k = scores.shape
    finishing, kept = np.zeros((n_seqs, k), np.bool_), np.zeros((n_seqs, k), np.bool_)
    done = np.empty(n_seqs, np.bool_)
    for i in range(n_seqs):
        n_finishing = n_kept = 0
        for j in range(min(k, 2 * beams[i])):
            if not scores[i, j] > NEG_INF:  # no candidate (and never a NaN one)
                continue
            if ends[i, j] or last[i]:
                if j < beams[i]:  # only candidates that rank inside the beam may finish
                    finishing[i, j] = True
                    n_finishing += 1
            elif n_kept < beams[i]:
                kept[i, j] = True
                n_kept += 1
        done[i] = finished[i] + n_finishing >= beams[i] or last[i] or n_kept == 0
    return finishing, kept, done
