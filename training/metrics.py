"""Corpus metrics (sacreBLEU BLEU/chrF, ROUGE) and paired bootstrap resampling.

Convention everywhere: ``hyps[i]`` is one system output and ``refs[i]`` is the
list of references for it (one or more; AESLC dev has four).

Every metric is computed as "sum per-example statistics, then finish": BLEU and
chrF sum sacreBLEU's sufficient statistics (n-gram matches/totals, lengths),
ROUGE sums per-example F1 and divides by the count. That makes the corpus score
and each bootstrap resample the same cheap operation.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Sequence

import numpy as np
from sacrebleu.metrics import BLEU, CHRF

ROUGE_KEYS = ("rouge1", "rouge2", "rougeL")
METRICS = ("bleu", "chrf") + ROUGE_KEYS

Refs = Sequence[Sequence[str]]


def _check(hyps: Sequence[str], refs: Refs) -> None:
    if len(hyps) != len(refs):
        raise ValueError(f"{len(hyps)} hypotheses but {len(refs)} reference lists")
    if len(hyps) == 0:
        raise ValueError("empty corpus: nothing to score")
    for i, r in enumerate(refs):
        # A bare string would silently be read as a list of characters.
        if isinstance(r, str):
            raise TypeError(f"refs[{i}] is a string; refs[i] must be a list of references")
        if len(r) == 0:
            raise ValueError(f"refs[{i}] has no references")


def _to_streams(refs: Refs) -> list[list[str]]:
    """refs[i][k] (per example) -> streams[k][i] (sacreBLEU's layout)."""
    counts = sorted({len(r) for r in refs})
    if len(counts) != 1:
        raise ValueError(
            "BLEU/chrF need the same number of references for every example; "
            f"found reference counts {counts}")
    return [list(stream) for stream in zip(*refs)]


# ---------------------------------------------------------------- statistics

def _sacre_stats(metric, hyps: Sequence[str], refs: Refs):
    """Per-example sufficient statistics from sacreBLEU, and the finisher that
    turns their (corpus or resample) sum into a score."""
    _check(hyps, refs)
    # sacreBLEU's own per-segment statistics, so sums match corpus_score exactly.
    stats = metric._extract_corpus_statistics(list(hyps), _to_streams(refs))

    def finish(summed: np.ndarray) -> float:
        return float(metric._compute_score_from_stats(summed.tolist()).score)

    return np.asarray(stats, dtype=np.int64), finish


@lru_cache(maxsize=8)
def _rouge_scorer(keys: tuple[str, ...]):
    from rouge_score import rouge_scorer  # lazy: only ROUGE users need it
    return rouge_scorer.RougeScorer(list(keys), use_stemmer=True)


def rouge_per_example(hyps: Sequence[str], refs: Refs,
                      keys: Sequence[str] = ROUGE_KEYS) -> np.ndarray:
    """(N, len(keys)) array of ROUGE F1 x100; each metric takes its own max
    over the example's references."""
    _check(hyps, refs)
    scorer = _rouge_scorer(tuple(keys))  # only the asked variants: ROUGE is the slow one
    out = np.zeros((len(hyps), len(keys)))
    for i, (hyp, rs) in enumerate(zip(hyps, refs)):
        for ref in rs:
            s = scorer.score(ref, hyp)  # (target, prediction)
            out[i] = np.maximum(out[i], [100 * s[k].fmeasure for k in keys])
    return out


def _per_example(metric: str, hyps: Sequence[str], refs: Refs):
    """(stats (N, K), finish) for one metric name."""
    if metric == "bleu":
        return _sacre_stats(BLEU(), hyps, refs)
    if metric == "chrf":
        return _sacre_stats(CHRF(), hyps, refs)
    if metric in ROUGE_KEYS:
        col = rouge_per_example(hyps, refs, (metric,))
        n = len(hyps)
        return col, lambda summed: float(summed[0] / n)
    raise ValueError(f"unknown metric {metric!r}; choose from {METRICS}")


# ------------------------------------------------------------ public scores

def bleu(hyps: Sequence[str], refs: Refs) -> float:
    """Detokenised corpus BLEU (sacreBLEU defaults: 13a, exp smoothing)."""
    stats, finish = _per_example("bleu", hyps, refs)
    return finish(stats.sum(axis=0))


def chrf(hyps: Sequence[str], refs: Refs) -> float:
    """Corpus chrF (sacreBLEU defaults: char order 6, beta 2)."""
    stats, finish = _per_example("chrf", hyps, refs)
    return finish(stats.sum(axis=0))


def rouge(hyps: Sequence[str], refs: Refs) -> dict:
    """Mean over examples of ROUGE-1/2/L F1 x100 (Porter stemming); with
    several references an example counts its best reference per metric."""
    means = rouge_per_example(hyps, refs).mean(axis=0)
    return {k: float(v) for k, v in zip(ROUGE_KEYS, means)}


def expand_metrics(names: Sequence[str]) -> list[str]:
    """Metric names with "rouge" expanded to its three variants."""
    out: list[str] = []
    for name in names:
        for m in (ROUGE_KEYS if name == "rouge" else (name,)):
            if m not in METRICS:
                raise ValueError(f"unknown metric {m!r}; choose from {METRICS + ('rouge',)}")
            if m not in out:
                out.append(m)
    return out


def score(hyps: Sequence[str], refs: Refs, metrics: Sequence[str] = ("bleu", "chrf")) -> dict:
    """{metric: score} for the requested metrics ("rouge" gives all three)."""
    names = expand_metrics(metrics)
    out: dict = {}
    if "bleu" in names:
        out["bleu"] = bleu(hyps, refs)
    if "chrf" in names:
        out["chrf"] = chrf(hyps, refs)
    if any(k in names for k in ROUGE_KEYS):
        r = rouge(hyps, refs)  # one pass gives all three
        out.update({k: r[k] for k in ROUGE_KEYS if k in names})
    return out


def paired_bootstrap(hyps_a: Sequence[str], hyps_b: Sequence[str], refs: Refs,
                     metric: str, samples: int = 1000, seed: int = 12345) -> dict:
    """Paired bootstrap resampling (Koehn, 2004): is system b better than a?

    Each sample draws N example indices with replacement and scores both
    systems on the same resampled corpus.

    - delta: score(b) - score(a) on the full set.
    - p_value: fraction of samples where b does NOT beat a (delta <= 0);
      a one-sided p-value for "b > a". A system against itself gives 1.0;
      p < 0.05 means b won in more than 95% of the resamples.
    - ci95: [2.5, 97.5] percentiles of the resampled delta.
    """
    if len(hyps_a) != len(hyps_b):
        raise ValueError(f"system a has {len(hyps_a)} lines, system b {len(hyps_b)}")
    stats_a, finish = _per_example(metric, hyps_a, refs)
    stats_b, _ = _per_example(metric, hyps_b, refs)

    n = len(refs)
    rng = np.random.default_rng(seed)
    deltas = np.empty(samples)
    for s in range(samples):
        idx = rng.integers(0, n, size=n)  # same indices for both: paired
        deltas[s] = finish(stats_b[idx].sum(axis=0)) - finish(stats_a[idx].sum(axis=0))

    a, b = finish(stats_a.sum(axis=0)), finish(stats_b.sum(axis=0))
    lo, hi = np.percentile(deltas, [2.5, 97.5])
    return {
        "metric": metric,
        "a": a,
        "b": b,
        "delta": b - a,
        "p_value": float(np.mean(deltas <= 0)),
        "ci95": [float(lo), float(hi)],
        "samples": samples,
    }


__all__ = ["bleu", "chrf", "rouge", "rouge_per_example", "score", "expand_metrics",
           "paired_bootstrap", "METRICS", "ROUGE_KEYS"]
