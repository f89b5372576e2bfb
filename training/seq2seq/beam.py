"""The beam-search rule, written once for every search in the project: the offline reference
(training.seq2seq.search), the server's engine (server.engine.batch) and the CTranslate2 path (its
output-length limit and its hypotheses).

One step of a sequence: its candidates are the 2 x beam best of (row score + log-probability)
over its rows' tokens, best first, ties to the lower row, then the lower token. An EOS, or any
token at the sequence's last step, finishes a hypothesis if its candidate ranks inside the beam
(and is dropped otherwise); the best non-finishing candidates refill the beam. The sequence is
done once it holds `beam` finished hypotheses, reaches its length limit, or has no candidate left.
Both steps work on all sequences at once, each with its own beam size and rows.

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


def first_rows(counts: np.ndarray) -> np.ndarray:
    """Where each group of consecutive rows starts, given the groups' sizes."""
    return np.cumsum(counts) - counts


class Candidates(NamedTuple):
    scores: np.ndarray  # (S, K) best first; -inf where a sequence has fewer than K
    rows: np.ndarray  # (S, K) the row each one extends
    tokens: np.ndarray  # (S, K) the token it appends


def candidates(row_scores: np.ndarray, top_log_probs: np.ndarray, top_tokens: np.ndarray, counts: np.ndarray,
               k: int) -> Candidates:
    """Each sequence's k best candidates. Sequence i owns `counts[i]` consecutive rows (R in all);
    top_log_probs / top_tokens (R, m >= k) are each row's own best tokens, best first and ties to
    the lower token: a row's score shifts all its tokens alike, so a sequence's k best are among
    its rows' k best, and one top-k over them (rows side by side) is one over rows x vocabulary.

    NumPy arrays, as in select(): the search's arrays are a few hundred numbers, where a NumPy call
    costs a fraction of a torch call (the rule runs between every two decoder steps)."""
    per_row, width = top_log_probs.shape[1], int(counts.max())
    totals = top_log_probs + row_scores[:, None]
    if (counts == width).all():  # every sequence has as many rows: they lie side by side already
        index = np.arange(len(row_scores)).reshape(len(counts), width)
        padded, tokens = totals.reshape(len(counts), -1), top_tokens.reshape(len(counts), -1)
    else:
        offsets = np.arange(width)
        starts = first_rows(counts)[:, None]
        index = np.where(offsets < counts[:, None], starts + offsets, len(row_scores))  # R: padding
        padded = np.concatenate([totals, np.full((1, per_row), NEG_INF, totals.dtype)])[index].reshape(len(counts), -1)
        tokens = np.concatenate([top_tokens, np.zeros((1, per_row), top_tokens.dtype)])[index].reshape(len(counts), -1)
    at = np.argsort(-padded, axis=1, kind="stable")[:, :k]  # stable: ties to the lower row, then token
    sequence = np.arange(len(counts))[:, None]
    return Candidates(padded[sequence, at], index[sequence, at // per_row], tokens[sequence, at])


class Selection(NamedTuple):
    finishing: np.ndarray  # (S, K) candidates that finish a hypothesis
    kept: np.ndarray  # (S, K) candidates that are the next step's beams, at most `beam` each
    done: np.ndarray  # (S,) sequences whose search ends with this step


def select(scores: np.ndarray, ends: np.ndarray, last: np.ndarray, beams: np.ndarray,
           finished: np.ndarray) -> Selection:
    """One step's decisions for all sequences: scores (S, K) their candidates, best first; ends
    (S, K) where the token is EOS; last (S,) this is the sequence's last step; beams (S,) its beam
    size; finished (S,) the hypotheses it held before this step."""
    rank = np.arange(scores.shape[1])
    real = (scores > NEG_INF) & (rank < 2 * beams[:, None])
    final = real & (ends | last[:, None])
    finishing = final & (rank < beams[:, None])  # only candidates that rank inside the beam may finish
    going = real & ~final
    kept = going & (np.cumsum(going, 1) <= beams[:, None])
    done = (finished + finishing.sum(1) >= beams) | last | ~kept.any(1)
    return Selection(finishing, kept, done)
